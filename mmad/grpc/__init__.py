"""The gRPC front end: Triton's ``inference.GRPCInferenceService`` (KServe's ``grpc-v2``
protocol), served by ``mmad serve`` on ``--grpc-port`` (default 8001) over the same engine as HTTP.

- ``mmad/grpc/protos/``: Triton's published protos, vendored unchanged with their licence;
- :mod:`mmad.grpc.generated`: the modules grpcio-tools makes of them (scripts/generate_grpc.py);
- :mod:`mmad.grpc.service`: the handlers, through :class:`~mmad.engine.api.InferenceClient` only;
- :mod:`mmad.grpc.tensors`: infer messages to the engine's types and back;
- :mod:`mmad.grpc.errors`: mmad's errors as gRPC status codes;
- :mod:`mmad.grpc.server`: start and stop.

docs/api.md ("gRPC") says what is served.
"""
