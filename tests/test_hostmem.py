"""Page-locked body buffers (mmad/engine/hostmem.py) without a GPU: a counting allocator stands in
for cudaHostAlloc, so the pool's reuse, budget and lifetime rules are checked on any machine,
and a daemon given it serves binary requests from pooled bodies with the oracle's outputs."""

from __future__ import annotations

import gc

import numpy as np
from fastapi.testclient import TestClient

from mmad.backends.cpu import CpuBackend, CpuModel
from mmad.engine import hostmem
from mmad.server import Settings, create_app
from mmad.spec import MLPSpec


class CountingAllocator:
    def __init__(self, fail: bool = False):
        self.calls: list[int] = []
        self.fail = fail

    def __call__(self, nbytes: int) -> np.ndarray:
        if self.fail:
            raise MemoryError("no page-locked memory left")
        self.calls.append(nbytes)
        return np.empty(nbytes, dtype=np.uint8)


def test_size_classes_waste_at_most_an_eighth():
    for n in (1 << 16, 70_000, 8 * 2**20 + 448, 123_456_789):
        c = hostmem.PinnedPool.size_class(n)
        assert n <= c <= n * 1.125 + 1
    assert hostmem.PinnedPool.size_class(8 * 2**20 + 448) == hostmem.PinnedPool.size_class(8 * 2**20 + 512)


def test_a_buffer_returns_to_the_pool_only_when_no_view_of_it_is_left():
    alloc = CountingAllocator()
    pool = hostmem.PinnedPool(alloc, budget_bytes=64 << 20)
    body = pool.empty(5_000_000)
    tensor = np.frombuffer(memoryview(body[64:]), dtype=np.float16)  # as the request parser views it
    del body
    gc.collect()
    again = pool.empty(5_000_000)  # the first is still viewed: a second allocation
    assert len(alloc.calls) == 2
    tensor[:] = 1.5
    assert not np.shares_memory(again, tensor)
    del tensor, again
    gc.collect()
    third = pool.empty(4_900_000)  # same size class: reused, nothing allocated
    assert len(alloc.calls) == 2 and third.nbytes == 4_900_000
    assert pool.held_bytes == 2 * hostmem.PinnedPool.size_class(5_000_000)


def test_small_bodies_and_bodies_over_the_budget_use_ordinary_memory():
    alloc = CountingAllocator()
    pool = hostmem.PinnedPool(alloc, budget_bytes=3 << 20)
    small = pool.empty(1000)
    held = [pool.empty(1 << 20), pool.empty(1 << 20)]
    over = pool.empty(2 << 20)  # would pass the 3 MiB budget
    assert len(alloc.calls) == 2 and pool.over_budget == 1
    assert small.nbytes == 1000 and over.nbytes == 2 << 20 and len(held) == 2


def test_an_allocation_failure_turns_the_pool_off_without_failing_the_body(caplog):
    pool = hostmem.PinnedPool(CountingAllocator(fail=True), budget_bytes=1 << 30)
    body = pool.empty(1 << 20)
    assert body.nbytes == 1 << 20 and pool.held_bytes == 0
    assert "page-locked body buffers are off" in caplog.text
    assert pool.empty(1 << 20).nbytes == 1 << 20  # plain memory from now on, no retry per body


def test_the_daemon_serves_binary_requests_from_pooled_bodies(tmp_path, monkeypatch):
    alloc = CountingAllocator()
    monkeypatch.setattr(CpuBackend, "page_locked_allocator", lambda self: alloc)
    spec = {"n_input_dims": 64, "n_output_dims": 64, "network": {"n_neurons": 64, "n_hidden_layers": 2},
            "precision": "fp16", "seed": 11}
    app = create_app(Settings(store_dir=tmp_path / "store", backend="cpu", probe="cpu", demo=False))
    rng = np.random.default_rng()
    with TestClient(app) as client:
        assert client.put("/v2/models/m", json={"spec": spec}).status_code == 201
        oracle = CpuModel(MLPSpec.from_json(spec), "float64")
        for _ in range(6):
            x = rng.uniform(-1, 1, (4096, 64)).astype(np.float16)
            header = (b'{"inputs":[{"name":"INPUT","datatype":"FP16","shape":[4096,64],'
                      b'"parameters":{"binary_data_size":524288}}],'
                      b'"outputs":[{"name":"OUTPUT","parameters":{"binary_data":true}}],'
                      b'"parameters":{"output_datatype":"FP16"}}')
            r = client.post("/v2/models/m/infer", content=header + x.tobytes(),
                            headers={"Inference-Header-Content-Length": str(len(header))})
            assert r.status_code == 200, r.text
            length = int(r.headers["inference-header-content-length"])
            out = np.frombuffer(r.content[length:], dtype=np.float16).reshape(4096, 64)
            ref = oracle.forward(x.astype(np.float32))
            assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-3
        gc.collect()
        # request and response bodies came from the pool, and were reused across requests
        assert 1 <= len(alloc.calls) <= 4, alloc.calls
    assert hostmem._pool is None  # the daemon removed its pool at exit
