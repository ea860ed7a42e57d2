"""The API key, checked the same way by every front end.

A front end reads the credentials its transport carries (HTTP's ``Authorization`` header, gRPC's
``authorization`` metadata), and :func:`authenticate` turns them into the
:class:`~mmad.engine.api.Caller`'s ``key_verified``; the engine then decides what such a caller
may do.
"""

from __future__ import annotations

import hmac

from mmad.errors import Forbidden, Unauthorized


def authenticate(expected: str | None, authorization: str | None, where: str) -> bool:
    """True when ``authorization`` is ``Bearer <expected>``; False when no key is configured.
    Raises :class:`~mmad.errors.Unauthorized` when a key is configured and none was sent,
    :class:`~mmad.errors.Forbidden` when the one sent is wrong. ``where`` names how the key is
    sent on this front end, for the message."""
    if expected is None:
        return False
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized(f"this call needs {where}")
    if not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise Forbidden("the API key is not valid")
    return True
