"""Triton's system shared-memory extension, driven by Triton's own client (``tritonclient.http`` and
``tritonclient.utils.shared_memory``, unchanged) against a real daemon on loopback."""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import orjson
import pytest

th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed (pip install -e .[dev])")
shm = pytest.importorskip("tritonclient.utils.shared_memory", reason="tritonclient's shared_memory is not installed")
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import DaemonProcess  # noqa: E402
from test_server_api import binary_infer, decode_binary, oracle, rel_err  # noqa: E402

ROWS, IN_COLS, OUT_COLS = 257, 2, 3  # the demo model: [rows, 2] -> [rows, 3]


@pytest.fixture
def triton(daemon):
    client = th.InferenceServerClient(daemon.url.removeprefix("http://"))
    client.unregister_system_shared_memory()
    yield client
    client.unregister_system_shared_memory()
    client.close()


@pytest.fixture
def region():
    """A fresh POSIX shared-memory object (name, key, handle), destroyed afterwards."""
    made = []

    def make(byte_size: int):
        name = f"mmad-{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(name, "/" + name, byte_size)
        made.append(handle)
        return name, "/" + name, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def _status_400(call, *words):
    with pytest.raises(InferenceServerException) as info:
        call()
    assert info.value.status() == "400", info.value
    for word in words:
        assert word in info.value.message(), info.value.message()
    return info.value.message()


@pytest.mark.parametrize("datatype, out_datatype, tol",
                         [("FP32", "FP32", 1e-5), ("FP16", "FP32", 3e-3), ("FP16", "FP16", 3e-3)])
def test_inputs_and_outputs_in_shared_memory(triton, http, region, datatype, out_datatype, tol):
    dtype = np.float16 if datatype == "FP16" else np.float32
    x = np.random.default_rng().uniform(-1, 1, (ROWS, IN_COLS)).astype(dtype)  # fresh every run
    out_dtype = np.float16 if out_datatype == "FP16" else np.float32
    in_bytes, out_bytes = x.nbytes, ROWS * OUT_COLS * np.dtype(out_dtype).itemsize
    in_name, in_key, in_handle = region(in_bytes)
    out_name, out_key, out_handle = region(out_bytes + 64 + 32)
    shm.set_shared_memory_region(in_handle, [x])
    triton.register_system_shared_memory(in_name, in_key, in_bytes)
    # the region starts 64 bytes into its object, and is larger than the output (allowed)
    triton.register_system_shared_memory(out_name, out_key, out_bytes + 32, offset=64)

    infer_input = th.InferInput("INPUT", list(x.shape), datatype)
    infer_input.set_shared_memory(in_name, in_bytes)
    requested = th.InferRequestedOutput("OUTPUT")
    requested.set_shared_memory(out_name, out_bytes + 32)
    requested._parameters["output_datatype"] = out_datatype  # mmad's extension: FP16 outputs
    result = triton.infer("demo", [infer_input], outputs=[requested])
    entry = result.get_output("OUTPUT")
    assert entry["shape"] == [ROWS, OUT_COLS] and entry["datatype"] == out_datatype and "data" not in entry
    assert entry["parameters"]["shared_memory_region"] == out_name
    out = shm.get_contents_as_numpy(out_handle, out_dtype, [ROWS, OUT_COLS], offset=64)

    want = oracle(http, "demo", x.astype(np.float32))
    assert rel_err(out.astype(np.float32), want) <= tol
    _, via_body = decode_binary(binary_infer(http, "demo", x, datatype=datatype, out_datatype=out_datatype))
    np.testing.assert_array_equal(out, via_body)  # the same forward as the binary extension


def test_input_in_shared_memory_output_in_body(triton, http, region):
    x = np.random.default_rng().uniform(-1, 1, (ROWS, IN_COLS)).astype(np.float32)
    name, key, handle = region(x.nbytes + 128)
    shm.set_shared_memory_region(handle, [x], offset=128)
    triton.register_system_shared_memory(name, key, x.nbytes + 128)
    infer_input = th.InferInput("INPUT", list(x.shape), "FP32").set_shared_memory(name, x.nbytes, offset=128)
    for binary in (True, False):
        out = triton.infer("demo", [infer_input],
                           outputs=[th.InferRequestedOutput("OUTPUT", binary_data=binary)]).as_numpy("OUTPUT")
        assert out.shape == (ROWS, OUT_COLS) and rel_err(out, oracle(http, "demo", x)) <= 1e-5


def test_output_in_shared_memory_input_in_body(triton, http, region):
    x = np.random.default_rng().uniform(-1, 1, (9, IN_COLS)).astype(np.float32)
    name, key, handle = region(9 * OUT_COLS * 4)
    triton.register_system_shared_memory(name, key, 9 * OUT_COLS * 4)
    infer_input = th.InferInput("INPUT", list(x.shape), "FP32")
    infer_input.set_data_from_numpy(x, binary_data=False)
    requested = th.InferRequestedOutput("OUTPUT")
    requested.set_shared_memory(name, 9 * OUT_COLS * 4)
    triton.infer("demo", [infer_input], outputs=[requested], model_version="1")  # the pinned path too
    out = shm.get_contents_as_numpy(handle, np.float32, [9, OUT_COLS])
    assert rel_err(out, oracle(http, "demo", x, version="1")) <= 1e-5


def test_status_and_unregister(triton, daemon, region):
    a, a_key, _ = region(1024)
    b, b_key, _ = region(4096)
    triton.register_system_shared_memory(a, a_key, 1000, offset=24)
    triton.register_system_shared_memory(b, b_key, 4096)
    status = {r["name"]: r for r in triton.get_system_shared_memory_status()}
    assert status[a] == {"name": a, "key": a_key, "offset": 24, "byte_size": 1000}
    assert status[b] == {"name": b, "key": b_key, "offset": 0, "byte_size": 4096}
    assert triton.get_system_shared_memory_status(a) == [status[a]]
    assert "system_shared_memory" in triton.get_server_metadata()["extensions"]

    triton.unregister_system_shared_memory(a)
    assert [r["name"] for r in triton.get_system_shared_memory_status()] == [b]
    _status_400(lambda: triton.get_system_shared_memory_status(a), a)
    triton.unregister_system_shared_memory(a)  # unknown: no error, as Triton
    triton.register_system_shared_memory(a, a_key, 1024)  # the name is free again
    triton.unregister_system_shared_memory()
    assert triton.get_system_shared_memory_status() == []


def test_bad_references_are_400_and_the_daemon_keeps_serving(triton, http, region):
    x = np.ones((4, IN_COLS), np.float32)
    name, key, handle = region(256)
    shm.set_shared_memory_region(handle, [x])
    triton.register_system_shared_memory(name, key, 256)

    def infer(in_region=name, in_size=x.nbytes, in_offset=0, shape=(4, IN_COLS), out=None):
        inp = th.InferInput("INPUT", list(shape), "FP32").set_shared_memory(in_region, in_size, in_offset)
        return lambda: triton.infer("demo", [inp], outputs=out)

    def out_ref(size, offset=0, region_name=name):
        requested = th.InferRequestedOutput("OUTPUT")
        requested.set_shared_memory(region_name, size, offset)  # returns None, unlike InferInput's
        return [requested]

    checks = [
        (infer(in_region="nosuch"), ("'nosuch'", "not registered")),
        (infer(in_offset=250), ("past the end",)),
        (infer(in_size=300), ("past the end",)),
        (infer(in_size=16), ("shared_memory_byte_size is 16", "32")),
        (infer(shape=(3, IN_COLS), in_size=32), ("shared_memory_byte_size is 32", "24")),
        (infer(out=out_ref(40, offset=32)), ("OUTPUT", "needs at least 48")),
        (infer(out=out_ref(48, offset=240)), ("OUTPUT", "past the end")),
        (infer(out=out_ref(48, region_name="nosuch")), ("OUTPUT", "not registered")),
        (infer(out=out_ref(48, offset=16)), ("OUTPUT", "written over input 'INPUT'", "bytes 16 to 31")),
        (infer(out=out_ref(48, offset=0)), ("OUTPUT", "written over input 'INPUT'")),
        (lambda: triton.register_system_shared_memory(name, key, 256), ("already registered",)),
        (lambda: triton.register_system_shared_memory("other", "/mmad-nosuch-" + uuid.uuid4().hex, 8),
         ("unable to open",)),
        (lambda: triton.register_system_shared_memory("other", key, 257), ("past the end",)),
        (lambda: triton.register_system_shared_memory("other", key, 8, offset=256), ("past the end",)),
        (lambda: triton.register_system_shared_memory("other", key, 0), ("byte_size",)),
        (lambda: triton.register_system_shared_memory("other", "/../etc/passwd", 8), ("POSIX",)),
        (lambda: triton.register_system_shared_memory("other", "relative", 8), ("POSIX",)),
    ]
    for call, words in checks:
        _status_400(call, *words)
        assert triton.is_server_ready()
    # both a region and binary data for one input: refused, in the request's terms
    blob = x.tobytes()
    header = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [4, IN_COLS], "parameters": {
        "binary_data_size": len(blob), "shared_memory_region": name, "shared_memory_byte_size": len(blob)}}]}
    hbytes = orjson.dumps(header)
    r = http.post("/v2/models/demo/infer", content=hbytes + blob,
                  headers={"Inference-Header-Content-Length": str(len(hbytes))})
    assert r.status_code == 400 and "binary_data_size" in r.json()["error"]
    for bad in ({"shared_memory_region": 5, "shared_memory_byte_size": 32},
                {"shared_memory_region": name, "shared_memory_byte_size": "32"},
                {"shared_memory_region": name, "shared_memory_byte_size": 32, "shared_memory_offset": -1}):
        r = http.post("/v2/models/demo/infer", json={"inputs": [
            {"name": "INPUT", "datatype": "FP32", "shape": [4, IN_COLS], "parameters": bad}]})
        assert r.status_code == 400 and "shared_memory" in r.json()["error"], r.text
    ok = triton.infer("demo", [th.InferInput("INPUT", [4, IN_COLS], "FP32").set_shared_memory(name, x.nbytes)])
    assert rel_err(ok.as_numpy("OUTPUT"), oracle(http, "demo", x)) <= 1e-5


def test_unregister_while_requests_use_the_region(triton, daemon, region):
    """Requests racing unregister/register of their region: each answers 200 or 400, never a crash."""
    rows = 4096
    x = np.random.default_rng().uniform(-1, 1, (rows, IN_COLS)).astype(np.float32)
    out_bytes = rows * OUT_COLS * 4
    name, key, handle = region(x.nbytes + out_bytes)
    shm.set_shared_memory_region(handle, [x])
    triton.register_system_shared_memory(name, key, x.nbytes + out_bytes)
    stop = threading.Event()
    codes = []

    def client():
        with th.InferenceServerClient(daemon.url.removeprefix("http://")) as c:
            inp = th.InferInput("INPUT", [rows, IN_COLS], "FP32").set_shared_memory(name, x.nbytes)
            out = th.InferRequestedOutput("OUTPUT")
            out.set_shared_memory(name, out_bytes, offset=x.nbytes)
            while not stop.is_set():
                try:
                    c.infer("demo", [inp], outputs=[out])
                    codes.append("200")
                except InferenceServerException as exc:
                    codes.append(exc.status())

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(40):
            triton.unregister_system_shared_memory(name)
            triton.register_system_shared_memory(name, key, x.nbytes + out_bytes)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert codes and set(codes) <= {"200", "400"}, set(codes)
    assert daemon.proc.poll() is None and triton.is_server_ready()


def test_shrunk_object_is_refused_not_a_crash(triton, daemon, region):
    name, key, handle = region(4096)
    triton.register_system_shared_memory(name, key, 4096)
    os.truncate("/dev/shm" + key, 16)  # touching the mapping past here would be SIGBUS
    inp = th.InferInput("INPUT", [4, IN_COLS], "FP32").set_shared_memory(name, 32, offset=1024)
    _status_400(lambda: triton.infer("demo", [inp]), "shrank")
    assert daemon.proc.poll() is None and triton.is_server_ready()


def test_register_and_unregister_need_the_api_key(tmp_path, region):
    key_file = tmp_path / "key"
    api_key = "shm-test-" + uuid.uuid4().hex
    key_file.write_text(api_key)
    daemon = DaemonProcess(tmp_path / "store", "--api-key-file", str(key_file)).start()
    try:
        name, key, _ = region(64)
        url = daemon.url.removeprefix("http://")
        with th.InferenceServerClient(url) as anonymous:
            with pytest.raises(InferenceServerException) as info:
                anonymous.register_system_shared_memory(name, key, 64)
            assert info.value.status() == "401"
            with pytest.raises(InferenceServerException) as info:
                anonymous.unregister_system_shared_memory()
            assert info.value.status() == "401"
            assert anonymous.get_system_shared_memory_status() == []  # read-only: no key needed
            auth = {"Authorization": f"Bearer {api_key}"}
            anonymous.register_system_shared_memory(name, key, 64, headers=auth)
            assert [r["name"] for r in anonymous.get_system_shared_memory_status()] == [name]
            anonymous.unregister_system_shared_memory(name, headers=auth)
            assert anonymous.get_system_shared_memory_status() == []
    finally:
        daemon.stop()


def test_train_refuses_tensors_in_shared_memory(triton, http, region):
    """Shared memory carries infer requests: a /train input naming a region is refused by name
    (it was read as the daemon's unfilled buffer), and training from the body still works."""
    rng = np.random.default_rng()
    x = rng.uniform(-1, 1, (8, IN_COLS)).astype(np.float32)
    y = rng.uniform(0, 1, (8, OUT_COLS)).astype(np.float32)
    name, key, handle = region(x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    triton.register_system_shared_memory(name, key, x.nbytes)
    target = {"name": "TARGET", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}
    r = http.post("/v2/models/demo/train", json={"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": list(x.shape),
         "parameters": {"shared_memory_region": name, "shared_memory_byte_size": x.nbytes}}, target]})
    assert r.status_code == 400 and "'INPUT'" in r.json()["error"] and "shared-memory region" in r.json()["error"], r.text
    r = http.post("/v2/models/demo/train", json={"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}, target]})
    assert r.status_code == 200 and len(r.json()["losses"]) == 1 and np.isfinite(r.json()["losses"][0]), r.text
