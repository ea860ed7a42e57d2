"""gRPC behind ``mmad serve --workers``: every inference worker serves the gRPC port (the
kernel gives each connection to one of them), infers on the live weights of the models it holds
there, and passes every other call to the primary with the caller's address and key state.

A real daemon of two workers on the cpu backend, reached with ``tritonclient.grpc`` over many
channels (each its own connection), every output against the float64 oracle on fresh random
data; the processes that answered are read from ``mmad_process_infer_requests_total``."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import httpx
import numpy as np
import pytest

tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed (pip install -e .[dev])")
import grpc  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402

from conftest import REPO, DaemonProcess, free_port  # noqa: E402
from oracle import rel_err  # noqa: E402
from test_grpc import API_KEY, KEY, TOL, listening_ports, regions, rows, status  # noqa: E402, F401 - a fixture
from test_server_api import SMALL_SPEC, create, oracle  # noqa: E402
from test_workers import answered_by, children, fresh_connections, stop_and_check  # noqa: E402

WORKERS = 2
CHANNELS = 16  # each connection goes to a worker by a hash: all 16 on one of two, 1 time in 32,768


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    store = tmp_path_factory.mktemp("grpc-workers") / "store"
    grpc_port = free_port()
    proc = DaemonProcess(store, "--workers", str(WORKERS), "--grpc-port", str(grpc_port),
                         "--max-body-bytes", str(4 * 1024 * 1024), env={"MMAD_API_KEY": API_KEY}).start()
    proc.grpc = f"127.0.0.1:{grpc_port}"
    yield proc
    stop_and_check(proc)


@pytest.fixture
def http(daemon):
    with fresh_connections(daemon.url) as client:
        yield client


def channel(target: str) -> tg.InferenceServerClient:
    """A client on a connection of its own (gRPC shares one between channels to the same target)."""
    return tg.InferenceServerClient(target, channel_args=[("grpc.use_local_subchannel_pool", 1)])


@pytest.fixture
def channels(daemon):
    made = [channel(daemon.grpc) for _ in range(CHANNELS)]
    yield made
    for c in made:
        c.close()


def tensor(x: np.ndarray) -> tg.InferInput:
    t = tg.InferInput("INPUT", list(x.shape), "FP16" if x.dtype == np.float16 else "FP32")
    t.set_data_from_numpy(x)
    return t


def new_answers(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {p: after.get(p, 0.0) - before.get(p, 0.0) for p in after}


def test_the_workers_listen_on_the_grpc_port_and_the_primary_does_not(daemon):
    port = int(daemon.grpc.rsplit(":", 1)[1])
    assert port not in listening_ports(daemon.proc.pid)
    workers = children(daemon.proc.pid)
    assert len(workers) == WORKERS and all(port in listening_ports(pid) for pid in workers)


def test_infers_over_many_channels_are_answered_by_every_worker(daemon, http, channels):
    before = answered_by(http)
    stats_before = channels[0].get_inference_statistics("demo", as_json=True)["model_stats"][0]
    rng = np.random.default_rng()
    for c in channels:
        for dtype in (np.float32, np.float16):
            x = rng.uniform(-1, 1, (int(rng.integers(1, 300)), 2)).astype(dtype)
            out = c.infer("demo", [tensor(x)]).as_numpy("OUTPUT")
            assert out.dtype == np.float32 and out.shape == (x.shape[0], 3)
            assert rel_err(out, oracle(http, "demo", x.astype(np.float32))) <= TOL["FP16" if dtype == np.float16 else
                                                                                  "FP32"]
    answered = new_answers(before, answered_by(http))
    assert answered.get("0", 0) == 0, answered  # none of them was passed on to the primary
    assert all(answered.get(str(i), 0) > 0 for i in range(1, WORKERS + 1)), answered
    assert sum(answered.values()) == 2 * CHANNELS
    # the statistics, read through a worker, add up every process's counts (as HTTP's do)
    stats = channels[1].get_inference_statistics("demo", as_json=True)["model_stats"][0]
    success = int(stats["inference_stats"]["success"]["count"])
    assert success == int(stats_before["inference_stats"]["success"].get("count", 0)) + 2 * CHANNELS
    assert http.get("/v2/models/demo/stats").json()["model_stats"][0]["inference_stats"]["success"]["count"] == success


def test_a_pinned_version_is_answered_by_the_primary_and_metadata_is_the_primarys(daemon, http, channels):
    before = answered_by(http)
    x = rows(7)
    for c in channels[:4]:
        result = c.infer("demo", [tensor(x)], model_version="1")
        assert result.get_response().model_version == "1"
        assert rel_err(result.as_numpy("OUTPUT"), oracle(http, "demo", x, version="1")) <= TOL["FP32"]
    assert new_answers(before, answered_by(http)).get("0") == 4
    meta = channels[0].get_model_metadata("demo", as_json=True)
    assert meta["versions"] == http.get("/v2/models/demo").json()["versions"]
    assert [r["name"] for r in channels[1].get_model_repository_index(as_json=True)["models"]] == ["demo"]
    assert channels[2].get_model_config("demo", as_json=True)["config"]["name"] == "demo"
    assert all(c.is_server_ready() and c.is_model_ready("demo") for c in channels)
    assert status(lambda: channels[3].infer("nosuch", [tensor(x)]))[0] == "StatusCode.NOT_FOUND"


def test_a_region_registered_through_one_worker_serves_infers_on_every_worker(daemon, http, channels, regions):
    n = 65
    x = rows(n, np.float16)
    in_name, in_key, in_handle = regions(x.nbytes)
    out_name, out_key, out_handle = regions(n * 3 * 4)
    shm.set_shared_memory_region(in_handle, [x])
    channels[0].register_system_shared_memory(in_name, in_key, x.nbytes, headers=KEY)
    channels[1].register_system_shared_memory(out_name, out_key, n * 3 * 4, headers=KEY)
    before = answered_by(http)
    try:
        for c in channels:
            assert set(c.get_system_shared_memory_status(as_json=True)["regions"]) == {in_name, out_name}
            infer_input = tg.InferInput("INPUT", [n, 2], "FP16")
            infer_input.set_shared_memory(in_name, x.nbytes)
            output = tg.InferRequestedOutput("OUTPUT")
            output.set_shared_memory(out_name, n * 3 * 4)
            shm.set_shared_memory_region(out_handle, [np.full((n, 3), np.nan, np.float32)])
            c.infer("demo", [infer_input], outputs=[output])
            out = shm.get_contents_as_numpy(out_handle, np.float32, [n, 3])
            assert rel_err(out, oracle(http, "demo", x.astype(np.float32))) <= TOL["FP16"]
        answered = new_answers(before, answered_by(http))
        assert answered.get("0", 0) == 0 and all(answered.get(str(i), 0) > 0 for i in range(1, WORKERS + 1)), answered
    finally:
        channels[2].unregister_system_shared_memory(headers=KEY)
    for c in channels:  # gone on every worker
        assert c.get_system_shared_memory_status(as_json=True) == {}
        infer_input = tg.InferInput("INPUT", [n, 2], "FP16")
        infer_input.set_shared_memory(in_name, x.nbytes)
        code, message = status(lambda: c.infer("demo", [infer_input]))
        assert code == "StatusCode.INVALID_ARGUMENT" and in_name in message, message


def test_unload_and_load_through_grpc_reach_every_worker(daemon, http, channels):
    create(http, "swapped", headers={"Authorization": f"Bearer {API_KEY}"})
    x = np.random.default_rng().uniform(-1, 1, (5, 5)).astype(np.float32)
    channels[0].unload_model("swapped", headers=KEY)
    for c in channels:
        assert not c.is_model_ready("swapped")
        code, message = status(lambda: c.infer("swapped", [tensor(x)]))
        assert code == "StatusCode.UNAVAILABLE" and "not loaded" in message, message
    channels[1].load_model("swapped", headers=KEY)
    expected = oracle(http, "swapped", x)
    before = answered_by(http)
    for c in channels:
        assert c.is_model_ready("swapped")
        assert rel_err(c.infer("swapped", [tensor(x)]).as_numpy("OUTPUT"), expected) <= TOL["FP32"]
    answered = new_answers(before, answered_by(http))
    assert answered.get("0", 0) == 0 and all(answered.get(str(i), 0) > 0 for i in range(1, WORKERS + 1)), answered


def test_the_api_key_holds_on_every_worker(daemon, channels, regions):
    name, key, _ = regions(64)
    wrong = {"authorization": "Bearer not-the-key"}
    for c in channels:
        for call in (lambda: c.unload_model("demo"), lambda: c.load_model("demo"),
                     lambda: c.register_system_shared_memory(name, key, 64),
                     lambda: c.unregister_system_shared_memory()):
            assert status(call)[0] == "StatusCode.UNAUTHENTICATED"
        code, message = status(lambda: c.unload_model("demo", headers=wrong))
        assert code == "StatusCode.PERMISSION_DENIED" and "not valid" in message
        assert c.is_model_ready("demo") and c.get_system_shared_memory_status(as_json=True) == {}


def this_hosts_address() -> str:
    """An address of this host other than loopback (the interface a packet out would leave by)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks a route
        except OSError:
            pytest.skip("this host has no route off loopback: no non-loopback address to call from")
        host = s.getsockname()[0]
    if host.startswith("127."):
        pytest.skip("this host's only address is loopback")
    return host


@pytest.mark.parametrize("workers", ["0", "2"])
def test_the_shared_memory_rule_holds_through_a_worker_as_on_the_primary(tmp_path, workers):
    """A keyless ``--shared-memory loopback`` daemon: a caller from another address is refused,
    and a loopback caller registers an object of its own user (the primary finds the caller's
    user from the address the worker passed on), the same with workers as without."""
    host = this_hosts_address()
    port = free_port()
    proc = DaemonProcess(tmp_path / "store", "--host", "0.0.0.0", "--grpc-port", str(port), "--workers", workers,
                         "--shared-memory", "loopback").start()
    name = f"mmad-grpc-workers-rule-{workers}"
    handle = shm.create_shared_memory_region(name, "/" + name, 64)
    try:
        for _ in range(4):  # whichever worker each connection reaches
            with channel(f"{host}:{port}") as outside:
                code, message = status(lambda: outside.register_system_shared_memory(name, "/" + name, 64))
                assert code == "StatusCode.PERMISSION_DENIED" and "--shared-memory loopback" in message, message
                assert outside.get_system_shared_memory_status(as_json=True) == {}
        with channel(f"127.0.0.1:{port}") as local:
            local.register_system_shared_memory(name, "/" + name, 64)
            assert list(local.get_system_shared_memory_status(as_json=True)["regions"]) == [name]
            local.unregister_system_shared_memory(name)
    finally:
        shm.destroy_shared_memory_region(handle)
        stop_and_check(proc)


def test_a_taken_grpc_port_stops_a_start_with_workers(tmp_path):
    port = free_port()

    async def occupy_and_start() -> subprocess.CompletedProcess:
        other = grpc.aio.server()  # its socket allows port sharing, as gRPC's do by default
        assert other.add_insecure_port(f"127.0.0.1:{port}") == port
        await other.start()
        try:
            return await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "mmad.server.main", "--port", str(free_port()), "--workers", "2",
                                 "--grpc-port", str(port), "--store", str(tmp_path / "store"), "--no-demo"],
                cwd=REPO, capture_output=True, text=True, timeout=120)
        finally:
            await other.stop(None)

    taken = asyncio.run(occupy_and_start())
    assert taken.returncode == 2
    assert f"the gRPC port cannot be bound at 127.0.0.1:{port}" in taken.stderr, taken.stderr


def test_the_primarys_engine_route_needs_the_token(daemon):
    with httpx.Client(base_url=daemon.url) as h:
        for headers in ({}, {"mmad-worker-token": "guess"}):
            assert h.post("/_mmad/worker/engine/ready", content=b"", headers=headers).status_code == 404


def test_the_benchmarks_grpc_clients_reach_every_worker(daemon, http, tmp_path):
    """``mmad bench --service``'s gRPC clients of one generator process are connections of their
    own, as its HTTP clients are: with gRPC's default (channels to one address share one
    connection) a generator's clients were all one worker's, whatever their number."""
    import argparse
    import types

    from mmad.bench.grpc_load import grpc_clients
    from mmad.bench.load import MODEL, Bench
    from mmad.spec import bench_spec

    r = http.put(f"/v2/models/{MODEL}", json={"spec": bench_spec(MODEL).to_json()}, headers=KEY)
    assert r.status_code == 201, r.text
    try:
        before = answered_by(http)
        bench = Bench(argparse.Namespace(generator_slack_s=60.0), tmp_path)
        target = types.SimpleNamespace(grpc_port=int(daemon.grpc.rsplit(":", 1)[1]))
        res = grpc_clients(bench, target, (1, 16), "FP32", clients=CHANNELS, processes=1, max_requests=4 * CHANNELS,
                           duration_s=1.0, warmup_s=0.1, pool=8)
        assert res["errors"] == {} and res["processes"] == 1, res
        answered = new_answers(before, answered_by(http))
        assert all(answered.get(str(i), 0) > 0 for i in range(1, WORKERS + 1)), answered
    finally:
        assert http.delete(f"/v2/models/{MODEL}", headers=KEY).status_code == 200
