"""What a web page can make the daemon do: read, never write (cross-site request forgery).

A browser attaches ``Origin`` to every request a page sends with a method other than GET or
HEAD, and lets a page of another site send a POST without asking the server first (no CORS
preflight) when its body is ``text/plain``, ``application/x-www-form-urlencoded`` or
``multipart/form-data``. A daemon without an API key would take such a POST from any page its
user opens. Two rules, checked in front of every route, the infer fast path included
(:func:`guarded`, used by the primary's app and by each serving worker's):

- a request with a method other than GET or HEAD whose ``Origin`` is neither the daemon's own
  (the scheme, host and port the request was sent to: ``Host``, as the dashboard at ``/ui``
  sends it) nor listed in ``--allow-origin`` is refused with 403. GET and HEAD change nothing,
  and with no CORS headers the page cannot read what they answer. Clients that are not
  browsers (curl, tritonclient, mmad_client) send no ``Origin`` and are not affected;
- a request that names its body's type must name one its route reads: JSON for every route,
  the binary tensor extension (``application/octet-stream``) too for infer and train, and only
  ``application/octet-stream`` for the safetensors uploads (weights, dataset chunks); anything
  else is 415. No ``Content-Type`` at all is read as the route's own type: tritonclient.http
  sends none.

Origins listed in ``--allow-origin`` also get CORS headers (Starlette's ``CORSMiddleware``), so
that a page served from them can call the API; ``*`` allows every origin.
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware

from mmad.errors import CrossSiteRequest, MMADError, UnsupportedMediaType
from mmad.server.errors import error_response, status_for
from mmad.settings import normalise_origin, parse_allowed_origins

SAFE_METHODS = frozenset({"GET", "HEAD"})
JSON, OCTETS = "application/json", "application/octet-stream"
# the body types a page of any site may send without a preflight (the Fetch standard's list)
NO_PREFLIGHT_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
# what a page allowed by --allow-origin may send and read (CORS)
CORS_REQUEST_HEADERS = ["Authorization", "Content-Type", "Content-Encoding", "Accept-Encoding",
                        "Inference-Header-Content-Length"]
CORS_RESPONSE_HEADERS = ["Inference-Header-Content-Length", "Content-Encoding", "Retry-After", "Mmad-Model-Version",
                         "Mmad-Step"]


def body_types(method: str, path: str) -> tuple[str, ...]:
    """The media types the route of ``method`` ``path`` reads its body as."""
    parts = path.strip("/").split("/")
    if len(parts) >= 4 and parts[0] == "v2" and parts[1] == "models":
        tail = parts[3:]
        pinned = len(tail) == 3 and tail[0] == "versions"  # .../versions/{v}/infer
        if method == "POST" and (tail in (["infer"], ["train"]) or (pinned and tail[2] == "infer")):
            return JSON, OCTETS
        chunks = len(tail) == 3 and tail[0] == "datasets" and tail[2] == "chunks"  # .../datasets/{d}/chunks
        if (method == "PUT" and tail == ["weights"]) or (method == "POST" and (tail == ["datasets"] or chunks)):
            return (OCTETS,)
    return (JSON,)


class RequestGuard:
    """The two rules of the module docstring, for one daemon's allowed origins."""

    def __init__(self, allowed: frozenset[str]):
        self.allow_all = "*" in allowed
        self.allowed = allowed

    def refusal(self, scope) -> MMADError | None:
        """Why this request is refused, or None."""
        method = scope["method"]
        if method in SAFE_METHODS:
            return None
        origin = content_type = host = None
        for name, value in scope["headers"]:
            if name == b"origin":
                origin = value
            elif name == b"content-type":
                content_type = value
            elif name == b"host":
                host = value
        if origin is not None and not self.allow_all:
            sent = normalise_origin(origin.decode("latin-1"))
            own = own_origin(scope, host)
            if sent not in self.allowed and sent != own:
                return CrossSiteRequest(
                    f"a {method} from a page of {sent} is refused: this daemon takes requests other than GET "
                    f"and HEAD only from its own pages ({own}) and from the origins given with --allow-origin")
        if content_type is not None:
            media = content_type.decode("latin-1").partition(";")[0].strip().lower()
            accepted = body_types(method, scope["path"])
            if media and media not in accepted:
                return UnsupportedMediaType(media_type_words(media, accepted))
        return None


def own_origin(scope, host: bytes | None) -> str:
    """The origin the request was sent to: its scheme and ``Host`` (the listening address
    without one)."""
    if host:
        authority = host.decode("latin-1")
    else:
        server = scope.get("server") or ("", None)
        address = f"[{server[0]}]" if ":" in (server[0] or "") else server[0]
        authority = address if server[1] is None else f"{address}:{server[1]}"
    return normalise_origin(f"{scope.get('scheme', 'http')}://{authority}")


def media_type_words(media: str, accepted: tuple[str, ...]) -> str:
    words = " or ".join(accepted)
    message = f"this route reads a body of type {words}; the request says Content-Type {media}"
    if media == "application/x-www-form-urlencoded":
        message += f" (what curl -d and --data-binary send unless told otherwise: add -H 'Content-Type: {accepted[0]}')"
    return message


class GuardMiddleware:
    """ASGI middleware applying a :class:`RequestGuard` to every HTTP request."""

    def __init__(self, app, guard: RequestGuard):
        self.app = app
        self.guard = guard

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            refused = self.guard.refusal(scope)
            if refused is not None:
                return await error_response(status_for(refused), str(refused))(scope, receive, send)
        await self.app(scope, receive, send)


def guarded(app, allow_origin: str):
    """``app`` behind the rules (and CORS for the allowed origins, when any are given)."""
    allowed = parse_allowed_origins(allow_origin)
    if allowed:
        app = CORSMiddleware(app, allow_origins=["*"] if "*" in allowed else sorted(allowed),
                             allow_methods=["GET", "HEAD", "POST", "PUT", "DELETE"],
                             allow_headers=CORS_REQUEST_HEADERS, expose_headers=CORS_RESPONSE_HEADERS)
    return GuardMiddleware(app, RequestGuard(allowed))
