"""What a client can make the daemon hold, over raw sockets against real daemon processes
(loopback only, every loop bounded): idle and slow connections, oversized request heads,
connection counts, metric series, response sizes; the API key from a file; Triton's parsing
and response compression (docs/reliability.md, "Connections and resources").
"""

from __future__ import annotations

import gzip
import os
import resource
import socket
import time
import zlib

import httpx
import numpy as np
import orjson
import pytest
from conftest import DaemonProcess
from oracle import rel_err
from test_server_api import SMALL_SPEC, create, oracle

KEY = "k3y-from-a-file"
IDLE_S, HEAD_S, HEADER_CAP, MAX_CONN, RESPONSE_CAP = 1.0, 1.5, 8192, 40, 1 << 20
AUTH = {"Authorization": f"Bearer {KEY}"}
# idle connections held for the memory test (more with MMAD_TEST_IDLE_CONNECTIONS)
IDLE_CONNECTIONS = int(os.environ.get("MMAD_TEST_IDLE_CONNECTIONS", "1000"))
# requests to made-up model names in the metrics test (more with MMAD_TEST_UNKNOWN_NAMES)
UNKNOWN_NAMES = int(os.environ.get("MMAD_TEST_UNKNOWN_NAMES", "1000"))


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """Short timeouts, small caps, no health slots (test_http_safety.py has them), the key from a
    file; a model ``five`` (SMALL_SPEC)."""
    root = tmp_path_factory.mktemp("limited")
    key_file = root / "api_key"
    key_file.write_text(KEY + "\n")
    proc = DaemonProcess(root / "store", "--idle-timeout", str(IDLE_S), "--head-timeout", str(HEAD_S),
                         "--max-header-bytes", str(HEADER_CAP), "--max-connections", str(MAX_CONN),
                         "--health-slots", "0",  # a connection past the cap is refused at once (test below)
                         "--max-response-bytes", str(RESPONSE_CAP), "--api-key-file", str(key_file)).start()
    with httpx.Client(base_url=proc.url, timeout=30.0, headers=AUTH) as client:
        create(client, "five", SMALL_SPEC)
    yield proc
    proc.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed ``sock`` within ``seconds``, what it sent before)."""
    sock.settimeout(0.05)
    got, deadline = b"", time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def health_ms(port: int) -> float:
    """One ``GET /v2/health/ready`` on a fresh connection, in ms; asserts 200."""
    t0 = time.perf_counter()
    with connect(port) as s:
        s.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200"), data[:200]
    return (time.perf_counter() - t0) * 1000


def best_health_ms(port: int, tries: int = 5) -> float:
    """The fastest of a few probes: the test machine's other load must not fail the bound."""
    return min(health_ms(port) for _ in range(tries))


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# -- connections --------------------------------------------------------------------------

def test_idle_connection_closed_after_the_idle_timeout(limited):
    fresh = connect(limited.port)  # never sends a byte
    used = connect(limited.port)  # one request, then idle (keep-alive)
    used.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    t0 = time.monotonic()
    for sock in (fresh, used):
        closed, data = closed_within(sock, IDLE_S + 3)
        assert closed, "the idle connection was not closed"
        sock.close()
    assert data.startswith(b"HTTP/1.1 200")
    assert time.monotonic() - t0 < IDLE_S + 3


def test_slowloris_head_is_dropped_with_408(limited):
    sock = connect(limited.port)
    head = b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 200
    t0, sent, data, closed = time.monotonic(), 0, b"", False
    sock.settimeout(0.2)
    while time.monotonic() - t0 < HEAD_S + 4 and sent < len(head):
        try:
            sock.send(head[sent:sent + 1])  # one byte every 0.2 s: each keeps the connection from idling
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        sent += 1
        try:
            chunk = sock.recv(4096)
            if not chunk:
                closed = True
                break
            data += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed = True
            break
    sock.close()
    assert closed, f"a head sent at 5 bytes/s was still open after {time.monotonic() - t0:.1f} s"
    assert time.monotonic() - t0 < HEAD_S + 2
    if data:
        assert data.startswith(b"HTTP/1.1 408"), data[:200]


def test_oversized_header_gets_431_at_once_and_others_are_unaffected(limited):
    with connect(limited.port) as sock:
        # no end of headers ever comes: the answer must not wait for one
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\nX-Big: " + b"b" * (HEADER_CAP + 1024))
        t0 = time.monotonic()
        closed, data = closed_within(sock, HEAD_S - 0.5)
    assert closed and data.startswith(b"HTTP/1.1 431"), data[:200]
    assert b"8192 bytes" in data
    assert time.monotonic() - t0 < 1.0
    with connect(limited.port) as other:
        other.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\nX-Fine: " + b"c" * 1000 + b"\r\n\r\n")
        assert other.recv(4096).startswith(b"HTTP/1.1 200")
    assert best_health_ms(limited.port) < 100


def test_connections_over_the_cap_get_503_and_health_returns_after(limited):
    held = []
    try:
        for _ in range(MAX_CONN):
            held.append(connect(limited.port))
        extra = connect(limited.port)
        closed, data = closed_within(extra, 2)
        extra.close()
        assert closed and data.startswith(b"HTTP/1.1 503"), data[:200]
        assert b"too many connections" in data and b"retry-after: 1" in data.lower()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while True:  # the server sees the closes a moment later
        try:
            assert health_ms(limited.port) < 1000
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_idle_connections_cost_bounded_memory_and_health_stays_fast(tmp_path):
    n = IDLE_CONNECTIONS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, n + 200), hard))
    daemon = DaemonProcess(tmp_path / "store", "--idle-timeout", "120", "--head-timeout", "120",
                           "--max-connections", str(n + 100)).start()
    held = []
    try:
        for _ in range(20):  # warm up allocator pools and imports so that the baseline is fair
            health_ms(daemon.port)
        before = rss_kib(daemon.proc.pid)
        for i in range(n):
            sock = connect(daemon.port)
            if i % 2:  # half send part of a head (slowloris-like), half nothing
                sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: t\r\n")
            held.append(sock)
        time.sleep(1.0)  # the daemon accepts and reads them all
        assert best_health_ms(daemon.port) < 100
        after = rss_kib(daemon.proc.pid)
        per_connection = (after - before) / n
        assert per_connection < 20, f"{per_connection:.1f} KiB per idle connection ({before} -> {after} KiB)"
        assert daemon.proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        daemon.stop()


# -- metrics ------------------------------------------------------------------------------

def series(http: httpx.Client) -> set[str]:
    text = http.get("/metrics").text
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_unknown_model_names_add_no_metric_series(http):
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 5], "data": [0, 0, 0, 0, 0]}]}
    assert http.post("/v2/models/never-0/infer", json=body).status_code == 404  # the one shared series
    assert http.post("/v2/models/never-0/train", json=body).status_code == 404
    before = series(http)
    for i in range(UNKNOWN_NAMES):
        assert http.post(f"/v2/models/never-{i}/infer", json=body).status_code == 404
    for i in range(50):
        assert http.post(f"/v2/models/never-{i}/train", json=body).status_code == 404
    after = series(http)
    assert after == before, sorted(after - before)[:5]
    assert not any("never-" in s for s in after)
    assert any('model="(unknown)"' in s and 'endpoint="infer"' in s for s in after)


# -- request and response bounds ------------------------------------------------------------

def test_spec_nested_1000_deep_is_400(http):
    deep = '{"x":' * 1000 + '{"a":1}' + "}" * 1000  # deeper than json.dumps or orjson.dumps write
    headers = {"Content-Type": "application/json"}
    r = http.put("/v2/models/deep", content=f'{{"spec":{deep}}}', headers=headers)
    assert r.status_code == 400, r.text
    assert "unknown field" in r.json()["error"]
    spec = orjson.dumps({**SMALL_SPEC, "network": {"otype": "@"}}).decode().replace('"@"', deep)
    r = http.put("/v2/models/deep", content=f'{{"spec":{spec}}}', headers=headers)
    assert r.status_code == 400 and "network.otype" in r.json()["error"], r.text


def binary_request(x: np.ndarray, outputs: list | None = None, parameters: dict | None = None
                   ) -> tuple[bytes, dict[str, str]]:
    blob = x.astype("<f2").tobytes()
    doc = {"inputs": [{"name": "INPUT", "datatype": "FP16", "shape": list(x.shape),
                       "parameters": {"binary_data_size": len(blob)}}]}
    if outputs is not None:
        doc["outputs"] = outputs
    if parameters is not None:
        doc["parameters"] = parameters
    header = orjson.dumps(doc)
    return header + blob, {"Inference-Header-Content-Length": str(len(header))}


def test_response_over_the_cap_is_400_naming_sizes_and_binary(limited):
    x = np.random.default_rng(1).uniform(-1, 1, (20_000, 5)).astype(np.float32)
    with httpx.Client(base_url=limited.url, timeout=30.0) as client:
        body, headers = binary_request(x)  # JSON output: 80,000 values, up to 1.2 MiB
        r = client.post("/v2/models/five/infer", content=body, headers=headers)
        assert r.status_code == 400, r.text
        message = r.json()["error"]
        assert "1.0 MiB" in message and "80000 values" in message and "binary_data_output" in message
        body, headers = binary_request(x, parameters={"binary_data_output": True})  # 320 KB
        r = client.post("/v2/models/five/infer", content=body, headers=headers)
        assert r.status_code == 200, r.text


def test_api_key_from_a_file_and_not_in_the_command_line(limited):
    with open(f"/proc/{limited.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()
    with httpx.Client(base_url=limited.url, timeout=30.0) as client:
        spec = {"spec": SMALL_SPEC}
        assert client.put("/v2/models/keyed", json=spec).status_code == 401
        assert client.put("/v2/models/keyed", json=spec,
                          headers={"Authorization": "Bearer wrong"}).status_code == 403
        assert client.put("/v2/models/keyed", json=spec, headers=AUTH).status_code == 201
        assert client.delete("/v2/models/keyed", headers=AUTH).status_code in (200, 204)


def test_api_key_settings(tmp_path):
    from pydantic import ValidationError

    from mmad.settings import Settings

    key_file = tmp_path / "key"
    key_file.write_text("  secret\n")
    assert Settings(api_key_file=key_file).api_key_value == "secret"
    with pytest.raises(ValidationError, match="not both"):
        Settings(api_key_file=key_file, api_key="other")
    key_file.write_text("\n")
    with pytest.raises(ValidationError, match="is empty"):
        Settings(api_key_file=key_file)
    with pytest.raises(ValidationError, match="cannot be read"):
        Settings(api_key_file=tmp_path / "missing")


# -- Triton conformance ---------------------------------------------------------------------

def json_request(**extra) -> dict:
    return {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 2], "data": [0.1, 0.2]}], **extra}


@pytest.mark.parametrize("doc, words", [
    (json_request(id=7), "id must be a string"),
    (json_request(id=None), "id must be a string"),
    (json_request(parameters={"binary_data_output": "false"}), "binary_data_output must be a boolean"),
    (json_request(parameters={"binary_data_output": 0}), "binary_data_output must be a boolean"),
    (json_request(outputs=[{"name": "OUTPUT", "parameters": {"binary_data": "false"}}]),
     "binary_data must be a boolean"),
    ({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 2], "data": [True, 0.2]}]}, "booleans"),
    ({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 2], "data": [[0.1, 0.2], [0.3, False]]}]},
     "booleans"),
])
def test_triton_refuses_wrong_types_with_400(http, doc, words):
    r = http.post("/v2/models/demo/infer", json=doc)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]


def test_string_id_and_boolean_parameters_still_work(http):
    r = http.post("/v2/models/demo/infer", json=json_request(id="abc", parameters={"binary_data_output": False}))
    assert r.status_code == 200 and r.json()["id"] == "abc"


@pytest.mark.parametrize("encoding, unpack", [("gzip", gzip.decompress), ("deflate", zlib.decompress)])
def test_infer_response_compressed_when_accepted(daemon, http, encoding, unpack):
    x = np.random.default_rng(2).uniform(-1, 1, (300, 2)).astype(np.float32)
    doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    plain = http.post("/v2/models/demo/infer", json=doc, headers={"Accept-Encoding": "identity"})
    assert plain.status_code == 200 and "content-encoding" not in plain.headers
    with httpx.Client(base_url=daemon.url, timeout=30.0) as raw, \
            raw.stream("POST", "/v2/models/demo/infer", json=doc, headers={"Accept-Encoding": encoding}) as r:
        assert r.status_code == 200
        assert r.headers["content-encoding"] == encoding
        wire = b"".join(r.iter_raw())  # the body as it came
    assert len(wire) < len(plain.content)
    assert orjson.loads(unpack(wire)) == plain.json()
    out = np.array(plain.json()["outputs"][0]["data"], np.float32).reshape(300, -1)
    assert rel_err(out, oracle(http, "demo", x)) <= 1e-5

    # binary: Inference-Header-Content-Length counts the uncompressed header, as Triton's does
    body, headers = binary_request(x, parameters={"binary_data_output": True})
    r = http.post("/v2/models/demo/infer", content=body, headers={**headers, "Accept-Encoding": encoding})
    assert r.status_code == 200 and r.headers["content-encoding"] == encoding
    n = int(r.headers["inference-header-content-length"])
    data = r.content  # httpx inflated it
    shape = orjson.loads(data[:n])["outputs"][0]["shape"]
    out16 = np.frombuffer(data[n:], "<f4").reshape(shape)
    assert rel_err(out16, oracle(http, "demo", x.astype(np.float16).astype(np.float32))) <= 1e-5


@pytest.mark.parametrize("accept, chosen", [
    ("gzip", "gzip"), ("deflate", "deflate"), ("gzip, deflate, br, zstd", "gzip"), ("deflate, gzip", "deflate"),
    ("gzip;q=0.5, deflate;q=0.8", "deflate"), ("gzip;q=0, deflate", "deflate"), ("identity, gzip", None),
    ("br", None), ("*", None), ("", None),
])
def test_accept_encoding_chosen_as_triton_does(accept, chosen):
    from mmad.server.tensors import accepted_encoding

    assert accepted_encoding(accept) == chosen


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_response_compression(daemon, http, algorithm):
    th = pytest.importorskip("tritonclient.http")
    client = th.InferenceServerClient(daemon.url.removeprefix("http://"))
    try:
        x = np.random.default_rng(3).uniform(-1, 1, (64, 2)).astype(np.float32)
        for binary in (False, True):
            tensor = th.InferInput("INPUT", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            outputs = [th.InferRequestedOutput("OUTPUT", binary_data=binary)]
            result = client.infer("demo", [tensor], outputs=outputs, response_compression_algorithm=algorithm)
            assert rel_err(result.as_numpy("OUTPUT"), oracle(http, "demo", x)) <= 1e-5
    finally:
        client.close()
