"""The dashboard at ``/ui`` and the OpenAPI page at ``/docs``, both from files shipped in the
package (``mmad/server/static/``): FastAPI's own ``/docs`` loads Swagger UI from a public CDN and
is blank on a host without internet access. Swagger UI is vendored from npm's
``swagger-ui-dist`` (Apache-2.0, its LICENSE and NOTICE beside it; docs/dashboard.md says how to
update it). ``/`` links to both and to the protocol's entry points. None of these pages is part
of the API's schema.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "static"
# what / points to: name, path, what a person finds there
LINKS = (("dashboard", "/ui", "the dashboard: training jobs, requests, models, devices"),
         ("docs", "/docs", "the HTTP API, to read and try (Swagger UI)"),
         ("openapi", "/openapi.json", "the API's OpenAPI schema"),
         ("server", "/v2", "server metadata (Open Inference Protocol v2)"),
         ("ready", "/v2/health/ready", "readiness"),
         ("metrics", "/metrics", "Prometheus metrics"))

router = APIRouter(include_in_schema=False)


@router.get("/")
async def index(request: Request):
    """The links a person or a client starts from: an HTML page for a browser, JSON otherwise."""
    root = request.scope.get("root_path", "").rstrip("/")
    if "text/html" in request.headers.get("accept", ""):
        items = "".join(f'<li><a href="{escape(root + path)}">{escape(path)}</a>: {escape(what)}</li>'
                        for _, path, what in LINKS)
        title = f"{escape(request.app.title)} {escape(request.app.version)}"
        return HTMLResponse(f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title></head>"
                            f"<body><h1>{title}</h1><ul>{items}</ul></body></html>")
    return {"name": request.app.title, "version": request.app.version,
            "links": {name: root + path for name, path, _ in LINKS}}


@router.get("/ui")
async def dashboard():
    return FileResponse(STATIC / "ui" / "index.html", headers={"Cache-Control": "no-cache"})


@router.get("/docs")
async def docs(request: Request):
    # root_path: behind a proxy that serves the daemon under a prefix (as FastAPI's own /docs does)
    root = request.scope.get("root_path", "").rstrip("/")
    return get_swagger_ui_html(openapi_url=root + request.app.openapi_url, title=f"{request.app.title} - API",
                               swagger_js_url=f"{root}/static/swagger/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}/static/swagger/swagger-ui.css",
                               swagger_favicon_url=f"{root}/static/swagger/favicon-32x32.png")


def install(app: FastAPI) -> None:
    """Serve the pages and their files; the app must be created with ``docs_url=None, redoc_url=None``
    (ReDoc has no local copy: it would load from a CDN)."""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(router)
