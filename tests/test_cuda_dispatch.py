"""The real dispatcher on a CUDA GPU (skipped, with the reason, without CuPy or a usable mma variant):
for S/M/L/W it measures the usable variants, returns one whose forward matches the float64 oracle,
and a second compile takes the decision from the cache without measuring."""

from __future__ import annotations

import numpy as np
from oracle import rel_err
import pytest
from test_cuda import _cuda_backend

from mmad.backends.cache import KernelCache
from mmad.backends.cpu import CpuBackend
from mmad.spec import bench_spec

pytestmark = pytest.mark.gpu

FWD_TOL = 3e-3


@pytest.fixture(scope="module")
def backend():
    return _cuda_backend()  # skips, with the reason, without CuPy or a usable mma variant


@pytest.mark.parametrize("name", ["S", "M", "L", "W"])
def test_dispatcher_chooses_a_correct_variant(backend, name, tmp_path, monkeypatch):
    monkeypatch.delenv("MMAD_DISPATCH", raising=False)
    cache = KernelCache(tmp_path)  # a fresh cache: this run measures
    spec = bench_spec(name)
    model = backend.compile(spec, cache=cache)
    # the wgmma variants where their kernels fit the model (W: no wgmma training, its weights stream)
    usable = [r.variant for r in backend.probe()
              if r.available and (not r.variant.startswith("wgmma") or backend._wgmma_fits(spec, r.variant))]
    decision = model.dispatch.to_json() if len(usable) > 1 else None
    if decision is not None:
        assert decision["variant"] == model.variant and not decision["from_cache"]
        assert [v["variant"] for v in decision["variants"]] == usable
        chosen = next(v for v in decision["variants"] if v["status"] == "chosen")
        assert chosen["forward_msps"] > 0 and chosen["train_msps"] > 0
        print(f"{name}: {model.variant}", [(v["variant"], v.get("forward_msps"), v.get("train_msps"),
                                            v.get("reason")) for v in decision["variants"]])
    rng = np.random.default_rng(17)
    x = rng.standard_normal((65_537, spec.n_input_dims), dtype=np.float32)
    with CpuBackend("float64").compile(spec) as oracle:
        oracle.set_params(model.get_params())
        assert rel_err(model.forward(x), oracle.forward(x)) <= FWD_TOL
    model.close()
    if decision is not None:
        again = backend.compile(spec, cache=cache)
        assert again.variant == model.variant and again.dispatch.from_cache
        again.close()
