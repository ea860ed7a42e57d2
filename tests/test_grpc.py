"""The gRPC front end with Triton's own clients (``tritonclient.grpc`` and ``tritonclient.grpc.aio``,
unchanged) against a real daemon on loopback: the flows the HTTP conformance tests cover, each
numeric result against the float64 oracle on fresh random data."""

from __future__ import annotations

import asyncio
import os
import base64
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed (pip install -e .[dev])")
import grpc  # noqa: E402
from tritonclient.grpc import aio as tga, service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402
import tritonclient.utils.shared_memory as shm  # noqa: E402

from conftest import REPO, DaemonProcess, free_port  # noqa: E402
from test_server_api import oracle, rel_err  # noqa: E402

API_KEY = "grpc-test-key"
KEY = {"authorization": f"Bearer {API_KEY}"}
BODY_CAP = 4 * 1024 * 1024
TOL = {"FP32": 1e-5, "FP16": 3e-3}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A daemon (cpu backend, demo model, an API key, a 4 MiB message cap) serving gRPC."""
    store = tmp_path_factory.mktemp("grpc") / "store"
    proc = DaemonProcess(store, "--grpc-port", str(free_port()), "--max-body-bytes", str(BODY_CAP),
                         env={"MMAD_API_KEY": API_KEY})
    proc.grpc = f"127.0.0.1:{proc.args[1]}"
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture
def client(daemon):
    c = tg.InferenceServerClient(daemon.grpc)
    yield c
    c.close()


@pytest.fixture
def http(daemon):
    import httpx

    with httpx.Client(base_url=daemon.url, timeout=30.0) as h:
        yield h


def rows(n: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng().uniform(-1, 1, (n, 2)).astype(dtype)


def status(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value.status(), info.value.message()


def test_health_metadata_and_config(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("demo") and client.is_model_ready("demo", "1")
    assert not client.is_model_ready("nosuch") and not client.is_model_ready("demo", "99")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "mmad"
    assert {"system_shared_memory", "model_repository", "statistics", "model_configuration"} <= set(meta["extensions"])
    assert "cuda_shared_memory" not in meta["extensions"]  # the cpu backend
    model = client.get_model_metadata("demo", as_json=True)
    assert model["versions"] == ["1"] and model["platform"] == "mmad"
    assert model["inputs"] == [{"name": "INPUT", "datatype": "FP32", "shape": ["-1", "2"]}]
    assert model["outputs"] == [{"name": "OUTPUT", "datatype": "FP32", "shape": ["-1", "3"]}]
    config = client.get_model_config("demo").config
    assert config.name == "demo" and config.input[0].name == "INPUT" and list(config.input[0].dims) == [-1, 2]
    assert config.input[0].data_type == tg.model_config_pb2.TYPE_FP32
    assert config.parameters["max_batch_rows"].string_value == "65536"
    assert config.dynamic_batching.max_queue_delay_microseconds == 500


@pytest.mark.parametrize("datatype, out_datatype", [("FP32", "FP32"), ("FP16", "FP32"), ("FP16", "FP16")])
def test_infer_raw_contents(client, http, datatype, out_datatype):
    x = rows(300, np.float16 if datatype == "FP16" else np.float32)
    infer_input = tg.InferInput("INPUT", list(x.shape), datatype)
    infer_input.set_data_from_numpy(x)
    output = tg.InferRequestedOutput("OUTPUT")
    if out_datatype != "FP32":  # mmad's output_datatype parameter
        output._output.parameters["output_datatype"].string_param = out_datatype
    result = client.infer("demo", [infer_input], outputs=[output], request_id="g-1")
    out = result.as_numpy("OUTPUT")
    assert result.get_response().id == "g-1" and result.get_response().model_version == "1"
    assert out.shape == (300, 3) and out.dtype == (np.float16 if out_datatype == "FP16" else np.float32)
    assert rel_err(out.astype(np.float64), oracle(http, "demo", x.astype(np.float32))) <= TOL[datatype]


def test_infer_typed_contents_and_a_pinned_version(daemon, http):
    """Typed contents (fp32_contents), which tritonclient never sends, through its own stub."""
    x = rows(40)
    request = service_pb2.ModelInferRequest(model_name="demo", model_version="1", id="typed")
    tensor = request.inputs.add(name="INPUT", datatype="FP32", shape=[40, 2])
    tensor.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(daemon.grpc) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelInfer(request)
        assert reply.id == "typed" and reply.outputs[0].datatype == "FP32" and list(reply.outputs[0].shape) == [40, 3]
        out = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(40, 3)
        assert rel_err(out, oracle(http, "demo", x, version="1")) <= TOL["FP32"]
        fp16 = service_pb2.ModelInferRequest(model_name="demo")
        fp16.inputs.add(name="INPUT", datatype="FP16", shape=[1, 2])
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(fp16)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "FP16 has no typed contents" in info.value.details()


def test_the_aio_client_with_concurrent_requests(daemon, http):
    inputs = [rows(n) for n in (1, 7, 64, 500, 3)]

    async def run() -> list[np.ndarray]:
        async with tga.InferenceServerClient(daemon.grpc) as aio:
            assert await aio.is_server_live() and await aio.is_model_ready("demo")
            assert (await aio.get_model_metadata("demo", as_json=True))["name"] == "demo"

            async def one(x):
                infer_input = tga.InferInput("INPUT", list(x.shape), "FP32")
                infer_input.set_data_from_numpy(x)
                return (await aio.infer("demo", [infer_input])).as_numpy("OUTPUT")

            return await asyncio.gather(*(one(x) for x in inputs * 4))

    outs = asyncio.run(run())
    for x, out in zip(inputs * 4, outs):
        assert rel_err(out, oracle(http, "demo", x)) <= TOL["FP32"]


def test_streaming_infer_answers_each_request_and_goes_on_after_an_error(client, http):
    results, done = {}, threading.Event()
    inputs = {f"s-{i}": rows(n) for i, n in enumerate((5, 50, 1, 200))}

    def callback(result, error):
        if error is not None:
            results["error"] = error
        else:
            results[result.get_response().id] = result.as_numpy("OUTPUT")
        if len(results) == len(inputs) + 1:
            done.set()

    client.start_stream(callback)
    try:
        for i, (request_id, x) in enumerate(inputs.items()):
            infer_input = tg.InferInput("INPUT", list(x.shape), "FP32")
            infer_input.set_data_from_numpy(x)
            client.async_stream_infer("demo", [infer_input], request_id=request_id)
            if i == 1:  # a bad request in the middle: its error comes back, the stream carries on
                bad = tg.InferInput("INPUT", [2, 3], "FP32")
                bad.set_data_from_numpy(np.ones((2, 3), np.float32))
                client.async_stream_infer("demo", [bad], request_id="bad")
        assert done.wait(30), results
    finally:
        client.stop_stream()
    assert "shape [rows >= 1, 2]" in results.pop("error").message()
    for request_id, x in inputs.items():
        assert rel_err(results[request_id], oracle(http, "demo", x)) <= TOL["FP32"]


@pytest.fixture
def regions():
    made = []

    def make(byte_size: int):
        name = f"g-{uuid.uuid4().hex[:8]}"
        handle = shm.create_shared_memory_region(name, "/" + name, byte_size)
        made.append(handle)
        return name, "/" + name, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def test_system_shared_memory(client, http, regions):
    x = rows(129, np.float16)
    in_name, in_key, in_handle = regions(x.nbytes)
    out_name, out_key, out_handle = regions(64 + 129 * 3 * 4)
    shm.set_shared_memory_region(in_handle, [x])
    client.register_system_shared_memory(in_name, in_key, x.nbytes, headers=KEY)
    client.register_system_shared_memory(out_name, out_key, 129 * 3 * 4, offset=64, headers=KEY)
    try:
        status_by_name = client.get_system_shared_memory_status(as_json=True)["regions"]
        assert status_by_name[out_name]["offset"] == "64" and status_by_name[in_name]["key"] == in_key
        infer_input = tg.InferInput("INPUT", [129, 2], "FP16")
        infer_input.set_shared_memory(in_name, x.nbytes)
        output = tg.InferRequestedOutput("OUTPUT")
        output.set_shared_memory(out_name, 129 * 3 * 4)
        result = client.infer("demo", [infer_input], outputs=[output])
        assert result.get_output("OUTPUT").parameters["shared_memory_region"].string_param == out_name
        out = shm.get_contents_as_numpy(out_handle, np.float32, [129, 3], offset=64)
        assert rel_err(out, oracle(http, "demo", x.astype(np.float32))) <= TOL["FP16"]
        code, message = status(lambda: client.register_system_shared_memory(in_name, in_key, 8, headers=KEY))
        assert code == "StatusCode.INVALID_ARGUMENT" and "already registered" in message
    finally:
        client.unregister_system_shared_memory(in_name, headers=KEY)
        assert list(client.get_system_shared_memory_status(as_json=True)["regions"]) == [out_name]
        client.unregister_system_shared_memory(headers=KEY)
    assert client.get_system_shared_memory_status(as_json=True) == {}


def test_statistics(client):
    before = client.get_inference_statistics("demo", as_json=True)["model_stats"][0]
    infer_input = tg.InferInput("INPUT", [3, 2], "FP32")
    infer_input.set_data_from_numpy(rows(3))
    client.infer("demo", [infer_input])
    after = client.get_inference_statistics("demo", as_json=True)["model_stats"][0]
    assert after["name"] == "demo" and after["version"] == "1"
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 3
    success = after["inference_stats"]["success"]
    assert int(success["count"]) == int(before["inference_stats"]["success"].get("count", 0)) + 1
    assert int(after["inference_stats"]["compute_infer"]["ns"]) > 0
    every = client.get_inference_statistics(as_json=True)["model_stats"]
    assert [s["name"] for s in every] == ["demo"]
    assert status(lambda: client.get_inference_statistics("nosuch"))[0] == "StatusCode.NOT_FOUND"


def test_repository_index_load_and_unload(client):
    index = client.get_model_repository_index(as_json=True)["models"]
    assert index == [{"name": "demo", "version": "1", "state": "READY"}]
    client.unload_model("demo", headers=KEY)
    try:
        assert not client.is_model_ready("demo")
        (row,) = client.get_model_repository_index(as_json=True)["models"]
        assert row["state"] == "UNAVAILABLE" and row["reason"] == "unloaded"
        infer_input = tg.InferInput("INPUT", [1, 2], "FP32")
        infer_input.set_data_from_numpy(rows(1))
        code, message = status(lambda: client.infer("demo", [infer_input]))
        assert code == "StatusCode.UNAVAILABLE" and "not loaded" in message
    finally:
        client.load_model("demo", headers=KEY)
    assert client.is_model_ready("demo")
    code, message = status(lambda: client.load_model("demo", config='{"max_batch_size": 4}', headers=KEY))
    assert code == "StatusCode.INVALID_ARGUMENT" and "not supported" in message


def test_errors_map_to_tritons_status_codes_and_the_daemon_keeps_serving(client, http):
    x = rows(2)
    good = tg.InferInput("INPUT", [2, 2], "FP32")
    good.set_data_from_numpy(x)
    assert status(lambda: client.infer("nosuch", [good]))[0] == "StatusCode.NOT_FOUND"
    assert status(lambda: client.get_model_metadata("nosuch"))[0] == "StatusCode.NOT_FOUND"
    assert status(lambda: client.get_model_config("demo", "99"))[0] == "StatusCode.NOT_FOUND"
    wrong = tg.InferInput("INPUT", [2, 3], "FP32")
    wrong.set_data_from_numpy(np.ones((2, 3), np.float32))
    code, message = status(lambda: client.infer("demo", [wrong]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "must have shape [rows >= 1, 2]; got [2, 3]" in message
    nan = tg.InferInput("INPUT", [2, 2], "FP32")
    nan.set_data_from_numpy(np.array([[0.1, np.nan], [0.2, 0.3]], np.float32))
    code, message = status(lambda: client.infer("demo", [nan]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "NaN or Inf" in message
    integers = tg.InferInput("INPUT", [2, 2], "INT32")
    integers.set_data_from_numpy(np.ones((2, 2), np.int32))
    code, message = status(lambda: client.infer("demo", [integers]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "datatype must be one of FP32, FP16" in message
    code, message = status(lambda: client.unload_model("demo"))
    assert code == "StatusCode.UNAUTHENTICATED" and "authorization: Bearer" in message
    code, _ = status(lambda: client.unload_model("demo", headers={"authorization": "Bearer wrong"}))
    assert code == "StatusCode.PERMISSION_DENIED"
    assert status(lambda: client.register_system_shared_memory("r", "/r", 8))[0] == "StatusCode.UNAUTHENTICATED"
    assert status(lambda: client.unregister_system_shared_memory())[0] == "StatusCode.UNAUTHENTICATED"
    code, message = status(lambda: client.get_cuda_shared_memory_status())
    assert code == "StatusCode.INVALID_ARGUMENT" and "needs the cuda backend" in message
    # a message past the body cap is refused by gRPC itself, before the daemon reads it
    big = tg.InferInput("INPUT", [BODY_CAP // 8 + 1, 2], "FP32")
    big.set_data_from_numpy(rows(BODY_CAP // 8 + 1))
    assert status(lambda: client.infer("demo", [big]))[0] == "StatusCode.RESOURCE_EXHAUSTED"
    out = client.infer("demo", [good]).as_numpy("OUTPUT")
    assert rel_err(out, oracle(http, "demo", x)) <= TOL["FP32"]
    assert client.is_model_ready("demo")


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its sockets' inodes in /proc/net/tcp{,6})."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed between the listing and the read (a file the daemon was reading)
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_the_daemon_listens_on_its_http_and_grpc_ports(daemon):
    assert listening_ports(daemon.proc.pid) == {daemon.port, int(daemon.grpc.rsplit(":", 1)[1])}


def test_a_taken_grpc_port_stops_the_start_and_port_0_serves_none(tmp_path):
    """The port is the daemon's alone: a gRPC server already on it (its sockets allow port
    sharing, as gRPC's do by default) stops the daemon's start with the reason, rather than
    the two sharing its clients."""
    port = free_port()

    async def occupy_and_start() -> subprocess.CompletedProcess:
        other = grpc.aio.server()
        assert other.add_insecure_port(f"127.0.0.1:{port}") == port
        await other.start()
        try:
            return await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "mmad.server.main", "--port", str(free_port()),
                                 "--grpc-port", str(port), "--store", str(tmp_path / "store"), "--no-demo"],
                cwd=REPO, capture_output=True, text=True, timeout=120)
        finally:
            await other.stop(None)

    taken = asyncio.run(occupy_and_start())
    assert taken.returncode != 0
    assert f"the gRPC port cannot be bound at 127.0.0.1:{port}" in taken.stdout + taken.stderr
    off = DaemonProcess(tmp_path / "off", "--grpc-port", "0").start()
    try:
        assert listening_ports(off.proc.pid) == {off.port}
    finally:
        off.stop()


def test_generated_modules_are_what_the_vendored_protos_give():
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) makes the modules; not installed here")
    check = subprocess.run([sys.executable, "scripts/generate_grpc.py", "--check"], cwd=REPO,
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_cuda_shared_memory_needs_no_gpu_to_reach_the_engine(tmp_path):
    """CUDA regions through gRPC on the cpu backend with the registry's seam replaced (as
    tests/test_server_cudashm.py does for HTTP): registration with the raw IPC handle, inputs read
    from a region and outputs written into one, the status and the unregistration."""
    from fastapi.testclient import TestClient
    from test_server_cudashm import FakeIpc

    from mmad.server import Settings, create_app

    port = free_port()
    app = create_app(Settings(store_dir=tmp_path / "store", backend="cpu", probe="cpu", api_key=API_KEY,
                              grpc_port=port))
    with TestClient(app) as http:
        runtime_shm = app.state.runtime.shm
        fake = FakeIpc()
        runtime_shm.cuda_open = fake.open
        client = tg.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert "cuda_shared_memory" in client.get_server_metadata(as_json=True)["extensions"]
            x = rows(65).astype(np.float16)
            in_b64, in_memory = fake.alloc(x.nbytes)
            out_b64, out_memory = fake.alloc(65 * 3 * 2)
            in_memory[:] = x.tobytes()
            client.register_cuda_shared_memory("cin", in_b64.encode(), 0, x.nbytes, headers=KEY)
            client.register_cuda_shared_memory("cout", out_b64.encode(), 0, 65 * 3 * 2, headers=KEY)
            regions = client.get_cuda_shared_memory_status(as_json=True)["regions"]
            assert regions["cin"]["byte_size"] == str(x.nbytes)
            infer_input = tg.InferInput("INPUT", [65, 2], "FP16")
            infer_input.set_shared_memory("cin", x.nbytes)
            output = tg.InferRequestedOutput("OUTPUT")
            output.set_shared_memory("cout", 65 * 3 * 2)
            output._output.parameters["output_datatype"].string_param = "FP16"
            client.infer("demo", [infer_input], outputs=[output])
            out = np.frombuffer(out_memory, np.float16).reshape(65, 3)
            assert rel_err(out.astype(np.float64), oracle(http, "demo", x.astype(np.float32))) <= TOL["FP16"]
            code = status(lambda: client.register_cuda_shared_memory("c2", base64.b64encode(bytes(64)), 0, 8))[0]
            assert code == "StatusCode.UNAUTHENTICATED"
            client.unregister_cuda_shared_memory(headers=KEY)
            assert client.get_cuda_shared_memory_status(as_json=True) == {}
        finally:
            client.close()


@pytest.mark.gpu
def test_cuda_shared_memory_on_a_gpu(tmp_path):
    """The real CUDA IPC path through gRPC: regions a client allocated on GPU 0, the model on
    the cuda backend reading and writing them on the device."""
    pytest.importorskip("cupy", reason="CuPy is not installed: the cuda backend cannot run here")
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory",
                                  reason="tritonclient's cuda_shared_memory (cuda-bindings) is not installed")
    import httpx

    from mmad.spec import bench_spec

    grpc_port = free_port()
    proc = DaemonProcess(tmp_path / "store", "--grpc-port", str(grpc_port),
                         env={"MMAD_BACKEND": "cuda", "MMAD_PROBE": "cuda"}).start(timeout_s=180)
    try:
        with httpx.Client(base_url=proc.url, timeout=120.0) as http:
            r = http.put("/v2/models/M", json={"spec": bench_spec("M").to_json(), "config": {"device": 0}})
            assert r.status_code == 201, r.text
            n_in, n_out = bench_spec("M").n_input_dims, bench_spec("M").n_output_dims
            x = np.random.default_rng().uniform(-1, 1, (4099, n_in)).astype(np.float16)
            ref = oracle(http, "M", x.astype(np.float32))
        src = cudashm.create_shared_memory_region("gin", x.nbytes, 0)
        dst = cudashm.create_shared_memory_region("gout", 4099 * n_out * 2, 0)
        client = tg.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            cudashm.set_shared_memory_region(src, [x])
            client.register_cuda_shared_memory("gin", cudashm.get_raw_handle(src), 0, x.nbytes)
            client.register_cuda_shared_memory("gout", cudashm.get_raw_handle(dst), 0, 4099 * n_out * 2)
            infer_input = tg.InferInput("INPUT", [4099, n_in], "FP16")
            infer_input.set_shared_memory("gin", x.nbytes)
            output = tg.InferRequestedOutput("OUTPUT")
            output.set_shared_memory("gout", 4099 * n_out * 2)
            output._output.parameters["output_datatype"].string_param = "FP16"
            client.infer("M", [infer_input], outputs=[output])
            y = cudashm.get_contents_as_numpy(dst, np.float16, [4099, n_out])
            assert rel_err(y.astype(np.float64), ref) <= TOL["FP16"]
            client.unregister_cuda_shared_memory()
        finally:
            client.close()
            cudashm.destroy_shared_memory_region(src)
            cudashm.destroy_shared_memory_region(dst)
    finally:
        proc.stop()


def test_the_benchmarks_grpc_generator_measures_the_daemon(daemon, http, tmp_path):
    """``mmad bench --service``'s gRPC rows: generator processes timing one window against the
    daemon's gRPC port, every reply checked."""
    import argparse
    import types

    from mmad.bench.grpc_load import grpc_clients
    from mmad.bench.load import MODEL, Bench
    from mmad.spec import bench_spec

    r = http.put(f"/v2/models/{MODEL}", json={"spec": bench_spec(MODEL).to_json()}, headers=KEY)
    assert r.status_code == 201, r.text
    try:
        bench = Bench(argparse.Namespace(generator_slack_s=60.0), tmp_path)
        target = types.SimpleNamespace(grpc_port=int(daemon.grpc.rsplit(":", 1)[1]))
        for rows, datatype in (((1, 16), "FP32"), ((300, 300), "FP16")):
            res = grpc_clients(bench, target, rows, datatype, clients=3, processes=2, max_requests=60,
                               duration_s=1.0, warmup_s=0.2, pool=8)
            assert res["errors"] == {} and res["requests"] > 0 and res["processes"] == 2, res
            assert res["requests_per_s"] > 0 and 0 < res["p50_ms"] <= res["p99_ms"] < 10_000
    finally:
        assert http.delete(f"/v2/models/{MODEL}", headers=KEY).status_code == 200


@pytest.mark.parametrize("peer, loopback, address", [
    ("ipv4:127.0.0.1:5000", True, ("127.0.0.1", 5000)), ("ipv6:%5B::1%5D:5001", True, ("::1", 5001)),
    ("ipv6:%5B::ffff:127.0.0.1%5D:5002", True, ("::ffff:127.0.0.1", 5002)),
    ("ipv4:192.0.2.7:5003", False, ("192.0.2.7", 5003)), ("unix:/tmp/s", True, None)])
def test_a_callers_address_as_grpc_names_it(peer, loopback, address):
    from mmad.grpc.service import is_loopback, peer_address

    assert is_loopback(peer) is loopback and peer_address(peer) == address


def test_infer_messages_at_the_wire_are_what_protobuf_reads():
    """Raw contents read as views and written after the serialized message (mmad/grpc/wire.py):
    protobuf itself reads the same messages back, on fresh random data."""
    from mmad.grpc.generated import grpc_service_pb2 as pb
    from mmad.grpc.wire import WireResponse, read_infer_request, write_infer_response, write_stream_response

    rng = np.random.default_rng()
    tensors = [rng.uniform(-1, 1, (int(rng.integers(1, 3000)), 2)).astype(np.float16) for _ in range(3)]
    request = pb.ModelInferRequest(model_name="demo", id="w", model_version="1")
    for t in tensors:
        request.inputs.add(name="INPUT", datatype="FP16", shape=t.shape)
        request.raw_input_contents.append(t.tobytes())
    request.outputs.add(name="OUTPUT").parameters["output_datatype"].string_param = "FP16"
    wire = read_infer_request(request.SerializeToString())
    assert wire.error is None and [bytes(r) for r in wire.raw] == [t.tobytes() for t in tensors]
    bare = pb.ModelInferRequest()
    bare.CopyFrom(request)
    bare.ClearField("raw_input_contents")
    assert wire.message == bare
    assert read_infer_request(request.SerializeToString()[:-7]).error.startswith("the ModelInferRequest cannot")

    reply = pb.ModelInferResponse(model_name="demo", model_version="1", id="w")
    reply.outputs.add(name="OUTPUT", datatype="FP16", shape=tensors[0].shape)
    encoded = WireResponse.of(reply, [tensors[0], tensors[1][::2]])  # a strided array too
    parsed = pb.ModelInferResponse.FromString(write_infer_response(encoded))
    assert parsed.id == "w" and list(parsed.raw_output_contents) == [tensors[0].tobytes(), tensors[1][::2].tobytes()]
    streamed = pb.ModelStreamInferResponse.FromString(write_stream_response(encoded))
    assert streamed.error_message == "" and streamed.infer_response == parsed


def test_trace_and_log_settings_are_unimplemented(daemon):
    from mmad.grpc.generated import grpc_service_pb2 as pb

    with grpc.insecure_channel(daemon.grpc) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/LogSettings",
                                   request_serializer=pb.LogSettingsRequest.SerializeToString,
                                   response_deserializer=pb.LogSettingsResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            call(pb.LogSettingsRequest())
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "--log-level" in info.value.details()
    assert "NotImplementedError" not in daemon.log()  # answered, not raised


def test_the_grpc_front_end_reaches_the_models_through_the_engine_alone():
    """No module of mmad/grpc imports the HTTP server's internals (registry, batcher, shared
    memory) or a backend, and the engine's interface imports neither front end."""
    import ast

    def imports(path) -> set[str]:
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    for path in sorted((REPO / "mmad" / "grpc").glob("*.py")):
        bad = {m for m in imports(path) if m.startswith(("mmad.server", "mmad.backends"))}
        assert not bad, f"{path.name} imports {sorted(bad)}"
    for name in ("api.py", "auth.py"):
        bad = {m for m in imports(REPO / "mmad" / "engine" / name) if m.startswith(("mmad.server", "mmad.grpc"))}
        assert not bad, f"engine/{name} imports {sorted(bad)}"


def test_calls_in_progress_are_capped_as_connections_are(tmp_path):
    """``--max-connections`` bounds the gRPC calls in progress at once: two open streams hold
    both places, the next call is refused RESOURCE_EXHAUSTED, and a place freed serves again."""
    port = free_port()
    proc = DaemonProcess(tmp_path / "store", "--grpc-port", str(port), "--max-connections", "2").start()
    streams = [tg.InferenceServerClient(f"127.0.0.1:{port}") for _ in range(2)]
    answered = threading.Semaphore(0)
    try:
        for client in streams:
            client.start_stream(lambda result, error: answered.release())
        x = rows(4)
        for client in streams:
            infer_input = tg.InferInput("INPUT", [4, 2], "FP32")
            infer_input.set_data_from_numpy(x)
            client.async_stream_infer("demo", [infer_input])
        for _ in streams:  # each stream's call is in progress on the server: it has answered
            assert answered.acquire(timeout=30)
        third = tg.InferenceServerClient(f"127.0.0.1:{port}")
        code, _ = status(lambda: third.is_server_live())
        assert code == "StatusCode.RESOURCE_EXHAUSTED"
        streams[0].stop_stream()
        deadline = time.monotonic() + 10
        while True:  # the server sees the stream end shortly after the client closes it
            try:
                assert third.is_server_live()
                break
            except InferenceServerException:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        third.close()
    finally:
        for client in streams:
            client.stop_stream()
            client.close()
        proc.stop()


def test_an_open_stream_does_not_hold_the_shutdown(tmp_path):
    """SIGTERM with a stream open and idle: the stream ends UNAVAILABLE at once and the daemon
    exits well within its grace period (30 s), after answering what the stream had sent."""
    port = free_port()
    proc = DaemonProcess(tmp_path / "store", "--grpc-port", str(port)).start()
    client = tg.InferenceServerClient(f"127.0.0.1:{port}")
    seen, ended = [], threading.Event()

    def callback(result, error):
        seen.append(error if error is not None else result.get_response().id)
        if error is not None:
            ended.set()

    try:
        client.start_stream(callback)
        infer_input = tg.InferInput("INPUT", [3, 2], "FP32")
        infer_input.set_data_from_numpy(rows(3))
        client.async_stream_infer("demo", [infer_input], request_id="before")
        deadline = time.monotonic() + 30
        while "before" not in seen:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        began = time.monotonic()
        assert proc.stop(timeout_s=25) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
        assert time.monotonic() - began < 15 and "Traceback" not in proc.log()
        assert ended.wait(10) and "daemon is stopping" in str(seen[-1])
    finally:
        client.stop_stream()
        client.close()
        proc.kill()


@pytest.mark.parametrize("mode", ["loopback", "off"])
def test_grpc_registration_follows_the_shared_memory_rule(tmp_path, mode):
    """gRPC applies the same ``--shared-memory`` rule as HTTP: a keyless daemon registers an
    object of the loopback client's own user (``loopback``), and none at all with ``off``."""
    port = free_port()
    daemon = DaemonProcess(tmp_path / "store", "--grpc-port", str(port), "--shared-memory", mode).start()
    name = f"mmad-grpc-rule-{os.getpid()}-{mode}"
    handle = shm.create_shared_memory_region(name, "/" + name, 64)
    try:
        with tg.InferenceServerClient(f"127.0.0.1:{port}") as c:
            if mode == "off":
                code, message = status(lambda: c.register_system_shared_memory(name, "/" + name, 64))
                assert code == "StatusCode.PERMISSION_DENIED" and "--shared-memory off" in message, message
                assert c.get_system_shared_memory_status(as_json=True) == {}
            else:
                c.register_system_shared_memory(name, "/" + name, 64)
                assert list(c.get_system_shared_memory_status(as_json=True)["regions"]) == [name]
                c.unregister_system_shared_memory(name)
    finally:
        shm.destroy_shared_memory_region(handle)
        daemon.stop()


@pytest.mark.skipif(subprocess.run(["pkg-config", "--exists", "grpc++"], capture_output=True).returncode != 0
                    if shutil.which("pkg-config") and shutil.which("grpc_cpp_plugin") else True,
                    reason="the native gRPC load generator needs libgrpc++-dev and protobuf-compiler-grpc "
                           "(apt-get install libgrpc++-dev protobuf-compiler-grpc)")
def test_the_native_load_generator_drives_and_checks_the_daemon(daemon, tmp_path):
    """bench/grpc_loadgen (mmad bench --service --grpc-generator) builds, sends ModelInfer with raw
    contents that the daemon answers, checks each reply, and counts refused calls by status."""
    built = subprocess.run(["bash", str(REPO / "scripts/gpu/grpc_loadgen.sh"), str(tmp_path / "gen")],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    import json

    def run(model: str) -> dict:
        done = subprocess.run([str(tmp_path / "gen/loadgen"), "--target", daemon.grpc, "--model", model,
                               "--clients", "4", "--rows-min", "1", "--rows-max", "16", "--datatype", "FP32",
                               "--n-in", "2", "--n-out", "3", "--duration-s", "1", "--pool", "16"],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)
    served = run("demo")
    assert served["requests"] > 10 and served["errors"] == {} and served["p99_ms"] >= served["p50_ms"] > 0
    refused = run("no_such_model")
    assert refused["requests"] == 0 and refused["errors"].get("StatusCode.5", 0) > 0  # NOT_FOUND
    assert "no_such_model" in refused["first_error"]
