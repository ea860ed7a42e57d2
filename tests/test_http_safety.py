"""What a web page, a slow client or an oversized upload can make a daemon without an API key do
(docs/reliability.md, "Cross-site requests, slow clients and large headers"):

- a page of another site: nothing but GET/HEAD (403), and no body of a type the route does not
  read (415), in front of FastAPI's routes, the infer fast path and a serving worker's routes;
- a slow or stalled request body: 408 and closed; incomplete bodies held across connections:
  bounded (503 past it); health probes answered while the connection cap is full;
- a safetensors upload with a huge header, parameters that cannot be finite in the model's
  precision, gzip bombs: refused, and the memory they cost bounded.

Every loop is bounded in count; nothing asserts a time tighter than several seconds.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from conftest import DaemonProcess
from fastapi.testclient import TestClient
from safetensors.numpy import save as st_save

from mmad.server import Settings, create_app
from mmad.server.origin import JSON, OCTETS, body_types, normalise_origin, parse_allowed_origins
from test_security import route_table
from test_server_api import SMALL_SPEC, binary_infer, create

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

EVIL = "https://evil.example"
JSON_INFER = orjson.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 5],
                                       "data": [0.1, 0.2, 0.3, 0.4, 0.5]}]})
TRAIN = orjson.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 5], "data": [1e3] * 10},
                                 {"name": "TARGET", "datatype": "FP32", "shape": [2, 4], "data": [1e3] * 8}],
                      "parameters": {"steps": 5}})
SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x")


def keyless_app(tmp_path: Path, **settings):
    return create_app(Settings(store_dir=tmp_path / "store", backend="cpu", probe="cpu", **settings))


@pytest.fixture
def keyless(tmp_path):
    """A daemon as `mmad serve` starts it (no key), in process, with the model ``five``."""
    with TestClient(keyless_app(tmp_path), raise_server_exceptions=False) as client:
        create(client, "five", SMALL_SPEC)
        yield client


def state(client) -> tuple:
    """What a forged request could change: versions, weights, readiness, regions, models."""
    return (client.get("/v2/models/five/versions").json(), client.get("/v2/models/five/weights").content,
            client.get("/v2/models/five/ready").status_code, client.get("/v2/systemsharedmemory/status").json(),
            sorted(m["name"] for m in client.post("/v2/repository/index").json()))


# what a page can send without a preflight (a form or fetch with text/plain), one per kind of route
FORGED = [("POST", "/v2/models/five/train", TRAIN), ("POST", "/v2/models/five/versions", b""),
          ("PUT", "/v2/models/five/weights", b"x"), ("POST", "/v2/repository/models/five/unload", b"{}"),
          ("POST", "/v2/systemsharedmemory/region/r/register", b'{"key": "/x", "byte_size": 64}'),
          ("PUT", "/v2/models/made", orjson.dumps({"spec": SMALL_SPEC})), ("DELETE", "/v2/models/five", b""),
          ("POST", "/v2/models/five/datasets", b"x"), ("POST", "/v2/models/five/infer", JSON_INFER)]


def test_cross_site_requests_are_403_and_change_nothing(keyless):
    before = state(keyless)
    for method, path, body in FORGED:
        for content_type in ("text/plain", "application/json", None):
            headers = {"Origin": EVIL, **({"Content-Type": content_type} if content_type else {})}
            r = keyless.request(method, path, content=body, headers=headers)
            assert r.status_code == 403, (method, path, content_type, r.status_code, r.text)
            assert EVIL in r.json()["error"] and "--allow-origin" in r.json()["error"]
    assert state(keyless) == before
    # `null` (sandboxed frames, file: pages) is no origin of the daemon's either
    assert keyless.post("/v2/models/five/versions", headers={"Origin": "null"}).status_code == 403
    # reads stay open to any page (it cannot read the answers: no CORS header)
    r = keyless.get("/v2/models/five", headers={"Origin": EVIL})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


def test_the_daemons_own_pages_and_clients_without_origin_are_served(keyless):
    # the dashboard's POST (same origin: TestClient's host), and what curl and the clients send
    for origin in ("http://testserver", "HTTP://TestServer:80", None):
        headers = {"Content-Type": "application/json", **({"Origin": origin} if origin else {})}
        assert keyless.post("/v2/repository/index", content=b"{}", headers=headers).status_code == 200
        r = keyless.post("/v2/models/five/infer", content=JSON_INFER, headers=headers)
        assert r.status_code == 200, r.text
    # tritonclient.http names no Content-Type at all, JSON or binary
    assert keyless.post("/v2/models/five/infer", content=JSON_INFER).status_code == 200
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    assert binary_infer(keyless, "five", x).status_code == 200
    assert binary_infer(keyless, "five", x, headers={"Content-Type": OCTETS}).status_code == 200
    # a checkpoint from the daemon's own page is taken
    assert keyless.post("/v2/models/five/versions", headers={"Origin": "http://testserver"}).status_code == 200


@pytest.mark.parametrize("content_type", SIMPLE_TYPES + ("application/xml",))
def test_a_body_type_the_route_does_not_read_is_415(keyless, content_type):
    before = state(keyless)
    for method, path, body in FORGED:
        r = keyless.request(method, path, content=body, headers={"Content-Type": content_type})
        assert r.status_code == 415, (method, path, r.status_code, r.text)
        error = r.json()["error"]
        assert content_type.partition(";")[0] in error and ("application/json" in error or OCTETS in error)
    assert state(keyless) == before
    if content_type == "application/x-www-form-urlencoded":  # curl -d's default: the message says what to add
        assert "-H 'Content-Type: application/json'" in keyless.post(
            "/v2/models/five/jobs", content=b"{}", headers={"Content-Type": content_type}).json()["error"]


def test_safetensors_routes_read_octet_stream_and_json_routes_json(keyless):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 5)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)
    r = keyless.post("/v2/models/five/datasets", content=st_save({"x": x, "y": y}), headers={"Content-Type": OCTETS})
    assert r.status_code == 200, r.text
    r = keyless.put("/v2/models/five/weights", content=keyless.get("/v2/models/five/weights").content,
                    headers={"Content-Type": JSON})
    assert r.status_code == 415 and OCTETS in r.json()["error"]
    r = keyless.put("/v2/models/made", content=orjson.dumps({"spec": SMALL_SPEC}), headers={"Content-Type": OCTETS})
    assert r.status_code == 415 and JSON in r.json()["error"]
    # a model may be called "weights" or "infer": its creation is a JSON route all the same
    r = keyless.put("/v2/models/weights", json={"spec": SMALL_SPEC})
    assert r.status_code == 201, r.text


def test_body_types_match_what_each_route_documents(tmp_path):
    """The guard's table (origin.body_types) against the OpenAPI request bodies of every route."""
    app = keyless_app(tmp_path)
    documented = {}
    for path, item in app.openapi()["paths"].items():
        for method, op in item.items():
            content = op.get("requestBody", {}).get("content")
            documented[(method.upper(), path)] = tuple(content) if content else (JSON,)
    checked = 0
    for method, path, _ in route_table(app):
        if method not in ("POST", "PUT", "DELETE") or path.startswith("/_mmad"):
            continue
        filled = path.replace("{model}", "m").replace("{version}", "1").replace("{dataset}", "d")
        filled = filled.replace("{region}", "r").replace("{job_id}", "j")
        assert set(body_types(method, filled)) == set(documented[(method, path)]), (method, path)
        checked += 1
    assert checked >= 15


def test_origins_are_compared_as_browsers_write_them():
    assert normalise_origin("HTTP://LocalHost:80/") == "http://localhost"
    assert normalise_origin("https://a.example:443") == "https://a.example"
    assert normalise_origin("http://[::1]:8000") == "http://[::1]:8000"
    assert normalise_origin("http://a.example:8080") != normalise_origin("http://a.example")
    assert parse_allowed_origins(" https://a.example, http://b.example:81 ,*") == {
        "https://a.example", "http://b.example:81", "*"}
    for bad in ("a.example", "ftp://a.example", "https://a.example/path", "https://"):
        with pytest.raises(ValueError, match="not an origin"):
            parse_allowed_origins(bad)
    with pytest.raises(ValueError, match="not an origin"):
        Settings(allow_origin="evil.example")


def test_allowed_origins_get_through_with_cors_headers(tmp_path):
    app = keyless_app(tmp_path, allow_origin="https://app.example,http://localhost:3000")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v2/models/demo/versions", headers={"Origin": "https://app.example"})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        pre = client.options("/v2/models/demo/infer", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, inference-header-content-length"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:3000"
        # another origin: refused, and its preflight gets no CORS header at all
        assert client.post("/v2/models/demo/versions", headers={"Origin": EVIL}).status_code == 403
        pre = client.options("/v2/models/demo", headers={"Origin": EVIL, "Access-Control-Request-Method": "DELETE"})
        assert pre.status_code == 403 and not any(h.startswith("access-control-") for h in pre.headers)
    with TestClient(keyless_app(tmp_path / "all", allow_origin="*"), raise_server_exceptions=False) as client:
        r = client.post("/v2/models/demo/versions", headers={"Origin": EVIL})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        # the body type is still checked
        assert client.post("/v2/models/demo/jobs", content=b"{}", headers={"Content-Type": "text/plain"}).status_code == 415


def curl(*args: str) -> tuple[int, str]:
    out = subprocess.run(["curl", "-s", "-o", "/dev/stderr", "-w", "%{http_code}", *args], capture_output=True,
                         text=True, timeout=60)
    return int(out.stdout), out.stderr


@pytest.mark.parametrize("workers", [0, 1], ids=["one-process", "serving-worker"])
def test_a_keyless_daemon_refuses_the_forged_post_over_http(tmp_path, workers):
    """The real daemon as `mmad serve` starts it: the infer fast path, FastAPI's routes and (with
    --workers) a serving worker's own infer and what it passes to the primary."""
    if subprocess.run(["which", "curl"], capture_output=True).returncode != 0:
        pytest.skip("curl is not installed (scripts/setup.sh installs it)")
    proc = DaemonProcess(tmp_path / "store", *(["--workers", str(workers)] if workers else [])).start(120)
    try:
        own = f"http://127.0.0.1:{proc.port}"
        with httpx.Client(base_url=proc.url, timeout=30.0) as http:
            create(http, "five", SMALL_SPEC)
            versions = http.get("/v2/models/five/versions").json()
            for path, body in (("/v2/models/five/train", TRAIN), ("/v2/models/five/infer", JSON_INFER),
                               ("/v2/models/five/versions", b"")):
                r = http.post(path, content=body, headers={"Origin": EVIL, "Content-Type": "text/plain"})
                assert r.status_code == 403, (path, r.status_code, r.text)
                r = http.post(path, content=body or b"{}", headers={"Content-Type": "text/plain"})
                assert r.status_code == 415, (path, r.status_code, r.text)
            assert http.get("/v2/models/five/versions").json() == versions
            # the dashboard's own POST and the curl of docs/service.md
            r = http.post("/v2/repository/index", json={}, headers={"Origin": own})
            assert r.status_code == 200, r.text
            status, text = curl("-X", "POST", f"{own}/v2/models/five/infer", "-H", "Content-Type: application/json",
                                "-d", JSON_INFER.decode())
            assert status == 200 and orjson.loads(text)["outputs"][0]["shape"] == [1, 4], text
            status, text = curl("-X", "POST", f"{own}/v2/models/five/infer", "-d", JSON_INFER.decode())
            assert status == 415 and "-H 'Content-Type: application/json'" in text, text
    finally:
        proc.stop()
