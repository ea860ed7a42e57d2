"""``mmad serve --workers``: several processes on one port (mmad/server/workers.py).

A real daemon of three inference workers and the primary behind them, on the cpu backend,
reached over loopback with a new connection per request, so the primary's dealer spreads requests
over the workers: the API and system shared-memory suites (test_server_api.py, test_server_shm.py) run
against it unchanged, and the tests below check what only several processes can get wrong: a
change seen by the next request whichever worker it lands on, counts added up over the
processes, regions opened in every worker, a worker dying, the daemon stopping.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import DaemonProcess
from oracle import rel_err
from safetensors.numpy import load as st_load, save as st_save

import test_server_api
import test_server_shm
from mmad.backends.cpu import CpuBackend
from mmad.engine.metrics import Metrics
from mmad.engine.statistics import merge_stats
from mmad.spec import MLPSpec
from test_server_api import SMALL_SPEC, binary_infer, create, decode_binary
from test_server_shm import region, shm, th, triton  # noqa: F401 - fixtures of the imported suite

WORKERS = 3
# Queue limits hold per serving process (docs/service.md, "Several processes"): with three
# workers, two requests with max_queue_requests 1 may both queue, each in its own worker,
# where one process refuses the second; so that test of one process is not repeated here.
ONE_PROCESS_ONLY = {"test_full_queue_is_503_with_retry_after"}


def children(pid: int) -> set[int]:
    """The serving workers of the primary ``pid`` (its spawned children, not the resource tracker)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.add(int(child))
            except FileNotFoundError:  # exited meanwhile
                pass
    return found


def orphaned_workers(test: str) -> set[int]:
    """Worker processes left without their primary (parent 1) that this test's daemon started
    (they inherited its PYTEST_CURRENT_TEST)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"spawn_main" not in (entry / "cmdline").read_bytes():
                continue
            state, ppid = (entry / "stat").read_text().rpartition(")")[2].split()[:2]
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours
            continue
        if state != "Z" and ppid == "1" and f"PYTEST_CURRENT_TEST={test}".encode() in environ:
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def answered_by(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'mmad_process_infer_requests_total\{process="(\d+)"\} (\S+)', text)}


def fresh_connections(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30.0, limits=httpx.Limits(max_keepalive_connections=0))


def wait_for_every_worker(url: str, workers: int = WORKERS, timeout_s: float = 60.0) -> None:
    """Until each worker has answered an infer request."""
    with fresh_connections(url) as http:
        deadline = time.monotonic() + timeout_s
        x = np.zeros((1, 2), np.float32)
        while len([v for v in answered_by(http).values() if v > 0]) < workers:
            assert time.monotonic() < deadline, f"not every process answered: {answered_by(http)}"
            for _ in range(10):
                assert binary_infer(http, "demo", x).status_code == 200


def stop_and_check(proc: DaemonProcess) -> None:
    workers = children(proc.proc.pid)
    proc.stop()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived the stopped primary"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """test_server_api's daemon, with three inference workers."""
    store = tmp_path_factory.mktemp("workers") / "store"
    proc = DaemonProcess(store, "--max-body-bytes", str(4 * 1024 * 1024), "--workers", str(WORKERS)).start()
    assert len(children(proc.proc.pid)) == WORKERS
    wait_for_every_worker(proc.url)
    yield proc
    stop_and_check(proc)


@pytest.fixture
def http(daemon):
    """A new connection per request: the primary passes each to the least loaded worker."""
    with fresh_connections(daemon.url) as client:
        yield client


for _suite in (test_server_api, test_server_shm):
    for _name in dir(_suite):
        if _name.startswith("test_") and _name not in ONE_PROCESS_ONLY:
            globals()[_name] = getattr(_suite, _name)


def forward64(spec: dict, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    model = CpuBackend("float64").compile(MLPSpec.from_json(spec))
    model.set_params(params)
    return model.forward(x)


def infer_many(url: str, model: str, x: np.ndarray, n: int) -> list[np.ndarray]:
    """``n`` infer requests, each on its own connection, 8 at a time."""
    def one(_):
        with fresh_connections(url) as client:
            r = binary_infer(client, model, x)
            assert r.status_code == 200, r.text
            return decode_binary(r)[1]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(n)))


def test_a_change_is_seen_by_the_next_request_on_every_process(daemon, http):
    create(http, "follow")
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (33, 5)).astype(np.float32)
    shapes = {k: v.shape for k, v in st_load(http.get("/v2/models/follow/weights").content).items()}
    for _ in range(3):  # new weights: every request answered after the upload computes with them
        params = {k: (rng.standard_normal(s) * 0.3).astype(np.float32) for k, s in shapes.items()}
        assert http.put("/v2/models/follow/weights", content=st_save(params)).status_code == 200
        ref = forward64(SMALL_SPEC, params, x)
        assert all(rel_err(out, ref) <= 1e-5 for out in infer_many(daemon.url, "follow", x, 24))
    y = rng.uniform(-1, 1, (64, 4)).astype(np.float32)
    r = http.post("/v2/models/follow/train", json={"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": [64, 5], "data": rng.uniform(-1, 1, (64, 5)).ravel().tolist()},
        {"name": "TARGET", "datatype": "FP32", "shape": [64, 4], "data": y.ravel().tolist()}],
        "parameters": {"steps": 5}})
    assert r.status_code == 200, r.text
    trained = st_load(http.get("/v2/models/follow/weights").content)
    ref = forward64(SMALL_SPEC, trained, x)
    assert all(rel_err(out, ref) <= 1e-5 for out in infer_many(daemon.url, "follow", x, 24))
    # replaced by a model of another shape, then deleted: no process answers with the old one
    create(http, "follow", {**SMALL_SPEC, "n_output_dims": 2})
    assert all(out.shape == (33, 2) for out in infer_many(daemon.url, "follow", x, 24))
    assert http.delete("/v2/models/follow").status_code == 200
    for _ in range(24):
        assert binary_infer(http, "follow", x).status_code == 404


def test_counts_add_up_over_processes(daemon, http):
    create(http, "counted")
    x = np.random.default_rng().uniform(-1, 1, (7, 5)).astype(np.float32)
    assert binary_infer(http, "counted", x).status_code == 200
    before = http.get("/v2/models/counted/stats").json()["model_stats"][0]
    served_before = answered_by(http)
    infer_many(daemon.url, "counted", x, 30)
    after = http.get("/v2/models/counted/stats").json()["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 30 * 7
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 30
    text = http.get("/metrics").text
    rows = re.search(r'mmad_inference_count_total\{model="counted",version="1"\} (\S+)', text)
    assert rows is not None and float(rows[1]) == 31 * 7
    served = answered_by(http)
    assert sum(served.values()) - sum(served_before.values()) >= 30
    # live-version infers are the workers' (the primary answers those passed on: pinned versions)
    assert served.get("0", 0) == served_before.get("0", 0)
    assert http.delete("/v2/models/counted").status_code == 200


def test_shared_memory_regions_reach_every_process(daemon, http, region):  # noqa: F811
    x = np.random.default_rng().uniform(-1, 1, (129, 2)).astype(np.float32)
    ref = test_server_api.oracle(http, "demo", x)
    in_name, in_key, in_handle = region(x.nbytes)
    out_name, out_key, out_handle = region(129 * 3 * 4)
    shm.set_shared_memory_region(in_handle, [x])
    host = daemon.url.removeprefix("http://")
    admin = th.InferenceServerClient(host)
    admin.register_system_shared_memory(in_name, in_key, x.nbytes)
    admin.register_system_shared_memory(out_name, out_key, 129 * 3 * 4)
    try:
        for _ in range(12):  # a client each: a connection each
            client = th.InferenceServerClient(host)
            infer_input = th.InferInput("INPUT", [129, 2], "FP32")
            infer_input.set_shared_memory(in_name, x.nbytes)
            requested = th.InferRequestedOutput("OUTPUT")
            requested.set_shared_memory(out_name, 129 * 3 * 4)
            client.infer("demo", [infer_input], outputs=[requested])
            out = shm.get_contents_as_numpy(out_handle, np.float32, [129, 3])
            assert rel_err(out, ref) <= 1e-5
            shm.set_shared_memory_region(out_handle, [np.zeros((129, 3), np.float32)])
            client.close()
    finally:
        admin.unregister_system_shared_memory()
        admin.close()
    body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [129, 2], "parameters": {
        "shared_memory_region": in_name, "shared_memory_byte_size": x.nbytes}}]}
    for _ in range(12):  # unregistered: refused by every process
        r = http.post("/v2/models/demo/infer", json=body)
        assert r.status_code == 400 and "not registered" in r.json()["error"], r.text


def test_internal_routes_need_the_token(http):
    for path in ("/_mmad/worker/state", "/_mmad/worker/weights/demo", "/_mmad/worker/records"):
        for _ in range(6):
            assert http.get(path).status_code == 404
            assert http.get(path, headers={"mmad-worker-token": "guess"}).status_code == 404
    assert "_mmad" not in http.get("/openapi.json").text


def test_a_dead_worker_is_started_again_and_the_workers_follow_the_primary_out(tmp_path):
    proc = DaemonProcess(tmp_path / "store", "--workers", "1").start()
    try:
        wait_for_every_worker(proc.url, workers=1)
        (first,) = children(proc.proc.pid)
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (children(proc.proc.pid) - {first}):
            assert time.monotonic() < deadline, "the dead worker was not started again"
            time.sleep(0.1)
        deadline = time.monotonic() + 30
        while True:  # the port is refused until the new worker listens, then it is ready
            try:
                if httpx.get(f"{proc.url}/v2/health/ready", timeout=5).status_code == 200:
                    break
            except httpx.ConnectError:
                pass
            assert time.monotonic() < deadline, "the daemon was not ready again"
            time.sleep(0.1)
        assert "serving worker 1" in proc.log() and "exited" in proc.log()
        (second,) = children(proc.proc.pid)
        proc.kill()  # SIGKILL: the primary cannot stop its workers; they notice and stop
        test = os.environ["PYTEST_CURRENT_TEST"].rpartition(" ")[0]
        deadline = time.monotonic() + 10
        while alive(second) or orphaned_workers(test):
            assert time.monotonic() < deadline, f"workers outlived their killed primary: {orphaned_workers(test)}"
            time.sleep(0.1)
    finally:
        proc.kill()


def test_persistent_connections_are_spread_evenly_over_the_workers(tmp_path):
    """Each connection goes to the worker with the fewest open ones: 8 clients that keep their
    connections get 4 each on 2 workers (a hash of each connection, as SO_REUSEPORT spreads
    them, puts all 8 on one worker 1 time in 128 and leaves them 4 : 4 only 27 times in 100),
    and the clients that close theirs free their workers' share for the next. (The idle
    timeout is long: a kept connection that the daemon closed between two of a slow run's
    requests, 5 s by default, would be dealt again on the client's next request.)"""
    proc = DaemonProcess(tmp_path / "store", "--workers", "2", "--idle-timeout", "300").start()
    x = np.random.default_rng().uniform(-1, 1, (3, 2)).astype(np.float32)
    try:
        wait_for_every_worker(proc.url, workers=2)

        def answered_per_worker(clients: list[httpx.Client]) -> dict[str, float]:
            with fresh_connections(proc.url) as probe:
                before = answered_by(probe)
            for client in clients:  # one request each, on the connection the client keeps
                assert binary_infer(client, "demo", x).status_code == 200
            with fresh_connections(proc.url) as probe:
                after = answered_by(probe)
            return {k: after[k] - before.get(k, 0.0) for k in after if k != "0"}

        clients = [httpx.Client(base_url=proc.url, timeout=30.0) for _ in range(8)]
        try:
            assert answered_per_worker(clients) == {"1": 4.0, "2": 4.0}
            with fresh_connections(proc.url) as probe:  # one more connection, to one of the two
                text = probe.get("/metrics").text
            held = {m[0]: float(m[1]) for m in re.findall(r'mmad_process_connections\{process="(\d+)"\} (\S+)', text)}
            assert sorted([held["1"], held["2"]]) == [4.0, 5.0], held
            first = answered_per_worker(clients[:1])  # which worker holds client 0's connection
            (holder,) = [k for k, v in first.items() if v == 1.0]
            same = [c for c in clients if answered_per_worker([c])[holder] == 1.0]
            assert len(same) == 4
            for client in same[:3]:  # that worker is left with one open connection, the other four
                client.close()
            time.sleep(0.5)  # the worker counts each closed connection as its loop sees it go
            newcomers = [httpx.Client(base_url=proc.url, timeout=30.0) for _ in range(3)]
            clients += newcomers
            assert answered_per_worker(newcomers) == {holder: 3.0, ({"1", "2"} - {holder}).pop(): 0.0}
        finally:
            for client in clients:
                client.close()
    finally:
        stop_and_check(proc)


def test_merge_stats_adds_every_count():
    def doc(n, batches):
        stats = {k: {"count": n, "ns": 10 * n} for k in ("success", "fail", "queue", "compute_input",
                                                         "compute_infer", "compute_output", "cache_hit",
                                                         "cache_miss")}
        return {"name": "m", "version": "1", "last_inference": n, "inference_count": 3 * n, "execution_count": n,
                "inference_stats": stats,
                "batch_stats": [{"batch_size": b, "compute_input": {"count": n, "ns": 0},
                                 "compute_infer": {"count": n, "ns": 5}, "compute_output": {"count": n, "ns": 0}}
                                for b in batches]}

    merged = merge_stats(doc(2, [1, 4]), [doc(3, [4, 8]), doc(5, [])])
    assert merged["inference_count"] == 30 and merged["execution_count"] == 10 and merged["last_inference"] == 5
    assert merged["inference_stats"]["fail"] == {"count": 10, "ns": 100}
    assert [b["batch_size"] for b in merged["batch_stats"]] == [1, 4, 8]
    assert merged["batch_stats"][1]["compute_infer"] == {"count": 5, "ns": 10}
    assert doc(2, [1, 4])["inference_count"] == 6  # the primary's own document is not changed


def test_metrics_render_sums_shared_series_and_keeps_the_others():
    primary, worker = Metrics(gpu=False), Metrics(process=1, gpu=False)
    for m, n in ((primary, 2), (worker, 5)):
        m.inference_samples.labels("m", "cpu:numpy").inc(n)
        m.compute_seconds.labels("m", "cpu:numpy").observe(0.001 * n)
        m.process_infers.inc(n)
    worker.models_loaded.set(7)  # the primary's alone: not added
    text = primary.render([worker.samples()])[0].decode()
    assert 'mmad_inference_samples_total{backend="cpu:numpy",model="m"} 7.0' in text
    assert 'mmad_compute_seconds_count{backend="cpu:numpy",model="m"} 2.0' in text
    assert 'mmad_process_infer_requests_total{process="0"} 2.0' in text
    assert 'mmad_process_infer_requests_total{process="1"} 5.0' in text
    assert "mmad_models_loaded 0.0" in text


@pytest.mark.gpu
def test_workers_serve_a_cuda_model_with_system_and_cuda_regions(tmp_path):
    """On the GPU host: model M (FP16 I/O) through three workers on the cuda backend, from the
    body (large requests on the workers' own replicas, small ones' batches run by the primary)
    and from CUDA regions (run by the primary for the workers: every worker opens the IPC
    handle to check the references, the primary runs the forward)."""
    pytest.importorskip("cupy", reason="CuPy is not installed: the cuda backend cannot run here")
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory",
                                  reason="tritonclient's cuda_shared_memory (cuda-bindings) is not installed")
    from mmad.spec import bench_spec

    proc = DaemonProcess(tmp_path / "store", "--workers", str(WORKERS),
                         env={"MMAD_BACKEND": "cuda", "MMAD_PROBE": "cuda"}).start(timeout_s=180)
    try:
        wait_for_every_worker(proc.url, timeout_s=180)
        with fresh_connections(proc.url) as http:
            # on GPU 0, where the CUDA regions below are made (on a host of several GPUs the
            # placement could choose another)
            r = http.put("/v2/models/M", json={"spec": bench_spec("M").to_json(), "config": {"device": 0}})
            assert r.status_code == 201, r.text
            x = np.random.default_rng().uniform(-1, 1, (4099, 64)).astype(np.float16)
            ref = test_server_api.oracle(http, "M", x.astype(np.float32))

            def one(_):
                with fresh_connections(proc.url) as client:
                    r = binary_infer(client, "M", x, datatype="FP16", out_datatype="FP16")
                    assert r.status_code == 200, r.text
                    return decode_binary(r)[1]

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                assert all(rel_err(out, ref) <= 3e-3 for out in pool.map(one, range(24)))
            assert len([v for v in answered_by(http).values() if v > 0]) == WORKERS

            # small requests: the workers' batches run in the primary's context (RegionForwardClient.forward_rows)
            rng = np.random.default_rng()
            inputs = [rng.uniform(-1, 1, (1 + k % 17, 64)).astype(np.float16) for k in range(48)]
            refs = [test_server_api.oracle(http, "M", xs.astype(np.float32)) for xs in inputs]

            def small(k):
                with fresh_connections(proc.url) as client:
                    r = binary_infer(client, "M", inputs[k], datatype="FP16", out_datatype="FP16" if k % 2 else "FP32")
                    assert r.status_code == 200, r.text
                    return rel_err(decode_binary(r)[1].astype(np.float32), refs[k])

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                assert max(pool.map(small, range(48))) <= 3e-3
            nan = np.zeros((3, 64), np.float16)
            nan[1, 5] = np.nan
            r = binary_infer(http, "M", nan, datatype="FP16")
            assert r.status_code == 400 and "NaN" in r.json()["error"], r.text

            host = proc.url.removeprefix("http://")
            tag = uuid.uuid4().hex[:8]
            src = cudashm.create_shared_memory_region(f"in-{tag}", x.nbytes, 0)
            dst = cudashm.create_shared_memory_region(f"out-{tag}", 4099 * 64 * 2, 0)
            try:
                cudashm.set_shared_memory_region(src, [x])
                admin = th.InferenceServerClient(host)
                for name, allocation, size in ((f"in-{tag}", src, x.nbytes), (f"out-{tag}", dst, 4099 * 64 * 2)):
                    raw = cudashm.get_raw_handle(allocation)
                    admin.register_cuda_shared_memory(name, raw.decode() if isinstance(raw, bytes) else raw, 0, size)
                for _ in range(12):  # a client each: a connection each
                    client = th.InferenceServerClient(host)
                    inp = th.InferInput("INPUT", [4099, 64], "FP16")
                    inp.set_shared_memory(f"in-{tag}", x.nbytes)
                    out = th.InferRequestedOutput("OUTPUT")
                    out.set_shared_memory(f"out-{tag}", 4099 * 64 * 2)
                    out._parameters["output_datatype"] = "FP16"
                    client.infer("M", [inp], outputs=[out])
                    y = cudashm.get_contents_as_numpy(dst, np.float16, [4099, 64])
                    assert rel_err(y, ref) <= 3e-3
                    cudashm.set_shared_memory_region(dst, [np.zeros((4099, 64), np.float16)])
                    client.close()
                admin.unregister_cuda_shared_memory()
                admin.close()
            finally:
                cudashm.destroy_shared_memory_region(src)
                cudashm.destroy_shared_memory_region(dst)
    finally:
        stop_and_check(proc)


@pytest.mark.gpu
def test_workers_pass_a_two_replica_models_system_regions_to_the_primary(tmp_path):
    """On a host of two GPUs: model M with a replica on each, served through three workers
    from system shared-memory regions (run by the primary's one context per GPU, the replicas in
    turn): every output matches the oracle and both GPUs served."""
    cp = pytest.importorskip("cupy", reason="CuPy is not installed: the cuda backend cannot run here")
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU here: a model's second replica needs a second GPU")
    sysshm = pytest.importorskip("tritonclient.utils.shared_memory", reason="tritonclient is not installed")
    from mmad.spec import bench_spec

    proc = DaemonProcess(tmp_path / "store", "--workers", str(WORKERS),
                         env={"MMAD_BACKEND": "cuda", "MMAD_PROBE": "cuda"}).start(timeout_s=180)
    try:
        wait_for_every_worker(proc.url, timeout_s=180)
        with fresh_connections(proc.url) as http:
            r = http.put("/v2/models/M", json={"spec": bench_spec("M").to_json(), "config": {"replicas": 2}})
            assert r.status_code == 201, r.text
            rows = 20_000
            host = proc.url.removeprefix("http://")
            tag = uuid.uuid4().hex[:8]
            nbytes = rows * 64 * 2
            regions = {name: sysshm.create_shared_memory_region(f"{name}-{tag}", f"/{name}-{tag}", nbytes)
                       for name in ("in", "out")}
            try:
                admin = th.InferenceServerClient(host)
                for name in regions:
                    admin.register_system_shared_memory(f"{name}-{tag}", f"/{name}-{tag}", nbytes)
                for k in range(12):  # a client each: a connection each, fresh rows each
                    x = np.random.default_rng().uniform(-1, 1, (rows, 64)).astype(np.float16)
                    sysshm.set_shared_memory_region(regions["in"], [x])
                    client = th.InferenceServerClient(host)
                    inp = th.InferInput("INPUT", [rows, 64], "FP16")
                    inp.set_shared_memory(f"in-{tag}", nbytes)
                    out = th.InferRequestedOutput("OUTPUT")
                    out.set_shared_memory(f"out-{tag}", nbytes)
                    client.infer("M", [inp], outputs=[out], parameters={"output_datatype": "FP16"})
                    y = sysshm.get_contents_as_numpy(regions["out"], np.float16, [rows, 64])
                    assert rel_err(y, test_server_api.oracle(http, "M", x.astype(np.float32))) <= 3e-3
                    client.close()
                admin.unregister_system_shared_memory()
                admin.close()
            finally:
                for allocation in regions.values():
                    sysshm.destroy_shared_memory_region(allocation)
            served = {line.split('device="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                      for line in http.get("/metrics").text.splitlines()
                      if line.startswith('mmad_replica_rows_total{') and 'model="M"' in line}
            assert set(served) == {"0", "1"} and min(served.values()) >= rows, served
    finally:
        stop_and_check(proc)


def test_the_api_key_and_the_body_cap_hold_through_the_workers(tmp_path):
    """Admin calls passed on to the primary keep its answers: 401 without the key, 413 for a
    body past the cap (declared or streamed in chunks), and the daemon serves on."""
    key = "workers-" + uuid.uuid4().hex
    proc = DaemonProcess(tmp_path / "store", "--workers", "2", "--max-body-bytes", str(64 * 1024),
                         env={"MMAD_API_KEY": key}).start()
    try:
        with fresh_connections(proc.url) as http:
            for _ in range(6):  # both workers, whichever takes the connection
                r = http.put("/v2/models/keyed", json={"spec": SMALL_SPEC})
                assert r.status_code == 401 and "Authorization" in r.json()["error"]
            r = http.put("/v2/models/keyed", json={"spec": SMALL_SPEC}, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 201, r.text
            big = b"x" * (128 * 1024)
            for _ in range(4):
                assert http.put("/v2/models/keyed/weights", content=big,
                                headers={"Authorization": f"Bearer {key}"}).status_code == 413
                streamed = http.put("/v2/models/keyed/weights", content=iter([big[:65536], big[65536:]]),
                                    headers={"Authorization": f"Bearer {key}"})
                assert streamed.status_code == 413, streamed.text
            x = np.random.default_rng().uniform(-1, 1, (5, 5)).astype(np.float32)
            assert all(rel_err(out, test_server_api.oracle(http, "keyed", x)) <= 1e-5
                       for out in infer_many(proc.url, "keyed", x, 8))
    finally:
        stop_and_check(proc)
