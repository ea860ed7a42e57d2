"""The daemon over real HTTP (httpx against ``python -m mmad.server.main`` on loopback).

Numerics are checked against the float64 cpu oracle loaded with the weights the server reports.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import re
import threading
import time

import httpx
import numpy as np
from oracle import rel_err
import orjson
import pytest
from safetensors.numpy import load as st_load, save as st_save

from mmad.backends.cpu import CpuBackend
from mmad.spec import MLPSpec

SMALL_SPEC = {"n_input_dims": 5, "n_output_dims": 4, "network": {"n_neurons": 32, "n_hidden_layers": 2},
              "precision": "fp32", "seed": 7}


def oracle(http: httpx.Client, model: str, x: np.ndarray, version: str | None = None) -> np.ndarray:
    """float64 forward with the weights the server reports (live, or a stored version)."""
    spec = MLPSpec.from_json(http.get(f"/v2/models/{model}").json()["spec"])
    r = http.get(f"/v2/models/{model}/weights", params={"version": version} if version else None)
    assert r.status_code == 200, r.text
    with CpuBackend("float64").compile(spec) as ref:
        ref.set_params(st_load(r.content))
        out = ref.forward(x)  # float32 inputs, float64 arithmetic inside
    assert ref.dtype == np.float64
    return out


def binary_infer(http, model, x, *, datatype="FP32", out_datatype="FP32", version=None, headers=None,
                 request_id=None):
    blob = x.astype("<f2" if datatype == "FP16" else "<f4").tobytes()
    header = {"inputs": [{"name": "INPUT", "datatype": datatype, "shape": list(x.shape),
                          "parameters": {"binary_data_size": len(blob)}}],
              "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True, "output_datatype": out_datatype}}]}
    if request_id:
        header["id"] = request_id
    hbytes = orjson.dumps(header)
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    return http.post(path, content=hbytes + blob,
                     headers={"Inference-Header-Content-Length": str(len(hbytes)), **(headers or {})})


def decode_binary(r: httpx.Response) -> tuple[dict, np.ndarray]:
    assert r.status_code == 200, r.text
    n = int(r.headers["Inference-Header-Content-Length"])
    header = orjson.loads(r.content[:n])
    out = header["outputs"][0]
    dtype = "<f2" if out["datatype"] == "FP16" else "<f4"
    assert out["parameters"]["binary_data_size"] == len(r.content) - n
    return header, np.frombuffer(r.content[n:], dtype).reshape(out["shape"])


def create(http, name, spec=SMALL_SPEC, config=None, **kw):
    r = http.put(f"/v2/models/{name}", json={"spec": spec, **({"config": config} if config else {})}, **kw)
    assert r.status_code in (200, 201), r.text
    return r


def test_health_and_server_metadata(http):
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/v2/health/ready").status_code == 200
    meta = http.get("/v2").json()
    assert meta["name"] == "mmad" and "binary_tensor_data" in meta["extensions"]
    assert "mmad_training_jobs" in meta["extensions"]


def test_demo_model_metadata_and_ready(http):
    meta = http.get("/v2/models/demo").json()
    assert meta["platform"] == "mmad" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "INPUT", "datatype": "FP32", "shape": [-1, 2]}]
    assert meta["outputs"] == [{"name": "OUTPUT", "datatype": "FP32", "shape": [-1, 3]}]
    assert http.get("/v2/models/demo/ready").status_code == 200
    assert http.get("/v2/models/demo/versions/1/ready").status_code == 200
    assert http.get("/v2/models/demo/versions/1").json()["name"] == "demo"


def test_json_infer_nested_flat_id_and_oracle(http):
    x = np.random.default_rng(11).uniform(-1, 1, (9, 2)).astype(np.float32)
    ref = oracle(http, "demo", x)
    outs = []
    for data in (x.tolist(), x.reshape(-1).tolist()):
        r = http.post("/v2/models/demo/infer", json={
            "id": "req-42", "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [9, 2], "data": data}],
            "outputs": [{"name": "OUTPUT"}]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"] == "req-42" and body["model_name"] == "demo" and body["model_version"] == "1"
        (out,) = body["outputs"]
        assert out["name"] == "OUTPUT" and out["datatype"] == "FP32" and out["shape"] == [9, 3]
        outs.append(np.array(out["data"], np.float32).reshape(9, 3))
    assert np.array_equal(outs[0], outs[1])
    assert rel_err(outs[0], ref) <= 1e-5


def test_binary_infer_fp32_fp16_against_oracle(http):
    x = np.random.default_rng(12).uniform(-1, 1, (1000, 2)).astype(np.float32)
    header, out32 = decode_binary(binary_infer(http, "demo", x, request_id="b1"))
    assert header["id"] == "b1" and out32.dtype == np.float32
    assert rel_err(out32, oracle(http, "demo", x)) <= 1e-5
    x16 = x.astype(np.float16)
    _, out16 = decode_binary(binary_infer(http, "demo", x16, datatype="FP16", out_datatype="FP16"))
    assert out16.dtype == np.float16
    assert rel_err(out16, oracle(http, "demo", x16.astype(np.float32))) <= 3e-3


def test_fp16_json_is_refused_like_triton(http):
    r = http.post("/v2/models/demo/infer", json={
        "inputs": [{"name": "INPUT", "datatype": "FP16", "shape": [1, 2], "data": [0.5, 0.25]}]})
    assert r.status_code == 400 and "binary" in r.json()["error"]


@pytest.mark.parametrize("tensor, status, words", [
    ({"name": "INPUT", "datatype": "FP32", "shape": [2, 3], "data": [0] * 6}, 400, "shape [rows >= 1, 2]"),
    ({"name": "INPUT", "datatype": "INT32", "shape": [1, 2], "data": [1, 2]}, 400, "datatype"),
    ({"name": "X", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}, 400, "unknown input"),
    ({"name": "INPUT", "datatype": "FP32", "shape": [1, 2], "data": [1, 2, 3]}, 400, "needs 2"),
])
def test_bad_json_tensors_get_400(http, tensor, status, words):
    r = http.post("/v2/models/demo/infer", json={"inputs": [tensor]})
    assert r.status_code == status and words in r.json()["error"], r.text


def test_bad_binary_bodies_get_400(http):
    x = np.ones((4, 2), np.float32)
    header = orjson.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [4, 2],
                                       "parameters": {"binary_data_size": 32}}]})
    body = header + x.tobytes()
    url = "/v2/models/demo/infer"
    truncated = http.post(url, content=body[:-5], headers={"Inference-Header-Content-Length": str(len(header))})
    assert truncated.status_code == 400 and "truncated" in truncated.json()["error"]
    past = http.post(url, content=body, headers={"Inference-Header-Content-Length": str(len(body) + 1)})
    assert past.status_code == 400 and "past the end" in past.json()["error"]
    garbage = http.post(url, content=b"{nope", headers={"Content-Type": "application/json"})
    assert garbage.status_code == 400 and "not valid JSON" in garbage.json()["error"]


def test_nonfinite_inputs_refused_unless_allowed(http):
    x = np.array([[np.nan, 1.0]], np.float32)
    r = binary_infer(http, "demo", x)
    assert r.status_code == 400 and "NaN" in r.json()["error"]
    create(http, "nanok", {**SMALL_SPEC, "n_input_dims": 2}, {"allow_nonfinite": True})
    header, out = decode_binary(binary_infer(http, "nanok", np.array([[np.inf, 1.0]], np.float32)))
    assert out.shape == (1, 4)
    # a large request (checked by the forward, not inline): NaN in its last row, FP16 and FP32
    big = np.random.default_rng().uniform(-1, 1, (20_000, 2))
    for dtype in (np.float16, np.float32):
        y = big.astype(dtype)
        y[-1, -1] = np.nan
        wire = "FP16" if dtype == np.float16 else "FP32"
        for version in (None, "1"):  # the batcher's forward, and a pinned version's
            r = binary_infer(http, "demo", y, datatype=wire, version=version)
            assert r.status_code == 400 and "input 'INPUT' holds NaN or Inf" in r.json()["error"], r.text
        header, out = decode_binary(binary_infer(http, "nanok", y, datatype=wire))
        assert out.shape == (20_000, 4) and np.isfinite(out[:-1]).all()
    assert binary_infer(http, "demo", big.astype(np.float32)).status_code == 200
    assert http.delete("/v2/models/nanok").status_code == 200


def test_unknown_model_version_and_bad_names(http):
    x = np.ones((1, 2), np.float32)
    assert binary_infer(http, "nosuch", x).status_code == 404
    r = binary_infer(http, "demo", x, version="99")
    assert r.status_code == 404 and "no version" in r.json()["error"]
    assert http.get("/v2/models/nosuch").status_code == 404
    assert http.get("/v2/models/demo/versions/7/ready").status_code == 404
    for bad in ("%2E%2E", ".hidden", "a" * 65, "bad%20name", "x..y", "-dash"):
        r = http.put(f"/v2/models/{bad}", json={"spec": SMALL_SPEC})
        assert r.status_code == 400 and "invalid model name" in r.json()["error"], (bad, r.text)
    traversal = http.put("/v2/models/..%2F..%2Fetc", json={"spec": SMALL_SPEC})  # never reaches a route
    assert traversal.status_code == 404 and "error" in traversal.json()
    assert http.get("/v2/nowhere").status_code == 404 and "error" in http.get("/v2/nowhere").json()


def test_oversize_body_is_413_by_length_and_by_stream(http):
    big = b"\0" * (5 * 1024 * 1024)
    r = http.post("/v2/models/demo/infer", content=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]

    def chunks():
        for _ in range(5):
            yield b"\0" * (1024 * 1024)

    r = http.post("/v2/models/demo/infer", content=chunks())  # no Content-Length: counted as it streams
    assert r.status_code == 413 and "limit" in r.json()["error"]
    bomb = gzip.compress(b"\0" * (5 * 1024 * 1024))  # small on the wire, over the cap once inflated
    r = http.post("/v2/models/demo/infer", content=bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and "decompressed" in r.json()["error"]
    assert http.get("/v2/health/ready").status_code == 200


@pytest.mark.parametrize("body, field", [
    ({"spec": {**SMALL_SPEC, "network": {"n_neurons": 33}}}, "network.n_neurons"),
    ({"spec": {**SMALL_SPEC, "loss": {"otype": "Nope"}}}, "loss.otype"),
    ({"spec": {"n_output_dims": 2}}, "n_input_dims"),
    ({"spec": SMALL_SPEC, "config": {"max_batch_rows": 0}}, "config.max_batch_rows"),
    ({"spec": SMALL_SPEC, "bogus": 1}, "unknown field"),
    ({"n_input_dims": 2}, "spec"),
])
def test_malformed_spec_gets_400_naming_the_field(http, body, field):
    r = http.put("/v2/models/badspec", json=body)
    assert r.status_code == 400 and field in r.json()["error"], r.text
    assert http.get("/v2/models/badspec").status_code == 404


def test_create_replace_delete(http):
    r = http.put("/v2/models/crud", json={"spec": SMALL_SPEC})
    assert r.status_code == 201 and r.json()["versions"] == ["1"]
    r = http.put("/v2/models/crud", json={"spec": {**SMALL_SPEC, "n_output_dims": 6}})
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [-1, 6]
    _, out = decode_binary(binary_infer(http, "crud", np.ones((3, 5), np.float32)))
    assert out.shape == (3, 6)
    assert http.delete("/v2/models/crud").status_code == 200
    assert http.get("/v2/models/crud").status_code == 404
    assert http.delete("/v2/models/crud").status_code == 404


def test_train_versions_weights_and_pinned_infer(http):
    create(http, "trainee")
    rng = np.random.default_rng(5)
    x = rng.uniform(-1, 1, (256, 5)).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2], np.cos(x[:, 3]), x[:, 4]], 1).astype(np.float32)
    ref0 = oracle(http, "trainee", x)
    xb, yb = x.tobytes(), y.tobytes()
    header = orjson.dumps({"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": [256, 5], "parameters": {"binary_data_size": len(xb)}},
        {"name": "TARGET", "datatype": "FP32", "shape": [256, 4], "parameters": {"binary_data_size": len(yb)}}],
        "parameters": {"steps": 20}})
    r = http.post("/v2/models/trainee/train", content=header + xb + yb,
                  headers={"Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 200, r.text
    body = r.json()
    losses = np.array(body["losses"])
    assert body["step"] == 20 and len(losses) == 20 and np.isfinite(losses).all()
    expected_first = float(np.mean((ref0 - y) ** 2))  # step 1's loss is the initial weights' L2 loss
    assert abs(losses[0] - expected_first) / expected_first <= 1e-5
    assert losses[-1] < 0.8 * losses[0]

    # the live weights moved; version 1 did not; a checkpoint makes version 2 = live
    _, live = decode_binary(binary_infer(http, "trainee", x))
    _, v1 = decode_binary(binary_infer(http, "trainee", x, version="1"))
    assert rel_err(v1, ref0) <= 1e-5 and rel_err(live, ref0) > 1e-2
    r = http.post("/v2/models/trainee/versions")
    assert r.status_code == 200 and r.json()["version"] == "2"
    listing = http.get("/v2/models/trainee/versions").json()
    assert [v["version"] for v in listing["versions"]] == ["1", "2"] and listing["latest"] == "2"
    assert listing["versions"][1]["step"] == 20
    w2 = http.get("/v2/models/trainee/weights", params={"version": "2"})
    assert hashlib.sha256(w2.content).hexdigest() == listing["versions"][1]["sha256"]
    _, v2 = decode_binary(binary_infer(http, "trainee", x, version="2"))
    assert np.array_equal(v2, live)

    # upload v1's weights back: a new version 3 that serves exactly like v1
    w1 = st_load(http.get("/v2/models/trainee/weights", params={"version": "1"}).content)
    r = http.put("/v2/models/trainee/weights", content=st_save(w1))
    assert r.status_code == 200 and r.json()["version"] == "3"
    _, now = decode_binary(binary_infer(http, "trainee", x))
    assert np.array_equal(now, v1)
    bad = http.put("/v2/models/trainee/weights", content=st_save({"W0": np.ones((2, 2), np.float32)}))
    assert bad.status_code == 400 and "missing" in bad.json()["error"]
    assert http.put("/v2/models/trainee/weights", content=b"not safetensors").status_code == 400
    # JSON training with a wrong TARGET shape
    r = http.post("/v2/models/trainee/train", json={"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": [1, 5], "data": [0] * 5},
        {"name": "TARGET", "datatype": "FP32", "shape": [1, 3], "data": [0] * 3}]})
    assert r.status_code == 400 and "TARGET" in r.json()["error"]


def read_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, orjson.loads(line[6:])))
    return events


def test_training_job_with_sse_checkpoints_and_cancel(http):
    create(http, "jobby", {**SMALL_SPEC, "optimizer": {"otype": "Adam", "learning_rate": 1e-2}})
    rng = np.random.default_rng(9)
    x = rng.uniform(-1, 1, (512, 5)).astype(np.float32)
    y = np.tanh(x[:, :4] * 2).astype(np.float32)
    r = http.post("/v2/models/jobby/datasets", content=st_save({"x": x, "y": y}))
    assert r.status_code == 200 and r.json()["rows"] == 512
    dataset = r.json()["dataset"]
    bad = http.post("/v2/models/jobby/datasets", content=st_save({"x": x, "y": y[:, :3].copy()}))
    assert bad.status_code == 400
    r = http.post("/v2/models/jobby/jobs", json={"dataset": dataset, "steps": 60, "batch_size": 64,
                                                 "checkpoint_every": 25})
    assert r.status_code == 202, r.text
    job = r.json()["job"]
    with http.stream("GET", f"/v2/models/jobby/jobs/{job}/events") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = read_events(stream)
    kinds = [e[0] for e in events]
    assert kinds[-1] == "done" and "progress" in kinds
    checkpoints = [e[1]["version"] for e in events if e[0] == "checkpoint"]
    assert checkpoints == ["2", "3", "4"]  # steps 25, 50 and the end (60)
    final = events[-1][1]
    assert final["state"] == "done" and final["step"] == 60 and final["versions"] == checkpoints
    progress = [e[1] for e in events if e[0] == "progress"]
    assert all({"step", "steps", "loss", "samples_per_s"} <= set(p) for p in progress)
    assert http.get(f"/v2/models/jobby/jobs/{job}").json()["state"] == "done"
    curve = http.get(f"/v2/models/jobby/jobs/{job}/losses").json()
    assert curve["job"] == job and curve["step"] == 60
    steps = [p[0] for p in curve["points"]]
    assert steps[0] == 1 and steps[-1] == 60 and steps == sorted(set(steps))  # the first chunk is one step
    assert all(p[1] is not None and p[1] > 0 for p in curve["points"])
    assert http.get(f"/v2/models/demo/jobs/{job}/losses").status_code == 404
    assert http.get("/v2/models/jobby/versions").json()["versions"][-1]["step"] == 60
    assert http.get("/v2/models/demo/jobs/" + job).status_code == 404
    r = http.post("/v2/models/jobby/jobs", json={"dataset": dataset, "steps": 10, "batch_size": 9999})
    assert r.status_code == 400

    # cancel a long job: it stops, writes a final checkpoint, and the stream ends with "cancelled"
    r = http.post("/v2/models/jobby/jobs", json={"dataset": dataset, "steps": 10**6, "batch_size": 32,
                                                 "checkpoint_every": 10**6})
    job = r.json()["job"]
    assert http.post("/v2/models/jobby/jobs", json={"dataset": dataset, "steps": 5, "batch_size": 8}).status_code == 409
    assert http.delete("/v2/models/jobby").status_code == 409
    deadline = time.monotonic() + 10
    while http.get(f"/v2/models/jobby/jobs/{job}").json()["step"] < 1:
        assert time.monotonic() < deadline, "the job took no step"
        time.sleep(0.02)
    assert http.delete(f"/v2/models/jobby/jobs/{job}").status_code == 200
    with http.stream("GET", f"/v2/models/jobby/jobs/{job}/events") as stream:
        events = read_events(stream)
    assert events[-1][0] == "cancelled" and events[-1][1]["versions"] == ["5"]
    assert http.delete("/v2/models/jobby").status_code == 200


def test_dynamic_batching_merges_and_splits(http):
    create(http, "batchy", config={"max_queue_delay_us": 500_000, "max_batch_rows": 4096})
    before = http.get("/v2/models/batchy/stats").json()["model_stats"][0]
    rng = np.random.default_rng(3)
    inputs = [rng.uniform(-1, 1, (rows, 5)).astype(np.float32) for rows in (1, 7, 16, 3, 30, 2, 9, 11)]
    barrier = threading.Barrier(len(inputs))

    def send(x):
        with httpx.Client(base_url=str(http.base_url), timeout=30) as c:
            barrier.wait()
            return decode_binary(binary_infer(c, "batchy", x))[1]

    with concurrent.futures.ThreadPoolExecutor(len(inputs)) as pool:
        outputs = list(pool.map(send, inputs))
    for x, out in zip(inputs, outputs):
        assert out.shape == (x.shape[0], 4)
        assert rel_err(out, oracle(http, "batchy", x)) <= 1e-5  # every request got its own rows back
    after = http.get("/v2/models/batchy/stats").json()["model_stats"][0]
    requests = after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"]
    executions = after["execution_count"] - before["execution_count"]
    assert requests == len(inputs) and after["inference_count"] - before["inference_count"] == 79
    assert executions < requests, f"{requests} requests ran as {executions} launches: nothing was merged"
    assert http.delete("/v2/models/batchy").status_code == 200


def test_full_queue_is_503_with_retry_after(http):
    create(http, "tiny-queue", config={"max_queue_delay_us": 3_000_000, "max_queue_requests": 1})
    x = np.ones((1, 5), np.float32)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(lambda: binary_infer(httpx.Client(base_url=str(http.base_url), timeout=30),
                                                 "tiny-queue", x))
        deadline = time.monotonic() + 10
        while http.get("/v2/models/tiny-queue").json()["queued_requests"] == 0:  # wait for it to queue
            assert time.monotonic() < deadline, "the first request never reached the queue"
            time.sleep(0.02)
        second = binary_infer(http, "tiny-queue", x)
        assert second.status_code == 503 and second.headers["Retry-After"] == "1"
        assert "queue" in second.json()["error"]
        assert first.result().status_code == 200
    assert http.delete("/v2/models/tiny-queue").status_code == 200


def test_repository_stats_devices_metrics(http):
    index = http.post("/v2/repository/index").json()
    assert {"name": "demo", "version": "1", "state": "READY", "reason": ""} in index
    assert http.post("/v2/repository/models/demo/unload").status_code == 200
    r = binary_infer(http, "demo", np.ones((1, 2), np.float32))
    assert r.status_code == 503 and "not loaded" in r.json()["error"]
    assert http.get("/v2/models/demo/ready").status_code == 503
    assert http.post("/v2/repository/models/demo/load").status_code == 200
    assert decode_binary(binary_infer(http, "demo", np.ones((1, 2), np.float32)))[1].shape == (1, 3)
    assert http.post("/v2/repository/models/nosuch/load").status_code == 404

    before = http.get("/v2/models/demo/stats").json()["model_stats"][0]["inference_stats"]["fail"]["count"]
    assert binary_infer(http, "demo", np.full((1, 2), np.nan, np.float32)).status_code == 400
    stats = http.get("/v2/models/demo/stats").json()["model_stats"][0]
    assert stats["name"] == "demo" and stats["inference_count"] >= 1
    for key in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert set(stats["inference_stats"][key]) == {"count", "ns"}
    assert stats["inference_stats"]["fail"]["count"] == before + 1
    assert any(s["name"] == "demo" for s in http.get("/v2/models/stats").json()["model_stats"])
    assert http.get("/v2/models/demo/versions/1/stats").json()["model_stats"][0]["version"] == "1"
    assert http.get("/v2/models/demo/versions/9/stats").status_code == 404
    assert all(m["state"] == "READY" for m in http.post("/v2/repository/index", json={"ready": True}).json())
    assert http.post("/v2/repository/index", json=[1]).status_code == 400

    devices = http.get("/v2/devices").json()
    assert devices["selected"]["backend"] == "cpu" and devices["selected"]["available"]
    assert any(r["backend"] == "cpu" for r in devices["rows"])

    text = http.get("/metrics").text
    for series in ("mmad_requests_total", "mmad_compute_seconds_bucket", "mmad_batch_rows_bucket",
                   "mmad_inference_samples_total", "mmad_queue_seconds_count", "mmad_request_failures_total"):
        assert series in text, series
    assert 'model="demo"' in text and 'backend="cpu:numpy"' in text
    # this request's own connection is open in the process that holds it
    assert re.search(r'mmad_process_connections\{process="\d+"\} [1-9]', text), text[-2000:]
    assert "/v2/models/{model}" in http.get("/openapi.json").text


def test_unload_runs_queued_requests_before_closing(http):
    create(http, "drain", config={"max_queue_delay_us": 5_000_000})
    x = np.random.default_rng(6).uniform(-1, 1, (3, 5)).astype(np.float32)
    ref = oracle(http, "drain", x)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(lambda: binary_infer(httpx.Client(base_url=str(http.base_url), timeout=30), "drain", x))
        deadline = time.monotonic() + 10
        while http.get("/v2/models/drain").json()["queued_requests"] == 0:
            assert time.monotonic() < deadline, "the request never reached the queue"
            time.sleep(0.02)
        started = time.monotonic()
        assert http.post("/v2/repository/models/drain/unload").status_code == 200
        assert time.monotonic() - started < 4  # the queued request ran at once, without its 5 s delay
        assert rel_err(decode_binary(queued.result())[1], ref) <= 1e-5
    assert binary_infer(http, "drain", x).status_code == 503
    assert http.delete("/v2/models/drain").status_code == 200
