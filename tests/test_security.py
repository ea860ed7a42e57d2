"""Security properties of the daemon checked in-process against ``create_app``.

- API-key auth on every mutating endpoint. The routes are enumerated from the app itself
  (``app.routes``), so a route added later is covered without editing this file; each one is
  called without a key (401), with a wrong key (403) and with the right key (anything but 401/403).
- The key comparison is constant-time (``hmac.compare_digest``).
- Model names, version ids and dataset ids are validated against path traversal, and no file
  appears outside the store whatever name is sent.
- No pickle, eval, exec or marshal anywhere in the package source (grep).
- Body cap (declared and streamed), tensor-size and batch/step limits.
- CORS is off by default.
- The API key never appears in a response body, a response header or a log record.
"""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import save as st_save

from mmad.server import Settings, create_app
from mmad.server.internal import INTERNAL_PREFIX, TOKEN_HEADER

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
API_KEY = "mmad-test-key-" + uuid.uuid4().hex  # random, so finding it anywhere is no coincidence
WRONG_KEY = "wrong-" + uuid.uuid4().hex
# Routes that take POST without changing state, on purpose: inference (OIP v2) and the
# repository index (Triton's read-only listing is a POST). Everything else that is not a GET is
# mutating and must demand the key.
READ_ONLY_POSTS = {"/v2/models/{model}/infer", "/v2/models/{model}/versions/{version}/infer",
                   "/v2/repository/index"}
MUTATING_METHODS = {"POST", "PUT", "DELETE", "PATCH"}
BODY_CAP = 256 * 1024


def route_table(app) -> list[tuple[str, str, object]]:
    """(method, path template, endpoint) of every route the app serves, included routers too."""
    try:
        from fastapi.routing import iter_route_contexts  # FastAPI >= 0.160 nests included routers
        routes = list(iter_route_contexts(app.routes))
    except ImportError:
        routes = list(app.routes)
    table = []
    for route in routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            table.append((method, route.path, getattr(route, "endpoint", None)))
    return table


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    root = tmp_path_factory.mktemp("security")
    settings = Settings(store_dir=root / "store", backend="cpu", probe="cpu", api_key=API_KEY,
                        max_body_bytes=BODY_CAP, log_level="debug")
    app = create_app(settings)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client, root


@pytest.fixture
def captured_logs(caplog):
    caplog.set_level(logging.DEBUG)
    return caplog


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def encoded(segment: str) -> str:
    """Percent-encode every byte but letters and digits, so that no client normalises '..' away."""
    return "".join(c if c.isascii() and c.isalnum() else "".join(f"%{b:02X}" for b in c.encode())
                   for c in segment)


def fill(path: str) -> str:
    return (path.replace("{model}", "demo").replace("{version}", "1")
            .replace("{job_id}", "0" * 32).replace("{index}", "1"))


def test_route_enumeration_finds_the_mutating_endpoints(secured):
    app, _, _ = secured
    mutating = {(m, p) for m, p, _ in route_table(app) if m in MUTATING_METHODS and p not in READ_ONLY_POSTS}
    # the enumeration must see the routers' routes, not only the app's own (/openapi.json ...)
    for expected in [("PUT", "/v2/models/{model}"), ("DELETE", "/v2/models/{model}"),
                     ("PUT", "/v2/models/{model}/weights"), ("POST", "/v2/models/{model}/train"),
                     ("POST", "/v2/models/{model}/jobs"), ("POST", "/v2/repository/models/{model}/load")]:
        assert expected in mutating, f"{expected} not found among the app's routes"
    assert len(mutating) >= 10


def test_every_mutating_route_requires_the_key(secured):
    app, client, _ = secured
    checked, internal = [], []
    for method, path, _ in route_table(app):
        if method not in MUTATING_METHODS or path in READ_ONLY_POSTS:
            continue
        url = fill(path)
        if path.startswith(INTERNAL_PREFIX):  # the primary's routes for its workers: their token, not the key
            for headers in ({}, auth(), {TOKEN_HEADER: "guess"}):
                assert client.request(method, url, content=b"{}", headers=headers).status_code == 404, (method, path)
            internal.append(path)
            continue
        missing = client.request(method, url, content=b"{}")
        assert missing.status_code == 401, f"{method} {path} without a key: {missing.status_code} {missing.text}"
        assert missing.headers.get("www-authenticate", "").lower().startswith("bearer")
        assert "error" in missing.json()
        for bad in ({"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": f"Bearer {API_KEY[:-1]}"}, {"Authorization": "Bearer"}):
            wrong = client.request(method, url, content=b"{}", headers=bad)
            assert wrong.status_code in (401, 403), f"{method} {path} with {bad}: {wrong.status_code}"
        checked.append((method, path))
    # read-only endpoints stay open without a key
    assert client.get("/v2/models/demo").status_code == 200
    assert client.post("/v2/repository/index").status_code == 200
    assert len(checked) >= 10
    assert sorted(internal) == [INTERNAL_PREFIX + "/engine/{method}", INTERNAL_PREFIX + "/ready/{index}"]


def test_right_key_is_accepted(secured):
    _, client, _ = secured
    spec = {"n_input_dims": 3, "n_output_dims": 2, "network": {"n_neurons": 16, "n_hidden_layers": 1},
            "precision": "fp32", "seed": 3}
    r = client.put("/v2/models/keyed", json={"spec": spec}, headers=auth())
    assert r.status_code in (200, 201), r.text
    r = client.post("/v2/models/keyed/versions", headers=auth())
    assert r.status_code == 200 and r.json()["version"] == "2", r.text
    assert client.delete("/v2/models/keyed", headers=auth()).status_code == 200


def test_key_comparison_is_constant_time():
    sources = "\n".join(p.read_text() for p in (REPO / "mmad" / "server").rglob("*.py"))
    assert "hmac.compare_digest" in sources
    # no ordinary comparison against the configured key anywhere
    assert not re.search(r"(==|!=)\s*[\w.]*api_key", sources)
    assert not re.search(r"api_key[\w.()]*\s*(==|!=)", sources)


TRAVERSAL_NAMES = ["..", ".", "...", ".hidden", "a..b", "-lead", "_lead", "x" * 65, "a b", "a\\b",
                   "a%00b", "%2e%2e", "..%2f..%2fetc", "é", "con:1", "a;b", "~root"]


@pytest.mark.parametrize("name", TRAVERSAL_NAMES)
def test_model_names_are_validated(secured, name):
    _, client, root = secured
    before = sorted(p.name for p in root.iterdir())
    name = encoded(name)
    spec = {"n_input_dims": 2, "n_output_dims": 1, "network": {"n_neurons": 16, "n_hidden_layers": 1}}
    for method, path, kwargs in [("PUT", f"/v2/models/{name}", {"json": {"spec": spec}}),
                                 ("POST", f"/v2/models/{name}/datasets", {"content": b"x"}),
                                 ("POST", f"/v2/repository/models/{name}/load", {}),
                                 ("GET", f"/v2/models/{name}/weights", {}),
                                 ("POST", f"/v2/models/{name}/infer", {"json": {"inputs": []}})]:
        r = client.request(method, path, headers=auth(), **kwargs)
        # 400 (invalid name), or 404 where a decoded '/' makes the path route nowhere
        assert r.status_code in (400, 404), f"{method} {path}: {r.status_code} {r.text}"
        assert "error" in r.json()
    assert sorted(p.name for p in root.iterdir()) == before
    models = sorted(p.name for p in (root / "store" / "models").iterdir())
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", m) and ".." not in m for m in models), models


@pytest.mark.parametrize("version", ["0", "-1", "01", "1.0", "1e3", "..", "../1", "%2e%2e", "1 ", "abc",
                                     "9" * 40])
def test_version_ids_are_validated(secured, version):
    _, client, _ = secured
    for path, params in [(f"/v2/models/demo/versions/{encoded(version)}", None),
                         ("/v2/models/demo/weights", {"version": version})]:
        r = client.get(path, params=params)
        assert r.status_code in (400, 404), f"{path} {params}: {r.status_code} {r.text}"
        assert "error" in r.json()
    r = client.get("/v2/models/demo/weights", params={"version": "../../models/demo/model.json"})
    assert r.status_code == 400 and "invalid version" in r.json()["error"]


def test_dataset_ids_are_validated(secured):
    _, client, _ = secured
    for dataset in ["../../models/demo/weights/1", "..", "0" * 31, "g" * 32]:
        r = client.post("/v2/models/demo/jobs", headers=auth(),
                        json={"dataset": dataset, "steps": 1, "batch_size": 1})
        assert r.status_code in (400, 404), r.text
        assert "dataset" in r.json()["error"]


def test_no_pickle_eval_exec_in_the_package():
    forbidden = [
        (r"^\s*(import|from)\s+(c?pickle|dill|marshal|shelve|joblib)\b", "pickle-like deserialisation"),
        (r"\b(c?pickle|marshal|dill|joblib)\.(loads?|Unpickler)\b", "pickle-like deserialisation"),
        (r"(?<![\w.])eval\s*\(", "eval"),
        (r"(?<![\w.])exec\s*\(", "exec"),
        (r"allow_pickle\s*=\s*True", "numpy pickle loading"),
        (r"\btorch\.load\s*\(", "torch.load (pickle)"),
        (r"\byaml\.load\s*\(", "yaml.load (arbitrary objects)"),
        (r"\bcompile\s*\([^)]*['\"]exec['\"]", "compile(..., 'exec')"),
    ]
    roots = [REPO / d for d in ("mmad", "server", "backends", "shaders", "bench", "client")]
    files = [p for r in roots if r.exists() for p in r.rglob("*.py") if "build" not in p.parts]
    assert len(files) >= 15, "the grep must see the package sources"
    hits = []
    for path in files:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern, what in forbidden:
                if re.search(pattern, code):
                    hits.append(f"{path.relative_to(REPO)}:{lineno}: {what}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_body_cap_declared_and_streamed(secured):
    _, client, _ = secured
    big = b"0" * (BODY_CAP + 1)
    r = client.post("/v2/models/demo/infer", content=big)
    assert r.status_code == 413 and "limit" in r.json()["error"], r.text

    def chunks():  # no Content-Length: the cap must hold while the body streams in
        for _ in range(8):
            yield b"0" * (BODY_CAP // 4)

    r = client.post("/v2/models/demo/infer", content=chunks())
    assert r.status_code == 413, r.text
    r = client.put("/v2/models/demo/weights", content=chunks(), headers=auth())
    assert r.status_code == 413, r.text


def test_tensor_and_batch_limits(secured):
    _, client, _ = secured
    # a declared shape of 2^40 elements is refused from the header, nothing is allocated
    r = client.post("/v2/models/demo/infer", json={"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": [1 << 39, 2], "data": [0.5, 0.5]}]})
    assert r.status_code == 400 and "elements" in r.json()["error"], r.text
    r = client.post("/v2/models/demo/train", headers=auth(), json={
        "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 2], "data": [0.1, 0.2]},
                   {"name": "TARGET", "datatype": "FP32", "shape": [1, 3], "data": [0.1, 0.2, 0.3]}],
        "parameters": {"steps": 10**9}})
    assert r.status_code == 400 and "steps" in r.json()["error"], r.text
    x = np.random.default_rng(0).random((8, 2), dtype=np.float32)
    y = np.random.default_rng(1).random((8, 3), dtype=np.float32)
    r = client.post("/v2/models/demo/datasets", content=st_save({"x": x, "y": y}), headers=auth())
    assert r.status_code == 200, r.text
    dataset = r.json()["dataset"]
    for body, word in [({"dataset": dataset, "steps": 1, "batch_size": 9}, "batch_size"),
                       ({"dataset": dataset, "steps": 1, "batch_size": 1 << 30}, "batch_size"),
                       ({"dataset": dataset, "steps": 10**12, "batch_size": 1}, "steps"),
                       ({"dataset": dataset, "steps": 1, "batch_size": 1, "checkpoint_every": 0}, "checkpoint_every")]:
        r = client.post("/v2/models/demo/jobs", json=body, headers=auth())
        assert r.status_code == 400 and word in r.json()["error"], (body, r.text)


def test_cors_is_off_by_default(secured):
    app, client, _ = secured
    assert not any("cors" in str(getattr(m, "cls", "")).lower() for m in app.user_middleware)
    r = client.get("/v2/models/demo", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200
    assert not any(h.lower().startswith("access-control-") for h in r.headers)
    r = client.options("/v2/models/demo", headers={"Origin": "https://evil.example",
                                                   "Access-Control-Request-Method": "DELETE"})
    assert not any(h.lower().startswith("access-control-") for h in r.headers)
    assert r.status_code == 403  # a preflight from another site's page: refused, and no CORS header


def test_default_bind_is_loopback():
    assert Settings().host == "127.0.0.1"


def test_the_key_is_never_echoed(secured, captured_logs):
    app, client, _ = secured
    responses = []
    # errors of every kind, sent with the right key, a wrong key, and the key in odd places
    responses.append(client.put("/v2/models/demo/weights", content=b"not safetensors", headers=auth()))
    responses.append(client.put("/v2/models/demo", content=b"{bad json", headers=auth()))
    responses.append(client.put("/v2/models/..", content=b"{}", headers=auth()))
    responses.append(client.post("/v2/models/demo/train", content=b"[]", headers=auth(WRONG_KEY)))
    responses.append(client.post("/v2/models/demo/train", content=b"[]", headers={"Authorization": API_KEY}))
    responses.append(client.post("/v2/models/demo/infer", content=b"{", headers=auth()))
    responses.append(client.get("/v2/models/nope", headers=auth()))
    responses.append(client.get("/v2/models/demo/weights", params={"version": "x"}, headers=auth()))
    responses.append(client.post("/v2/models/demo/jobs", json={"dataset": "0" * 32}, headers=auth()))
    responses.append(client.get("/metrics", headers=auth()))
    responses.append(client.get("/openapi.json", headers=auth()))
    assert any(r.status_code == 401 for r in responses) and any(r.status_code == 403 for r in responses)
    for r in responses:
        blob = r.content + orjson.dumps(dict(r.headers))
        assert API_KEY.encode() not in blob, f"the API key leaked in {r.request.method} {r.request.url}"
        assert WRONG_KEY.encode() not in blob
    for record in captured_logs.records:
        text = record.getMessage() + repr(record.args)
        assert API_KEY not in text and WRONG_KEY not in text, f"the API key leaked in a log: {text}"
    settings = app.state.runtime.settings
    assert API_KEY not in repr(settings) and API_KEY not in str(settings.model_dump())


def test_daemon_process_never_logs_the_key(tmp_path):
    """The real daemon at debug log level (access log on): the key appears in no output."""
    import importlib.util
    import subprocess
    import sys

    import httpx

    bad = subprocess.run([sys.executable, "-m", "mmad.server.main", "--api-key", API_KEY, "--port", "99999"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and "port" in bad.stderr
    assert API_KEY not in bad.stdout + bad.stderr

    spec = importlib.util.spec_from_file_location("fault_injection", REPO / "scripts" / "fault_injection.py")
    fault_injection = importlib.util.module_from_spec(spec)
    sys.modules["fault_injection"] = fault_injection
    spec.loader.exec_module(fault_injection)
    daemon = fault_injection.Daemon(tmp_path / "store", "--api-key", API_KEY, "--log-level", "debug", demo=True)
    daemon.start()
    try:
        with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
            assert http.post("/v2/models/demo/versions", headers=auth(WRONG_KEY)).status_code == 403
            assert http.post("/v2/models/demo/versions", headers=auth()).status_code == 200
            assert http.put("/v2/models/demo/weights", content=b"junk", headers=auth()).status_code == 400
            assert http.get("/v2/models/demo/weights", params={"version": "../x"}).status_code == 400
    finally:
        daemon.stop()
    log = daemon.log_tail(1 << 20)
    assert "POST /v2/models/demo/versions" in log  # the access log was written
    assert API_KEY not in log and WRONG_KEY not in log
