"""Triton's CUDA shared-memory extension: the routes, the registration checks and every region
reference, in CI without a GPU.

The daemon runs in-process on the cpu backend; the registry's seam (``cuda_open``, the function
that turns an IPC handle into a region) is replaced by a fake whose "device memory" is host
bytes, so the request path (inputs read from a region, outputs written into one, on the
model's arrays) is the real one. With the cpu backend as it comes, the routes answer 400.
The real opener runs on a GPU in tests/test_cuda_transport.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import types
import uuid
from multiprocessing import shared_memory

import numpy as np
import orjson
import pytest
from fastapi.testclient import TestClient

from test_server_api import oracle, rel_err
from mmad.errors import InvalidInput, MMADError, ModelNotFound, NonFiniteInput, NotReady
from mmad.server import Settings, create_app
from mmad.backends.cuda.ipc import CudaRegion
from mmad.engine.region_forwards import ROWS_INLINE_BYTES, RegionForwardClient, RegionForwardRunner

API_KEY = "cudashm-test-key"
ROWS, IN_COLS, OUT_COLS = 257, 2, 3  # the demo model: [rows, 2] -> [rows, 3]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class FakeIpc:
    """Allocations of "device" memory (host bytes) by IPC handle, opened as a real opener does:
    an unknown handle, another device or a byte_size past the allocation is refused."""

    def __init__(self) -> None:
        self.allocations: dict[bytes, tuple[int, bytearray]] = {}

    def alloc(self, nbytes: int, device: int = 0) -> tuple[str, bytearray]:
        handle = os.urandom(64)
        memory = bytearray(nbytes)
        self.allocations[handle] = (device, memory)
        return base64.b64encode(handle).decode(), memory

    def open(self, name: str, handle: bytes, device_id: int, byte_size: int) -> CudaRegion:
        if handle not in self.allocations:
            raise InvalidInput(f"unable to open the CUDA IPC handle of region {name!r}")
        device, memory = self.allocations[handle]
        if device != device_id:
            raise InvalidInput(f"unable to open the CUDA IPC handle of region {name!r} on GPU {device_id}")
        if byte_size > len(memory):
            raise InvalidInput(f"byte_size {byte_size} is larger than the allocation ({len(memory)} bytes)")
        return CudaRegion(name, device_id, byte_size,
                          lambda offset, dtype, shape: np.frombuffer(memory, dtype, int(np.prod(shape)),
                                                                     offset).reshape(shape))


@pytest.fixture(scope="module")
def app_client(tmp_path_factory):
    root = tmp_path_factory.mktemp("cudashm")
    # the in-process client is no loopback peer: a keyed daemon open to every client
    app = create_app(Settings(store_dir=root / "store", backend="cpu", probe="cpu", api_key=API_KEY,
                              shared_memory="on"))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client


@pytest.fixture
def client(app_client):
    """The daemon with the fake opener in place of CUDA's (restored afterwards)."""
    app, client = app_client
    shm = app.state.runtime.shm
    fake = FakeIpc()
    saved = shm.cuda_open
    shm.cuda_open = fake.open
    client.fake = fake
    yield client
    client.post("/v2/cudasharedmemory/unregister", headers=AUTH)
    client.post("/v2/systemsharedmemory/unregister", headers=AUTH)
    shm.cuda_open = saved


def register(client, name: str, b64: str, byte_size: int, device_id: int = 0):
    return client.post(f"/v2/cudasharedmemory/region/{name}/register", headers=AUTH,
                       json={"raw_handle": {"b64": b64}, "device_id": device_id, "byte_size": byte_size})


def infer(client, inputs: list[dict], outputs: list[dict]):
    return client.post("/v2/models/demo/infer", content=orjson.dumps({"inputs": inputs, "outputs": outputs}))


def shm_input(region: str, byte_size: int, offset: int = 0, datatype: str = "FP32", rows: int = ROWS) -> dict:
    return {"name": "INPUT", "datatype": datatype, "shape": [rows, IN_COLS],
            "parameters": {"shared_memory_region": region, "shared_memory_offset": offset,
                           "shared_memory_byte_size": byte_size}}


def shm_output(region: str, byte_size: int, offset: int = 0, datatype: str = "FP32") -> dict:
    return {"name": "OUTPUT", "parameters": {"shared_memory_region": region, "shared_memory_offset": offset,
                                             "shared_memory_byte_size": byte_size, "output_datatype": datatype}}


def assert_400(r, *words: str) -> str:
    assert r.status_code == 400, (r.status_code, r.text)
    message = r.json()["error"]
    for word in words:
        assert word in message, message
    return message


def test_cpu_backend_answers_400_and_does_not_list_the_extension(app_client):
    _, client = app_client
    assert "cuda_shared_memory" not in client.get("/v2").json()["extensions"]
    assert "system_shared_memory" in client.get("/v2").json()["extensions"]
    for r in (client.get("/v2/cudasharedmemory/status"), client.get("/v2/cudasharedmemory/region/r/status"),
              register(client, "r", base64.b64encode(bytes(64)).decode(), 64),
              client.post("/v2/cudasharedmemory/unregister", headers=AUTH),
              client.post("/v2/cudasharedmemory/region/r/unregister", headers=AUTH)):
        assert_400(r, "CUDA shared memory needs the cuda backend", "cpu")


@pytest.mark.parametrize("datatype, out_datatype, tol",
                         [("FP32", "FP32", 1e-5), ("FP16", "FP32", 3e-3), ("FP16", "FP16", 3e-3)])
def test_inputs_and_outputs_in_cuda_regions(client, datatype, out_datatype, tol):
    assert "cuda_shared_memory" in client.get("/v2").json()["extensions"]
    dtype = np.float16 if datatype == "FP16" else np.float32
    out_dtype = np.float16 if out_datatype == "FP16" else np.float32
    x = np.random.default_rng().uniform(-1, 1, (ROWS, IN_COLS)).astype(dtype)  # fresh every run
    out_bytes = ROWS * OUT_COLS * np.dtype(out_dtype).itemsize
    in_b64, in_mem = client.fake.alloc(x.nbytes + 64)
    out_b64, out_mem = client.fake.alloc(out_bytes + 32)
    in_mem[64:] = x.tobytes()
    assert register(client, "in", in_b64, x.nbytes + 64).status_code == 200
    assert register(client, "out", out_b64, out_bytes + 32).status_code == 200
    status = client.get("/v2/cudasharedmemory/status").json()
    assert sorted(status, key=lambda s: s["name"]) == [
        {"name": "in", "device_id": 0, "byte_size": x.nbytes + 64},
        {"name": "out", "device_id": 0, "byte_size": out_bytes + 32}]
    assert client.get("/v2/systemsharedmemory/status").json() == []  # the kinds stay apart

    r = infer(client, [shm_input("in", x.nbytes, offset=64, datatype=datatype)],
              [shm_output("out", out_bytes + 32, datatype=out_datatype)])
    assert r.status_code == 200, r.text
    entry = r.json()["outputs"][0]
    assert entry["shape"] == [ROWS, OUT_COLS] and "data" not in entry
    assert entry["parameters"]["shared_memory_region"] == "out"
    out = np.frombuffer(out_mem, out_dtype, ROWS * OUT_COLS).reshape(ROWS, OUT_COLS)
    assert rel_err(out.astype(np.float32), oracle(client, "demo", x.astype(np.float32))) <= tol


def test_input_in_cuda_region_output_in_body(client):
    x = np.random.default_rng().uniform(-1, 1, (ROWS, IN_COLS)).astype(np.float32)
    b64, mem = client.fake.alloc(x.nbytes)
    mem[:] = x.tobytes()
    assert register(client, "in", b64, x.nbytes).status_code == 200
    r = infer(client, [shm_input("in", x.nbytes)], [{"name": "OUTPUT"}])
    assert r.status_code == 200, r.text
    out = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(ROWS, OUT_COLS)
    assert rel_err(out, oracle(client, "demo", x)) <= 1e-5


def test_input_in_body_output_in_cuda_region(client):
    x = np.random.default_rng().uniform(-1, 1, (ROWS, IN_COLS)).astype(np.float32)
    b64, mem = client.fake.alloc(ROWS * OUT_COLS * 4)
    assert register(client, "out", b64, len(mem)).status_code == 200
    r = infer(client, [{"name": "INPUT", "datatype": "FP32", "shape": [ROWS, IN_COLS], "data": x.ravel().tolist()}],
              [shm_output("out", len(mem))])
    assert r.status_code == 200, r.text
    out = np.frombuffer(mem, np.float32).reshape(ROWS, OUT_COLS)
    assert rel_err(out, oracle(client, "demo", x)) <= 1e-5


def test_status_and_unregister(client):
    b64, mem = client.fake.alloc(256)
    assert register(client, "a", b64, 256).status_code == 200
    assert client.get("/v2/cudasharedmemory/region/a/status").json() == [
        {"name": "a", "device_id": 0, "byte_size": 256}]
    assert_400(client.get("/v2/systemsharedmemory/region/a/status"), "unable to find system shared memory")
    assert client.post("/v2/systemsharedmemory/region/a/unregister", headers=AUTH).status_code == 200
    assert client.get("/v2/cudasharedmemory/status").json() != []  # a system unregister leaves it
    assert client.post("/v2/cudasharedmemory/region/a/unregister", headers=AUTH).status_code == 200
    assert_400(client.get("/v2/cudasharedmemory/region/a/status"), "unable to find cuda shared memory region 'a'")
    assert client.post("/v2/cudasharedmemory/region/gone/unregister", headers=AUTH).status_code == 200  # as Triton


def test_bad_registrations_are_400(client):
    b64, _ = client.fake.alloc(256)
    assert_400(register(client, "r", b64, 257), "larger than the allocation")
    assert_400(register(client, "r", b64, 256, device_id=1), "GPU 1")
    assert_400(register(client, "r", base64.b64encode(os.urandom(64)).decode(), 64), "unable to open")
    assert_400(register(client, "r", "not base64!", 64), "not valid base64")
    assert_400(register(client, "r", base64.b64encode(bytes(10)).decode(), 64), "10 bytes", "64")
    assert_400(register(client, "r", b64, 0), "byte_size must be at least 1")
    assert_400(register(client, "r", b64, -5), "byte_size must be a non-negative integer")
    assert_400(register(client, "r", b64, 64, device_id=-1), "device_id must be a non-negative integer")
    assert_400(client.post("/v2/cudasharedmemory/region/r/register", headers=AUTH, json=[1]), "JSON object")
    assert_400(client.post("/v2/cudasharedmemory/region/r/register", headers=AUTH,
                           json={"raw_handle": b64, "device_id": 0, "byte_size": 64}), 'raw_handle must be {"b64"')
    assert register(client, "r", b64, 256).status_code == 200
    assert_400(register(client, "r", b64, 256), "already registered")
    assert client.get("/v2/cudasharedmemory/status").json() == [{"name": "r", "device_id": 0, "byte_size": 256}]


def test_bad_references_are_400_and_the_daemon_keeps_serving(client):
    x = np.random.default_rng().uniform(-1, 1, (ROWS, IN_COLS)).astype(np.float32)
    size, out_size = x.nbytes, ROWS * OUT_COLS * 4
    b64, mem = client.fake.alloc(size + out_size)
    mem[:size] = x.tobytes()
    assert register(client, "r", b64, size + out_size).status_code == 200
    out_ok = shm_output("r", out_size, offset=size)
    cases = [
        (shm_input("r", size, offset=out_size + 8), out_ok, "past the end of region 'r'"),
        (shm_input("r", size, offset=-4), out_ok, "shared_memory_offset must be a non-negative integer"),
        (shm_input("r", -1), out_ok, "shared_memory_byte_size must be a non-negative integer"),
        (shm_input("r", size - 4), out_ok, f"shared_memory_byte_size is {size - 4} bytes"),
        (shm_input("nope", size), out_ok, "region 'nope' is not registered"),
        (shm_input("r", size), shm_output("r", out_size, offset=size + 4), "past the end of region"),
        (shm_input("r", size), shm_output("r", 8), "needs at least"),
        (shm_input("r", size), shm_output("r", out_size, offset=size - 4),
         f"would be written over input 'INPUT': both lie in bytes {size - 4} to {size - 1}"),
        (shm_input("r", size), shm_output("r", out_size, offset=0), "would be written over input"),
    ]
    for inp, out, words in cases:
        assert_400(infer(client, [inp], [out]), words)
    # the region still serves a good request, and matches the oracle
    r = infer(client, [shm_input("r", size)], [out_ok])
    assert r.status_code == 200, r.text
    out = np.frombuffer(mem, np.float32, ROWS * OUT_COLS, size).reshape(ROWS, OUT_COLS)
    assert rel_err(out, oracle(client, "demo", x)) <= 1e-5


def test_region_on_another_gpu_than_the_model_is_400(client):
    b64, mem = client.fake.alloc(ROWS * IN_COLS * 4, device=1)
    mem[:] = np.random.default_rng().uniform(-1, 1, ROWS * IN_COLS).astype(np.float32).tobytes()
    assert register(client, "far", b64, len(mem), device_id=1).status_code == 200
    assert_400(infer(client, [shm_input("far", len(mem))], [{"name": "OUTPUT"}]),
               "region 'far' is on GPU 1", "runs on GPU 0")


def test_non_finite_input_in_a_region_is_400(client):
    x = np.random.default_rng().uniform(-1, 1, (ROWS, IN_COLS)).astype(np.float32)
    x[5, 1] = np.nan
    b64, mem = client.fake.alloc(x.nbytes)
    mem[:] = x.tobytes()
    assert register(client, "nan", b64, x.nbytes).status_code == 200
    assert_400(infer(client, [shm_input("nan", x.nbytes)], [{"name": "OUTPUT"}]), "NaN or Inf")


def test_a_name_is_one_region_of_either_kind(client):
    b64, _ = client.fake.alloc(64)
    assert register(client, "shared", b64, 64).status_code == 200
    r = client.post("/v2/systemsharedmemory/region/shared/register", headers=AUTH,
                    json={"key": "/does-not-matter", "byte_size": 64})
    assert_400(r, "'shared' is already registered")


def test_register_and_unregister_need_the_api_key(client):
    b64, _ = client.fake.alloc(64)
    body = {"raw_handle": {"b64": b64}, "device_id": 0, "byte_size": 64}
    assert client.post("/v2/cudasharedmemory/region/k/register", json=body).status_code == 401
    assert client.post("/v2/cudasharedmemory/region/k/register", json=body,
                       headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert client.get("/v2/cudasharedmemory/status").json() == []
    assert register(client, "k", b64, 64).status_code == 200
    assert client.post("/v2/cudasharedmemory/region/k/unregister").status_code == 401
    assert client.post("/v2/cudasharedmemory/unregister").status_code == 401
    assert client.get("/v2/cudasharedmemory/status").json() == [{"name": "k", "device_id": 0, "byte_size": 64}]


class FakeGroupSlot:
    """A region group slot's calls (mmad/backends/cuda/region_group.py) on NumPy words: the
    forwards ran when launched."""

    def __init__(self, device, size):
        self.device = device
        self.words = np.zeros(size, np.uint32)

    def launching(self):
        return contextlib.nullcontext()

    def start(self):
        self.words[:] = 0

    def upload(self, k, host):
        return np.array(host)  # a system region's rows "on the device": a copy

    def output(self, k, shape, dtype):
        return np.empty(shape, dtype)

    def pinned(self, side, k, shape, dtype):
        return np.empty(shape, dtype)

    def download(self, device, host):
        np.copyto(host, device, casting="same_kind")

    def finish(self, count):
        pass

    def wait(self):
        return self.words


def test_region_forwards_run_in_the_primary_for_its_workers(client, app_client, tmp_path):
    """With --workers, a worker sends a request whose tensors all lie in shared-memory regions
    of one kind to the primary (mmad/engine/region_forwards.py): the forward there matches the
    oracle for CUDA and system regions, many at once run in groups, and every refusal comes
    back as the primary's own, in the user's terms."""
    app, _ = app_client
    rt = app.state.runtime
    rows = 33
    regions = {}
    for name, nbytes in [("rf-in", rows * IN_COLS * 4), ("rf-nan", rows * IN_COLS * 4),
                         *[(f"rf-out{k}", rows * OUT_COLS * 4) for k in range(12)]]:
        b64, memory = client.fake.alloc(nbytes)
        assert register(client, name, b64, nbytes).status_code == 200
        regions[name] = memory
    system = {}
    for name, nbytes in [("rf-sys-in", rows * IN_COLS * 4), *[(f"rf-sys-out{k}", rows * OUT_COLS * 4) for k in range(3)]]:
        system[name] = shared_memory.SharedMemory(f"mmad-{uuid.uuid4().hex[:10]}", create=True, size=nbytes)
        r = client.post(f"/v2/systemsharedmemory/region/{name}/register", headers=AUTH,
                        json={"key": "/" + system[name].name, "byte_size": nbytes})
        assert r.status_code == 200, r.text
    x = np.random.default_rng().uniform(-1, 1, (rows, IN_COLS)).astype(np.float32)
    np.frombuffer(regions["rf-in"], np.float32)[:] = x.ravel()
    np.ndarray((rows, IN_COLS), np.float32, system["rf-sys-in"].buf)[...] = x
    bad = x.copy()
    bad[-1, 0] = np.nan
    np.frombuffer(regions["rf-nan"], np.float32)[:] = bad.ravel()
    ref = oracle(client, "demo", x)

    def source(name, shape=(rows, IN_COLS)):
        return {"region": name, "offset": 0, "byte_size": rows * IN_COLS * 4, "datatype": "FP32", "shape": list(shape)}

    def target(k):
        return {"region": f"rf-out{k}", "offset": 0, "byte_size": rows * OUT_COLS * 4, "datatype": "FP32",
                "name": "OUTPUT"}

    def sys_target(k):
        return {**target(k), "region": f"rf-sys-out{k}"}

    path = str(tmp_path / "rf.sock")
    runner = RegionForwardRunner(rt, path, new_slot=FakeGroupSlot)

    async def scenario():
        remote = RegionForwardClient(path)
        try:
            await asyncio.gather(*(remote.forward("demo", source("rf-in"), [target(k)], True) for k in range(12)))
            outputs = [np.frombuffer(regions[f"rf-out{k}"], np.float32).reshape(rows, OUT_COLS) for k in range(12)]
            assert all(rel_err(out, ref) <= 1e-5 for out in outputs)
            failures = {}
            for label, call in [
                ("nan", remote.forward("demo", source("rf-nan"), [target(0)], True)),
                ("unregistered", remote.forward("demo", source("rf-gone"), [target(0)], True)),
                ("unknown model", remote.forward("nosuch", source("rf-in"), [target(0)], True)),
                ("shape", remote.forward("demo", source("rf-in", (rows, IN_COLS + 1)), [target(0)], True)),
            ]:
                with pytest.raises(MMADError) as info:
                    await call
                failures[label] = info.value
            await remote.forward("demo", source("rf-nan"), [target(1)], False)  # allowed: not checked
            assert np.isnan(np.frombuffer(regions["rf-out1"], np.float32)).any()
            # system regions: copied up, computed and copied back into the primary's mappings
            await asyncio.gather(*(remote.forward("demo", source("rf-sys-in"), [sys_target(k)], True)
                                   for k in range(3)))
            assert all(rel_err(np.ndarray((rows, OUT_COLS), np.float32, system[f"rf-sys-out{k}"].buf), ref) <= 1e-5
                       for k in range(3))
            with pytest.raises(InvalidInput, match="regions of one kind"):  # a system input, a CUDA output
                await remote.forward("demo", source("rf-sys-in"), [target(2)], True)
            pending = asyncio.ensure_future(asyncio.sleep(0))
            runner.stop()
            with pytest.raises(NotReady):  # the primary gone: a 503, never a hang
                await remote.forward("demo", source("rf-in"), [target(0)], True)
            with pytest.raises(NotReady):
                await RegionForwardClient(path).forward("demo", source("rf-in"), [target(0)], True)
            await pending
            return failures
        finally:
            runner.stop()

    try:
        failures = asyncio.run(scenario())
    finally:
        client.post("/v2/systemsharedmemory/unregister", headers=AUTH)
        for region in system.values():
            region.close()
            region.unlink()
    assert isinstance(failures["nan"], InvalidInput) and "holds NaN or Inf" in str(failures["nan"])
    assert isinstance(failures["unregistered"], InvalidInput) and "'rf-gone' is not registered" in str(
        failures["unregistered"])
    assert isinstance(failures["unknown model"], ModelNotFound) and "nosuch" in str(failures["unknown model"])
    assert isinstance(failures["shape"], InvalidInput) and "takes [-1, 2]" in str(failures["shape"])


def test_a_workers_small_batches_run_in_the_primary(client, app_client, tmp_path):
    """A serving worker's batch of body rows (its batcher awaits RegionForwardClient.forward_rows)
    runs in the primary's context: the rows go over the socket, the outputs come back in the
    datatype asked for and match the oracle, many at once (merged there into one forward); NaN
    or Inf comes back as NonFiniteInput (the worker's batcher finds which requests brought it),
    every other refusal as the primary's own; a primary gone is a 503."""
    app, _ = app_client
    path = str(tmp_path / "rows.sock")
    runner = RegionForwardRunner(app.state.runtime, path, new_slot=FakeGroupSlot)
    rng = np.random.default_rng()
    cases = [(rows, dtype) for rows, dtype in [(1, np.float32), (16, np.float16), (33, np.float32),
                                               (257, np.float32), (7, np.float16)] * 4]
    inputs = [rng.uniform(-1, 1, (rows, IN_COLS)).astype(np.float32) for rows, _ in cases]
    refs = [oracle(client, "demo", x) for x in inputs]
    bad = rng.uniform(-1, 1, (5, IN_COLS)).astype(np.float32)
    bad[2, 1] = np.inf

    async def scenario():
        remote = RegionForwardClient(path)
        try:
            outs = [np.empty((x.shape[0], OUT_COLS), dtype) for x, (_, dtype) in zip(inputs, cases)]
            await asyncio.gather(*(remote.forward_rows("demo", x, out, True) for x, out in zip(inputs, outs)))
            errors = [rel_err(out.astype(np.float32), ref) for out, ref in zip(outs, refs)]
            assert max(errors) <= 2e-3, errors  # (fp16 outputs round to 2^-11)
            with pytest.raises(NonFiniteInput):
                await remote.forward_rows("demo", bad, np.empty((5, OUT_COLS), np.float32), True)
            out = np.empty((5, OUT_COLS), np.float32)
            await remote.forward_rows("demo", bad, out, False)  # allowed: not checked, the other rows computed
            assert np.isfinite(out[[0, 1, 3, 4]]).all()
            with pytest.raises(ModelNotFound, match="nosuch"):
                await remote.forward_rows("nosuch", bad, out, True)
            with pytest.raises(InvalidInput, match=r"takes \[-1, 2\]"):
                await remote.forward_rows("demo", np.zeros((5, IN_COLS + 1), np.float32), out, True)
            runner.stop()
            with pytest.raises(NotReady):  # the primary gone: a 503, never a hang
                await remote.forward_rows("demo", bad, out, False)
            with pytest.raises(NotReady):
                await RegionForwardClient(path).forward_rows("demo", bad, out, False)
        finally:
            await remote.close()
            runner.stop()

    asyncio.run(scenario())
    assert RegionForwardClient.takes_rows(np.zeros(ROWS_INLINE_BYTES // 4, np.float32))
    assert not RegionForwardClient.takes_rows(np.zeros(ROWS_INLINE_BYTES // 4 + 1, np.float32))


def test_workers_pass_on_requests_all_in_regions_of_one_kind():
    """What a worker sends to the primary's region forwards: every tensor in CUDA regions, or
    every tensor in system regions (the primary's one context per GPU copies them, whatever the
    model's replicas); never a request with an output in the body or regions of both kinds."""
    cuda, system = types.SimpleNamespace(on_device=True), types.SimpleNamespace(on_device=False)
    takes = RegionForwardClient.takes
    assert takes([cuda], [cuda], ["OUTPUT"])
    assert takes([system], [system], ["OUTPUT"])
    assert takes([system], [system, system], ["OUTPUT", "OUTPUT"])
    assert not takes([system], [cuda], ["OUTPUT"])
    assert not takes([cuda], [system], ["OUTPUT"])
    assert not takes([cuda], [], ["OUTPUT"])  # the output goes in the body
    assert not takes([cuda], [cuda], ["OUTPUT", "OUTPUT"])
    assert not takes([], [cuda], ["OUTPUT"])
