"""Every error mmad raises, in one tree.

::

    MMADError                      base of everything below
    ├── SpecError                  a model spec is invalid; ``.field`` names the JSON path
    ├── BackendUnavailable         a backend (or variant) cannot run here; ``.reason`` says why
    ├── CompileError               a kernel failed to compile; ``.log`` is the compiler's output,
    │                              ``.source`` the source, ``str()`` shows both with line numbers
    ├── LaunchError                a kernel launch, allocation or device call failed; the driver's
    │                              words are in the message
    ├── CacheError                 the kernel cache directory cannot be used
    ├── ModelNotFound              no model (or version) of that name
    ├── ConflictError              the request conflicts with current state (e.g. model exists)
    │   └── Diverged               training produced NaN/Inf loss or weights; nothing was published
    ├── InvalidInput               a tensor or request field is malformed (shape, dtype, NaN ...)
    │   └── NonFiniteInput         rows given to a forward hold NaN or Inf (``check_finite=True``)
    ├── PayloadTooLarge            a body or tensor exceeds a configured limit
    ├── Overloaded                 a queue is full; try again later
    ├── NotReady                   the daemon cannot serve yet (starting or stopping)
    │   └── ModelNotReady          the model exists but is not loaded
    ├── StoreUnwritable            the model store refused a write (read-only, no permission);
    │   │                          nothing served changed
    │   └── StorageFull            the store's disk or quota is full; nothing served changed
    ├── DeviceMemoryFull           what was asked for does not fit in the device's free memory
    │                              (checked before allocating); nothing was allocated
    ├── RegionFull                 a shared-memory region's filesystem has no room for an output
    ├── StoreDamaged               what the store holds for a model or version is damaged
    ├── Unauthorized               no API key was sent to a daemon that requires one
    ├── Forbidden                  the API key sent is wrong, or the daemon's settings refuse the
    │                              action to this client
    ├── CrossSiteRequest           a page of another site sent a request that would change something
    └── UnsupportedMediaType       the body's Content-Type is not one the route reads

The HTTP layer (``mmad/server/errors.py``) maps these onto status codes (400, 401, 403, 404,
409 (also a damaged stored model or version), 413, 415, 503, 507 for a store that cannot be written,
a device without the memory asked for or a shared-memory region without room; compile, launch and cache failures 500); anything not in this tree that escapes a handler
is a bug and becomes a 500.
"""

from __future__ import annotations


class MMADError(Exception):
    """Base class of every error mmad raises on purpose."""


class SpecError(MMADError, ValueError):
    """A model specification is invalid.

    ``field`` is the dotted JSON path of the offending field (``network.n_neurons``).
    """

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class BackendUnavailable(MMADError):
    """A backend or variant cannot run on this machine; ``reason`` is in plain words."""

    def __init__(self, backend: str, reason: str):
        self.backend = backend
        self.reason = reason
        super().__init__(f"backend {backend!r} is unavailable: {reason}")


class CompileError(MMADError):
    """A kernel failed to compile.

    Carries the compiler's log and the source; ``str()`` shows the log followed by the
    source with line numbers, so the line the log names can be found at once.
    """

    def __init__(self, what: str, log: str, source: str = ""):
        self.what = what
        self.log = log
        self.source = source
        numbered = "\n".join(f"{i + 1:5d}  {line}" for i, line in enumerate(source.splitlines()))
        text = f"failed to compile {what}:\n{log.strip()}"
        if numbered:
            text += f"\n--- source ---\n{numbered}"
        super().__init__(text)


class LaunchError(MMADError):
    """A kernel launch, device allocation or other device call failed."""


class CacheError(MMADError):
    """The kernel cache directory cannot be used."""


class ModelNotFound(MMADError, KeyError):
    """No model (or version) of that name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "model not found"


class ConflictError(MMADError):
    """The request conflicts with the current state."""


class Diverged(ConflictError):
    """A training step produced a non-finite loss or non-finite weights (HTTP 409).

    The step's result is never published: the live weights are put back to the last finite
    state and no version of non-finite weights is written. ``step`` and ``losses``: where a loss
    went non-finite, the step it did and the losses of the call's steps up to it (None otherwise).
    """

    step: int | None = None
    losses: list[float] | None = None


class InvalidInput(MMADError, ValueError):
    """A request's tensors or fields are malformed."""


class NonFiniteInput(InvalidInput):
    """``forward_to_host(..., check_finite=True)`` was given rows holding NaN or Inf (a backend
    that copies to a device checks there, after the upload)."""

    def __init__(self, message: str = "the input rows hold NaN or Inf"):
        super().__init__(message)


class PayloadTooLarge(MMADError):
    """A body or tensor exceeds a configured limit."""


class Overloaded(MMADError):
    """A bounded queue is full."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        self.retry_after_s = retry_after_s
        super().__init__(message)


class NotReady(MMADError):
    """The daemon cannot serve yet: it is starting or stopping (HTTP 503)."""


class ModelNotReady(NotReady):
    """The model exists in the store but is not loaded (HTTP 503)."""

    def __init__(self, name: str):
        super().__init__(f"model {name!r} is not loaded; POST /v2/repository/models/{name}/load")


class StoreUnwritable(MMADError):
    """The model store refused a write: read-only or no permission (HTTP 507).

    The message is in the user's terms and names no filesystem path; nothing served changed.
    """


class StorageFull(StoreUnwritable):
    """The model store's disk or quota is full (ENOSPC, EDQUOT) (HTTP 507); nothing served changed."""


class DeviceMemoryFull(MMADError):
    """The device lacks the free memory something needs, e.g. a dataset held for training (HTTP
    507, Insufficient Storage); the check comes before any allocation, so nothing changed."""


class RegionFull(MMADError):
    """An output could not be written into its shared-memory region: the filesystem of the
    region's object has no room (a sparse object larger than its /dev/shm) (HTTP 507)."""


class StoreDamaged(ConflictError):
    """What the store holds for a model or version cannot be used: a damaged or unreadable
    description, listing or weights file (HTTP 409: the request conflicts with the store's
    state; the message says what is damaged). Nothing damaged is ever served."""


class Unauthorized(MMADError):
    """No API key was sent to a daemon that requires one (HTTP 401)."""


class Forbidden(MMADError):
    """The API key sent is wrong, or the daemon's settings refuse the action to this client
    (e.g. shared-memory registration from another host) (HTTP 403)."""


class CrossSiteRequest(MMADError):
    """A page of an origin that is neither the daemon's own nor allowed sent a request other than
    GET or HEAD (HTTP 403; mmad/server/origin.py)."""


class UnsupportedMediaType(MMADError):
    """The request's Content-Type is not one its route reads (HTTP 415)."""
