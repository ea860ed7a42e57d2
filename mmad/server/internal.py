"""The internal routes between a primary and its serving workers (``mmad serve --workers``):
their path prefix and the token that opens them (made at start, never shown)."""

from __future__ import annotations

import hmac
from typing import Any

INTERNAL_PREFIX = "/_mmad/worker"
TOKEN_HEADER = "mmad-worker-token"


def check_token(headers: Any, token: str) -> bool:
    given = headers.get(TOKEN_HEADER, "")
    return bool(given) and hmac.compare_digest(given.encode(), token.encode())
