"""Modules generated from mmad/grpc/protos/ by scripts/generate_grpc.py (do not edit them).

Their messages live in :data:`POOL`, a descriptor pool of mmad's own: tritonclient registers its
copy of the same proto files in protobuf's default pool, and one process may hold both.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
