"""mmad_client against a fake daemon behind ``httpx.MockTransport`` (the client's transport seam).

The fake decodes requests by hand (JSON, binary tensor extension, safetensors) independently of
the client's own codecs, and answers with tensors computed from what it received, so a wrong
byte order, offset or shape shows up as a wrong number.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import struct
import sys
from pathlib import Path
from urllib.parse import unquote

import httpx
import numpy as np
import pytest

# test the checkout's client, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

import mmad_client  # noqa: E402
from mmad_client import AsyncClient, Client, Timeout  # noqa: E402
from mmad_client import errors as E  # noqa: E402
from mmad_client._base import SSEParser  # noqa: E402
from mmad_client._binary import decode_infer_response, decode_safetensors, encode_safetensors  # noqa: E402

N_IN, N_OUT = 5, 3
DTYPES = {"FP32": np.float32, "FP16": np.float16}


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """Independent minimal reader (the test's own, not the client's)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    kinds = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8"}
    return {k: np.frombuffer(data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]],
                             dtype=kinds[v["dtype"]]).reshape(v["shape"]) for k, v in header.items()}


def write_safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header, blobs, offset = {}, [], 0
    for k, v in tensors.items():
        raw = np.ascontiguousarray(v, dtype="<f4").tobytes()
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


class FakeDaemon:
    """Enough of the mmad HTTP API to drive every client method; records every request."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.matrix = rng.standard_normal((N_IN, N_OUT)).astype(np.float32)
        self.weights = {"W0": rng.standard_normal((N_OUT, N_IN)).astype(np.float32),
                        "b0": rng.standard_normal(N_OUT).astype(np.float32)}
        self.requests: list[httpx.Request] = []
        self.datasets: dict[str, dict[str, np.ndarray]] = {}
        self.chunks: list[dict[str, np.ndarray]] = []  # every chunk received, in order
        self.max_chunk_bytes = 64 << 20
        self.fail_at_chunk = 0  # answer 500 to this chunk (1-based; 0: never)
        self.job_steps = 0
        self.job_final = "done"
        self.send_final_event = True

    def __call__(self, request: httpx.Request) -> httpx.Response:
        request.read()
        self.requests.append(request)
        path = request.url.path
        # split the raw path so that a quoted "/" inside a model name stays inside it
        parts = [unquote(p) for p in request.url.raw_path.decode().split("?")[0].strip("/").split("/")]
        route = (request.method, path)
        if route in (("GET", "/v2/health/live"), ("GET", "/v2/health/ready")):
            return httpx.Response(200)
        if route == ("GET", "/v2"):
            return httpx.Response(200, json={"name": "mmad", "version": "0.1.0", "extensions": ["binary_tensor_data"]})
        if route == ("POST", "/v2/repository/index"):
            return httpx.Response(200, json=[{"name": "m", "version": "1", "state": "READY"}])
        if parts[:3] == ["v2", "repository", "models"]:
            return httpx.Response(200, json={})
        if route == ("GET", "/v2/devices"):
            return httpx.Response(200, json={"selected": {"backend": "cpu"}, "rows": []})
        if route == ("GET", "/metrics"):
            return httpx.Response(200, text="mmad_requests_total 1\n")
        if parts[:2] != ["v2", "models"]:
            return httpx.Response(404, json={"error": f"no route {path}"})
        rest = parts[3:]
        if rest[:1] == ["versions"] and len(rest) >= 2:
            rest = rest[2:]  # /versions/{v}/...
        tail = "/".join(rest)
        if request.method == "PUT" and tail == "":
            doc = json.loads(request.content)
            return httpx.Response(201, json={"name": parts[2], "versions": ["1"], "platform": "mmad", "spec": doc})
        if request.method == "DELETE" and tail == "":
            return httpx.Response(200, json={})
        if request.method == "GET" and tail == "":
            return httpx.Response(200, json={"name": parts[2], "versions": ["1"], "platform": "mmad"})
        if tail == "ready":
            return httpx.Response(200, json={"name": parts[2], "ready": True})
        if tail == "infer":
            return self.infer(request)
        if tail == "train":
            inputs, header = self.decode_tensors(request)
            steps = header["parameters"]["steps"]
            loss = float(np.mean((inputs["INPUT"].astype(np.float64) @ self.matrix - inputs["TARGET"]) ** 2))
            return httpx.Response(200, json={"losses": [loss / (i + 1) for i in range(steps)], "step": steps,
                                             "model_name": parts[2]})
        if tail == "weights" and request.method == "GET":
            return httpx.Response(200, content=write_safetensors(self.weights),
                                  headers={"content-type": "application/octet-stream"})
        if tail == "weights" and request.method == "PUT":
            self.weights = {k: v.copy() for k, v in read_safetensors(request.content).items()}
            return httpx.Response(200, json={"version": "3"})
        if tail == "versions" and request.method == "GET":
            return httpx.Response(200, json={"versions": [{"version": "1", "step": 0}], "latest": "1"})
        if tail == "versions" and request.method == "POST":
            return httpx.Response(200, json={"version": "2"})
        if tail == "stats":
            return httpx.Response(200, json={"model_stats": [{"name": parts[2], "inference_count": 7}]})
        if tail == "datasets" and request.method == "GET":
            return httpx.Response(200, json={"datasets": [{"dataset": d, "rows": len(c["x"])}
                                                          for d, c in self.datasets.items()],
                                             "max_chunk_bytes": self.max_chunk_bytes, "max_dataset_bytes": 1 << 30})
        if tail == "datasets" or (rest[:1] == ["datasets"] and rest[2:] == ["chunks"]):
            if len(request.content) > self.max_chunk_bytes:
                return httpx.Response(413, json={"error": "the body is too large"})
            chunk = read_safetensors(request.content)
            self.chunks.append(chunk)
            if len(self.chunks) == self.fail_at_chunk:
                return httpx.Response(500, json={"error": "internal error: injected"})
            dataset = f"d{len(self.datasets) + 1}" if tail == "datasets" else rest[1]
            held = self.datasets.get(dataset)
            self.datasets[dataset] = chunk if held is None else {
                k: np.concatenate([held[k], chunk[k]]) for k in ("x", "y")}
            return httpx.Response(200, json={"dataset": dataset, "rows": len(self.datasets[dataset]["x"])})
        if rest[:1] == ["datasets"] and request.method == "DELETE":
            self.datasets.pop(rest[1], None)
            return httpx.Response(200, json={"deleted": True})
        if tail == "jobs":
            self.job_steps = json.loads(request.content)["steps"]
            return httpx.Response(202, json={"job": "j1"})
        if tail == "jobs/j1/events":
            return httpx.Response(200, content=self.events(), headers={"content-type": "text/event-stream"})
        if tail == "jobs/j1" and request.method == "GET":
            return httpx.Response(200, json=self.job_status())
        if tail == "jobs/j1" and request.method == "DELETE":
            return httpx.Response(200, json={"job": "j1", "state": "cancelled"})
        return httpx.Response(404, json={"error": f"no route {request.method} {path}"})

    def decode_tensors(self, request: httpx.Request) -> tuple[dict[str, np.ndarray], dict]:
        length = request.headers.get("inference-header-content-length")
        body = request.content
        n = len(body) if length is None else int(length)
        header = json.loads(body[:n])
        arrays, offset = {}, n
        for entry in header["inputs"]:
            dtype = np.dtype(DTYPES[entry["datatype"]]).newbyteorder("<")
            if "data" in entry:
                arrays[entry["name"]] = np.asarray(entry["data"], dtype=dtype).reshape(entry["shape"])
            else:
                size = entry["parameters"]["binary_data_size"]
                arrays[entry["name"]] = np.frombuffer(body[offset:offset + size], dtype=dtype).reshape(entry["shape"])
                offset += size
        assert offset == len(body), "bytes left after the last binary input"
        return arrays, header

    def infer(self, request: httpx.Request) -> httpx.Response:
        inputs, header = self.decode_tensors(request)
        out = inputs["INPUT"].astype(np.float32) @ self.matrix
        params = header.get("parameters", {})
        if params.get("binary_data_output"):
            datatype = params.get("output_datatype", "FP32")
            raw = out.astype(DTYPES[datatype]).tobytes()
            head = json.dumps({"model_name": "m", "outputs": [
                {"name": "OUTPUT", "datatype": datatype, "shape": list(out.shape),
                 "parameters": {"binary_data_size": len(raw)}}]}).encode()
            return httpx.Response(200, content=head + raw, headers={
                "inference-header-content-length": str(len(head)), "content-type": "application/octet-stream"})
        return httpx.Response(200, json={"model_name": "m", "outputs": [
            {"name": "OUTPUT", "datatype": "FP32", "shape": list(out.shape), "data": out.ravel().tolist()}]})

    def job_status(self) -> dict:
        return {"job": "j1", "state": self.job_final, "step": self.job_steps, "steps": self.job_steps,
                "loss": 0.01, "samples_per_s": 1000.0, "versions": ["2"],
                "error": "NaN loss" if self.job_final == "failed" else None}

    def events(self) -> bytes:
        lines = [": keep-alive comment"]
        for step in range(1, self.job_steps + 1):
            data = {"step": step, "steps": self.job_steps, "loss": 1.0 / step, "samples_per_s": 1000.0}
            lines += ["event: progress", f"data: {json.dumps(data)}", ""]
        lines += ["event: checkpoint", 'data: {"version": "2"}', ""]
        if self.send_final_event:
            lines += [f"event: {self.job_final}", f"data: {json.dumps(self.job_status())}", ""]
        return ("\r\n".join(lines) + "\r\n").encode()


@pytest.fixture
def fake() -> FakeDaemon:
    return FakeDaemon()


@pytest.fixture
def client(fake: FakeDaemon):
    with Client("http://mmad.test", transport=httpx.MockTransport(fake)) as c:
        yield c


def random_x(rows: int = 17, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((rows, N_IN)).astype(dtype)


# -- inference ---------------------------------------------------------------------------------
def test_infer_binary_fp32_round_trips_tensor_bytes(client, fake):
    x = random_x()
    out = client.infer("m", x)
    request = fake.requests[-1]
    header_length = int(request.headers["inference-header-content-length"])
    header = json.loads(request.content[:header_length])
    assert request.headers["content-type"] == "application/octet-stream"
    assert header["inputs"] == [{"name": "INPUT", "shape": [17, N_IN], "datatype": "FP32",
                                 "parameters": {"binary_data_size": x.nbytes}}]
    assert header["parameters"]["binary_data_output"] is True
    assert len(request.content) == header_length + x.nbytes
    ref = x.astype(np.float64) @ fake.matrix
    assert out.dtype == np.float32 and out.shape == (17, N_OUT)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-6
    assert not out.flags.writeable  # a view of the response body: no copy was made
    # the daemon compresses when asked and httpx asks by default: the SDK asks for none
    assert request.headers["accept-encoding"] == "identity"


def test_infer_fp16_input_and_output(client, fake):
    x = random_x(dtype=np.float16)
    out = client.infer("m", x, output_dtype=np.float16)
    request = fake.requests[-1]
    header = json.loads(request.content[:int(request.headers["inference-header-content-length"])])
    assert header["inputs"][0]["datatype"] == "FP16"
    assert header["inputs"][0]["parameters"]["binary_data_size"] == x.size * 2
    assert header["parameters"]["output_datatype"] == "FP16"
    assert header["outputs"][0]["parameters"]["output_datatype"] == "FP16"
    ref = (x.astype(np.float32) @ fake.matrix).astype(np.float16)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(out, ref)


def test_infer_json(client, fake):
    x = random_x(rows=4)
    out = client.infer("m", x, binary=False)
    request = fake.requests[-1]
    assert "inference-header-content-length" not in request.headers
    doc = json.loads(request.content)
    assert doc["inputs"][0]["data"] == x.ravel().tolist()
    assert doc["outputs"] == [{"name": "OUTPUT", "parameters": {"binary_data": False}}]
    ref = x.astype(np.float64) @ fake.matrix
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-6


def test_infer_refuses_bad_arguments_before_sending(client, fake):
    with pytest.raises(ValueError, match="binary"):
        client.infer("m", random_x(dtype=np.float16), binary=False)
    with pytest.raises(ValueError, match="binary"):
        client.infer("m", random_x(), binary=False, output_dtype=np.float16)
    with pytest.raises(ValueError, match="NaN"):
        client.infer("m", np.full((2, N_IN), np.nan, np.float32), binary=False)
    with pytest.raises(ValueError, match="2-D"):
        client.infer("m", np.ones(N_IN, np.float32))
    with pytest.raises(TypeError, match="numeric"):
        client.infer("m", np.ones((2, N_IN), np.complex64))
    with pytest.raises(ValueError, match="output_dtype"):
        client.infer("m", random_x(), output_dtype=np.float64)
    assert fake.requests == []


def test_infer_converts_float64_and_quotes_names_and_versions(client, fake):
    x = random_x().astype(np.float64)
    out = client.infer("a/b", x, version=3)
    request = fake.requests[-1]
    assert request.url.raw_path == b"/v2/models/a%2Fb/versions/3/infer"
    header = json.loads(request.content[:int(request.headers["inference-header-content-length"])])
    assert header["inputs"][0]["datatype"] == "FP32"
    ref = x @ fake.matrix
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-6


def test_train_step_sends_input_and_target(client, fake):
    x = random_x(rows=8)
    y = np.random.default_rng(2).standard_normal((8, N_OUT)).astype(np.float32)
    losses = client.train_step("m", x, y, steps=3)
    header = json.loads(fake.requests[-1].content[:int(fake.requests[-1].headers["inference-header-content-length"])])
    assert [i["name"] for i in header["inputs"]] == ["INPUT", "TARGET"]
    assert header["parameters"] == {"steps": 3}
    loss = np.mean((x.astype(np.float64) @ fake.matrix - y) ** 2)
    np.testing.assert_allclose(losses, [loss, loss / 2, loss / 3], rtol=1e-6)
    with pytest.raises(ValueError, match="rows"):
        client.train_step("m", x, y[:4])


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("status, kind", [
    (400, E.BadRequest), (401, E.Unauthorized), (403, E.Forbidden), (404, E.NotFound), (409, E.Conflict),
    (413, E.PayloadTooLarge), (418, E.HTTPStatusError), (500, E.ServerError), (502, E.ServerError),
    (503, E.ServiceUnavailable),
])
def test_status_codes_map_to_typed_errors(status, kind):
    def handler(request):
        return httpx.Response(status, json={"error": f"it went wrong ({status})"}, headers={"Retry-After": "2.5"})

    with Client("http://mmad.test", transport=httpx.MockTransport(handler), retry=None) as client:
        with pytest.raises(kind) as info:
            client.model_metadata("m")
    err = info.value
    assert type(err) is kind and isinstance(err, E.MMADClientError)
    assert err.status_code == status and err.message == f"it went wrong ({status})"
    assert err.response.status_code == status
    assert "/v2/models/m" in str(err)
    if status == 503:
        assert err.retry_after == 2.5 and isinstance(err, E.ServerError)


def test_error_without_json_body_and_http_date_retry_after():
    def handler(request):
        return httpx.Response(503, text="upstream gone", headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})

    with Client("http://mmad.test", transport=httpx.MockTransport(handler), retry=None) as client:
        with pytest.raises(E.ServiceUnavailable) as info:
            client.server_metadata()
    assert info.value.message == "upstream gone"
    assert info.value.retry_after == 0.0  # a date in the past means "now"


@pytest.mark.parametrize("raised, kind", [
    (httpx.ConnectError("refused"), E.TransportError), (httpx.ReadTimeout("slow"), E.TimeoutError),
    (httpx.RemoteProtocolError("reset"), E.TransportError),
])
def test_transport_failures_are_wrapped(raised, kind):
    def handler(request):
        raise raised

    with Client("http://mmad.test", transport=httpx.MockTransport(handler), retry=None) as client:
        with pytest.raises(kind) as info:
            client.server_metadata()
    assert info.value.__cause__ is raised
    assert "GET http://mmad.test/v2" in str(info.value)
    assert isinstance(info.value, E.MMADClientError)
    assert isinstance(info.value, builtins.TimeoutError) == (kind is E.TimeoutError)


def test_malformed_binary_response_is_a_protocol_error():
    def handler(request):
        head = b'{"outputs":[{"name":"OUTPUT","datatype":"FP32","shape":[2,3],"parameters":{"binary_data_size":24}}]}'
        return httpx.Response(200, content=head + b"\0" * 10,
                              headers={"inference-header-content-length": str(len(head))})

    with Client("http://mmad.test", transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(E.ProtocolError, match="needs bytes"):
            client.infer("m", random_x())
    with pytest.raises(E.ProtocolError, match="outside"):
        decode_infer_response(b"{}", 10)
    head = b'{"outputs":[{"name":"OUTPUT","datatype":"FP32","shape":[1],"parameters":{"binary_data_size":4}}]}'
    with pytest.raises(E.ProtocolError, match="after the last"):
        decode_infer_response(head + b"\0" * 8, len(head))
    with pytest.raises(E.ProtocolError, match="binary_data_size 8"):
        decode_infer_response(head.replace(b":4}", b":8}") + b"\0" * 8, len(head))


# -- settings ----------------------------------------------------------------------------------
def test_api_key_is_sent_as_bearer_and_timeout_applies(fake):
    with Client("http://mmad.test", api_key="s3cret", timeout=Timeout(3.0, connect=1.0),
                transport=httpx.MockTransport(fake)) as client:
        client.checkpoint("m")
    request = fake.requests[-1]
    assert request.headers["authorization"] == "Bearer s3cret"
    assert request.extensions["timeout"] == {"connect": 1.0, "read": 3.0, "write": 3.0, "pool": 3.0}
    with Client("http://mmad.test", transport=httpx.MockTransport(fake)) as client:
        client.checkpoint("m")
    assert "authorization" not in fake.requests[-1].headers


def test_health_and_readiness_answer_booleans():
    answers = {"/v2/health/live": 200, "/v2/health/ready": 503, "/v2/models/a/ready": 200,
               "/v2/models/b/ready": 400, "/v2/models/c/ready": 404}

    def handler(request):
        body = {"ready": False} if request.url.path == "/v2/models/a/ready" else {"error": "no"}
        return httpx.Response(answers[request.url.path], json=body)

    with Client("http://mmad.test", transport=httpx.MockTransport(handler)) as client:
        assert client.health_live() is True
        assert client.health_ready() is False
        assert client.model_ready("a") is False  # 200 with {"ready": false}
        assert client.model_ready("b") is False
        with pytest.raises(E.NotFound):
            client.model_ready("c")


def test_every_method_calls_its_documented_endpoint(client, fake):
    x, y = random_x(rows=4), np.zeros((4, N_OUT), np.float32) + 0.5
    calls = [
        (lambda: client.health_live(), "GET", "/v2/health/live"),
        (lambda: client.health_ready(), "GET", "/v2/health/ready"),
        (lambda: client.server_metadata(), "GET", "/v2"),
        (lambda: client.model_metadata("m"), "GET", "/v2/models/m"),
        (lambda: client.model_metadata("m", version="2"), "GET", "/v2/models/m/versions/2"),
        (lambda: client.model_ready("m"), "GET", "/v2/models/m/ready"),
        (lambda: client.model_ready("m", 1), "GET", "/v2/models/m/versions/1/ready"),
        (lambda: client.create_model("m", {"n_input_dims": N_IN}, {"max_batch_rows": 64}), "PUT", "/v2/models/m"),
        (lambda: client.delete_model("m"), "DELETE", "/v2/models/m"),
        (lambda: client.infer("m", x), "POST", "/v2/models/m/infer"),
        (lambda: client.train_step("m", x, y), "POST", "/v2/models/m/train"),
        (lambda: client.get_weights("m", version=1), "GET", "/v2/models/m/weights"),
        (lambda: client.set_weights("m", fake.weights), "PUT", "/v2/models/m/weights"),
        (lambda: client.versions("m"), "GET", "/v2/models/m/versions"),
        (lambda: client.checkpoint("m"), "POST", "/v2/models/m/versions"),
        (lambda: client.repository_index(), "POST", "/v2/repository/index"),
        (lambda: client.load("m"), "POST", "/v2/repository/models/m/load"),
        (lambda: client.unload("m"), "POST", "/v2/repository/models/m/unload"),
        (lambda: client.stats("m"), "GET", "/v2/models/m/stats"),
        (lambda: client.devices(), "GET", "/v2/devices"),
        (lambda: client.metrics(), "GET", "/metrics"),
        (lambda: client.job_status("m", "j1"), "GET", "/v2/models/m/jobs/j1"),
        (lambda: client.cancel_job("m", "j1"), "DELETE", "/v2/models/m/jobs/j1"),
        (lambda: client.start_job("m", "d1", 5, 2), "POST", "/v2/models/m/jobs"),
        (lambda: client.list_datasets("m"), "GET", "/v2/models/m/datasets"),
        (lambda: client.delete_dataset("m", "d1"), "DELETE", "/v2/models/m/datasets/d1"),
    ]
    for call, method, path in calls:
        before = len(fake.requests)
        call()
        assert [(r.method, r.url.path) for r in fake.requests[before:]] == [(method, path)]
    # an upload asks for the server's limits first, then sends its chunks
    before = len(fake.requests)
    client.upload_dataset("m", x, y)
    assert [(r.method, r.url.path) for r in fake.requests[before:]] == [("GET", "/v2/models/m/datasets"),
                                                                        ("POST", "/v2/models/m/datasets")]
    assert fake.requests[11].url.params["version"] == "1"
    assert json.loads(fake.requests[7].content) == {"spec": {"n_input_dims": N_IN}, "config": {"max_batch_rows": 64}}
    assert client.versions("m")["latest"] == "1"
    assert client.checkpoint("m") == "2"
    assert client.stats("m")["model_stats"][0]["inference_count"] == 7
    assert client.metrics().startswith("mmad_requests_total")


def test_weights_round_trip_as_safetensors(client, fake):
    weights = client.get_weights("m")
    for k in fake.weights:
        np.testing.assert_array_equal(weights[k], fake.weights[k])
        assert weights[k].flags.writeable  # the caller owns them
    weights["W0"] *= 2
    weights["b0"] = weights["b0"].astype(np.float64)  # sent as fp32 whatever the caller holds
    assert client.set_weights("m", weights) == "3"
    np.testing.assert_array_equal(fake.weights["W0"], weights["W0"])
    assert fake.weights["b0"].dtype == np.float32
    np.testing.assert_array_equal(fake.weights["b0"], weights["b0"].astype(np.float32))


# -- safetensors -------------------------------------------------------------------------------
def test_safetensors_codec_matches_the_reference_library():
    st = pytest.importorskip("safetensors.numpy", reason="the safetensors package is not installed")
    rng = np.random.default_rng(3)
    tensors = {"W0": rng.standard_normal((16, 5)).astype(np.float32), "b0": rng.standard_normal(16).astype(np.float32),
               "h": rng.standard_normal((3, 2)).astype(np.float16), "n": np.arange(7, dtype=np.int64),
               "scalar": np.array(1.5, dtype=np.float64), "empty": np.zeros((0, 4), np.float32)}
    ours = encode_safetensors(tensors, metadata={"format": "np"})
    (header_length,) = struct.unpack("<Q", ours[:8])
    assert header_length % 8 == 0  # tensors stay aligned
    for decoded in (st.load(ours), decode_safetensors(st.save(tensors)), decode_safetensors(ours)):
        assert decoded.keys() == tensors.keys()
        for k, v in tensors.items():
            assert decoded[k].dtype == v.dtype and decoded[k].shape == v.shape
            np.testing.assert_array_equal(decoded[k], v)


def test_safetensors_decoder_refuses_malformed_data():
    good = encode_safetensors({"a": np.ones(4, np.float32), "b": np.ones(2, np.float32)})
    (n,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8:8 + n])

    def rebuilt(h: dict, payload: bytes = good[8 + n:]) -> bytes:
        head = json.dumps(h).encode()
        return struct.pack("<Q", len(head)) + head + payload

    cases = {
        "needs 8": good[:5],
        "does not fit": struct.pack("<Q", 10**6) + good[8:],
        "not JSON": struct.pack("<Q", 3) + b"{x}",
        "do not hold": rebuilt({**header, "a": {**header["a"], "shape": [5]}}),
        "starts at": rebuilt({"b": header["b"]}, good[8 + n:]),
        "after the last": rebuilt(header, good[8 + n:] + b"\0" * 4),
        "malformed": rebuilt({**header, "a": {**header["a"], "dtype": "X9"}}),
    }
    for words, data in cases.items():
        with pytest.raises(E.ProtocolError, match=words):
            decode_safetensors(data)


def test_sse_parser_follows_the_event_stream_rules():
    parser = SSEParser()
    lines = [":comment", "event: progress", "data: {\"a\":", "data:1}", "id: 7", "", "", "data: plain", "",
             "event: ignored-without-data", ""]
    events = [e for e in map(parser.feed, lines) if e is not None]
    assert [(e.event, e.data) for e in events] == [("progress", '{"a":\n1}'), ("message", "plain")]


# -- training jobs -----------------------------------------------------------------------------
def training_data(rows: int = 50):
    rng = np.random.default_rng(4)
    return rng.standard_normal((rows, N_IN)).astype(np.float32), rng.standard_normal((rows, N_OUT)).astype(np.float64)


def test_train_uploads_dataset_follows_events_and_returns_final_status(client, fake):
    x, y = training_data()
    seen = []
    status = client.train("m", x, y, steps=6, batch_size=16, checkpoint_every=3,
                          progress=lambda event, data: seen.append((event, data.get("step"))))
    np.testing.assert_array_equal(fake.datasets["d1"]["x"], x)
    np.testing.assert_array_equal(fake.datasets["d1"]["y"], y.astype(np.float32))
    job_request = next(r for r in fake.requests if r.url.path.endswith("/jobs"))
    assert json.loads(job_request.content) == {"dataset": "d1", "steps": 6, "batch_size": 16, "checkpoint_every": 3}
    events = next(r for r in fake.requests if r.url.path.endswith("/events"))
    assert events.headers["accept"] == "text/event-stream"
    assert events.extensions["timeout"]["read"] is None  # slow steps must not time the stream out
    assert seen == [("progress", s) for s in range(1, 7)] + [("checkpoint", None), ("done", 6)]
    assert status["state"] == "done" and status["step"] == 6


def test_upload_dataset_splits_rows_into_chunks_within_both_limits(client, fake):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((1000, N_IN)).astype(np.float16)  # 10 + 12 bytes a row
    y = rng.standard_normal((1000, N_OUT))  # float64: sent as float32
    fake.max_chunk_bytes = 6000  # the server's limit, below the chunk_bytes asked for
    dataset = client.upload_dataset("m", x, y, chunk_bytes=8000, progress=False)
    bodies = [r for r in fake.requests if r.method == "POST"]
    per_chunk = len(fake.chunks[0]["x"])
    assert len(bodies) == len(fake.chunks) == -(-1000 // per_chunk) > 1
    assert all(len(r.content) <= 6000 for r in bodies)
    # as many rows as fit: one more would pass the server's limit
    assert len(encode_safetensors({"x": x[:per_chunk + 1], "y": y[:per_chunk + 1].astype(np.float32)})) > 6000
    assert [r.url.path for r in bodies] == ["/v2/models/m/datasets"] + [f"/v2/models/m/datasets/{dataset}/chunks"] * (
        len(bodies) - 1)
    assert all(c["x"].dtype == np.float16 and c["y"].dtype == np.float32 for c in fake.chunks)
    np.testing.assert_array_equal(fake.datasets[dataset]["x"], x)  # float16 bit for bit
    np.testing.assert_array_equal(fake.datasets[dataset]["y"], y.astype(np.float32))
    fake.requests.clear()
    client.upload_dataset("m", x, y, chunk_bytes=1 << 20)  # one chunk would do for the client, not the server
    assert max(len(r.content) for r in fake.requests if r.method == "POST") <= 6000
    with pytest.raises(ValueError, match="cannot hold one row"):
        client.upload_dataset("m", x, y, chunk_bytes=100)


def test_upload_dataset_failing_midway_deletes_the_partial_dataset(client, fake):
    rng = np.random.default_rng(12)
    x, y = rng.standard_normal((300, N_IN)).astype(np.float32), rng.standard_normal((300, N_OUT)).astype(np.float32)
    fake.fail_at_chunk = 3
    with pytest.raises(E.ServerError, match="injected"):
        client.upload_dataset("m", x, y, chunk_bytes=2048)
    assert fake.requests[-1].method == "DELETE" and fake.requests[-1].url.path == "/v2/models/m/datasets/d1"
    assert fake.datasets == {}


def test_upload_progress_true_without_tqdm_is_a_clear_error(client, fake, monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes "import tqdm" fail
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    x, y = random_x(), np.zeros((17, N_OUT), np.float32)
    with pytest.raises(ImportError, match=r"pip install 'mmad-client\[progress\]'"):
        client.upload_dataset("m", x, y, progress=True)
    assert fake.requests == []  # refused before anything was sent
    client.upload_dataset("m", x, y)  # None: no bar without tqdm, no error


def test_upload_progress_bar_counts_the_bytes_sent(client, fake, capsys):
    pytest.importorskip("tqdm", reason="tqdm is not installed")
    rng = np.random.default_rng(13)
    x, y = rng.standard_normal((400, N_IN)).astype(np.float32), rng.standard_normal((400, N_OUT)).astype(np.float32)
    client.upload_dataset("m", x, y, chunk_bytes=4096, progress=True)
    err = capsys.readouterr().err
    sent = sum(len(r.content) for r in fake.requests if r.method == "POST")
    assert "upload m" in err and "100%|" in err and f"{sent / 1024:.1f}k/{sent / 1024:.1f}k" in err, err


def test_train_progress_bar_without_tqdm(client, fake, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # makes "import tqdm" fail
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    x, y = training_data()
    client.train("m", x, y, steps=4, batch_size=8)
    err = capsys.readouterr().err
    assert "train m: 4/4 steps" in err and "samples/s" in err and err.endswith("\n")


def test_train_progress_bar_with_tqdm(client, fake, capsys):
    pytest.importorskip("tqdm", reason="tqdm is not installed")
    x, y = training_data()
    client.train("m", x, y, steps=5, batch_size=8)
    assert "5/5" in capsys.readouterr().err


def test_train_failed_job_raises_and_early_end_polls_status(client, fake):
    x, y = training_data()
    fake.job_final = "failed"
    with pytest.raises(E.JobFailed, match="NaN loss") as info:
        client.train("m", x, y, steps=2, batch_size=8, progress=False)
    assert info.value.status["state"] == "failed"
    fake.job_final, fake.send_final_event = "done", False
    status = client.train("m", x, y, steps=2, batch_size=8, progress=False)
    assert status["state"] == "done"
    assert fake.requests[-1].method == "GET" and fake.requests[-1].url.path == "/v2/models/m/jobs/j1"


def test_interrupt_while_training_cancels_the_job(client, fake):
    def interrupt(event, data):
        raise KeyboardInterrupt

    x, y = training_data()
    with pytest.raises(KeyboardInterrupt):
        client.train("m", x, y, steps=3, batch_size=8, progress=interrupt)
    assert (fake.requests[-1].method, fake.requests[-1].url.path) == ("DELETE", "/v2/models/m/jobs/j1")
    before = len(fake.requests)
    with pytest.raises(KeyboardInterrupt):  # following a job someone else started leaves it running
        client.follow_job("m", "j1", progress=interrupt)
    assert all(r.method == "GET" for r in fake.requests[before:])


# -- AsyncClient -------------------------------------------------------------------------------
def test_async_client_same_methods_same_results(fake):
    x = random_x()
    xt, yt = training_data()

    async def main():
        async with AsyncClient("http://mmad.test", api_key="k", transport=httpx.MockTransport(fake)) as client:
            ready = await client.health_ready()
            out, out16 = await asyncio.gather(client.infer("m", x), client.infer("m", x, output_dtype=np.float16))
            weights = await client.get_weights("m")
            version = await client.set_weights("m", weights)
            status = await client.train("m", xt, yt, steps=3, batch_size=8, progress=False)
            with pytest.raises(E.NotFound):
                await client.job_status("m", "nope")
            return ready, out, out16, weights, version, status

    ready, out, out16, weights, version, status = asyncio.run(main())
    ref = x.astype(np.float64) @ fake.matrix
    assert ready is True and version == "3" and status["state"] == "done"
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-6
    assert out16.dtype == np.float16 and np.linalg.norm(out16 - ref) / np.linalg.norm(ref) < 1e-3
    np.testing.assert_array_equal(weights["W0"], fake.weights["W0"])
    assert all(r.headers["authorization"] == "Bearer k" for r in fake.requests)


def test_async_task_cancelled_while_training_cancels_the_job(fake):
    def cancelled(event, data):
        raise asyncio.CancelledError

    async def main():
        async with AsyncClient("http://mmad.test", transport=httpx.MockTransport(fake)) as client:
            await client.train("m", *training_data(), steps=3, batch_size=8, progress=cancelled)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())
    assert (fake.requests[-1].method, fake.requests[-1].url.path) == ("DELETE", "/v2/models/m/jobs/j1")


def test_async_and_sync_clients_expose_the_same_api():
    public = {n for n in dir(Client) if not n.startswith("_")} - {"close"}
    async_public = {n for n in dir(AsyncClient) if not n.startswith("_")} - {"aclose"}
    assert public == async_public
    for name in public - {"base_url", "timeout"}:
        assert asyncio.iscoroutinefunction(getattr(AsyncClient, name)), name
    assert mmad_client.Timeout is httpx.Timeout
