"""mmad_client: Python client for the mmad daemon (Open Inference Protocol v2 + mmad extensions).

::

    import numpy as np
    from mmad_client import Client

    with Client("http://127.0.0.1:8000") as client:
        client.create_model("mlp", spec)            # tiny-cuda-nn JSON
        y = client.infer("mlp", np.random.rand(1024, 64).astype(np.float32))
        status = client.train("mlp", x, y_true, steps=500, batch_size=4096)

:class:`Client` blocks, :class:`AsyncClient` has the same methods as coroutines. Tensors go
as NumPy arrays over the binary tensor extension by default; every error is a
:class:`MMADClientError` (see :mod:`mmad_client.errors`). Calls that can be repeated safely are
tried again after a dropped connection or a 503 (:class:`Retry`). Depends on httpx, NumPy and
tenacity.
"""

from httpx import Timeout

from ._async import AsyncClient
from ._base import DEFAULT_BASE_URL, DEFAULT_TIMEOUT, __version__
from ._binary import decode_safetensors, encode_safetensors
from ._retry import DEFAULT_RETRY, Retry
from ._sync import Client
from .errors import (
    BadRequest, Conflict, Forbidden, HTTPStatusError, JobFailed, MMADClientError, NotFound,
    PayloadTooLarge, ProtocolError, ServerError, ServiceUnavailable, TimeoutError, TransportError,
    Unauthorized,
)

__all__ = [
    "Client", "AsyncClient", "Timeout", "Retry", "DEFAULT_BASE_URL", "DEFAULT_TIMEOUT", "DEFAULT_RETRY",
    "__version__",
    "encode_safetensors", "decode_safetensors",
    "MMADClientError", "HTTPStatusError", "BadRequest", "Unauthorized", "Forbidden", "NotFound",
    "Conflict", "PayloadTooLarge", "ServerError", "ServiceUnavailable", "TransportError",
    "TimeoutError", "ProtocolError", "JobFailed",
]
