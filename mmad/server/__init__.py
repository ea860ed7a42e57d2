"""The mmad daemon: an Open Inference Protocol v2 service that also trains (``mmad serve``).

``create_app(settings)`` builds the FastAPI application; ``main(argv)`` runs it under uvicorn.
The HTTP contract is docs/api.md.
"""

from mmad.settings import Settings

__all__ = ["Settings", "create_app"]


def create_app(settings: Settings | None = None):
    """The FastAPI application (imported lazily so that settings alone stay cheap)."""
    from mmad.server.app import create_app as _create_app

    return _create_app(settings)
