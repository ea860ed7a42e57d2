"""The real dispatcher on a CUDA GPU (skipped, with the reason, without CuPy or a usable mma variant):
for S/M/L/W a cold compile serves at once on a quick variant while the usable variants are
measured in the background; the one chosen matches the float64 oracle, and a second compile
takes the decision from the cache without measuring. The variants that share an NVRTC module
compile it once; an encoded model (a OneBlob config of 512 encoded columns)
is measured, its encoding on the device, within bounds."""

from __future__ import annotations

import collections

import numpy as np
from oracle import rel_err
import pytest
from test_cuda import _cuda_backend

from mmad.backends import dispatch as D
from mmad.backends.cache import KernelCache
from mmad.backends.cpu import CpuBackend
from mmad.backends.cuda import QUICK_VARIANTS
from mmad.spec import MLPSpec, bench_spec

pytestmark = pytest.mark.gpu

FWD_TOL = 3e-3
ONEBLOB = {"n_input_dims": 32, "n_output_dims": 4, "encoding": {"otype": "OneBlob", "n_bins": 16},
           "network": {"otype": "FullyFusedMLP", "activation": "Tanh", "output_activation": "Sigmoid",
                       "n_neurons": 256, "n_hidden_layers": 2}, "loss": {"otype": "L2"},
           "optimizer": {"otype": "Adam", "learning_rate": 1e-3}, "precision": "fp16", "seed": 7}


@pytest.fixture(scope="module")
def backend():
    return _cuda_backend()  # skips, with the reason, without CuPy or a usable mma variant


def _usable(backend, spec):
    # the wgmma variants where their kernels fit the model (W: no wgmma training, its weights stream)
    return [r.variant for r in backend.probe()
            if r.available and (not r.variant.startswith("wgmma") or backend._wgmma_fits(spec, r.variant))]


@pytest.mark.parametrize("name", ["S", "M", "L", "W"])
def test_dispatcher_serves_at_once_and_chooses_a_correct_variant(backend, name, tmp_path, monkeypatch):
    monkeypatch.delenv("MMAD_DISPATCH", raising=False)
    cache = KernelCache(tmp_path)  # a fresh cache: this run measures
    spec = bench_spec(name)
    quick = backend.compile(spec, cache=cache)
    usable = _usable(backend, spec)
    if len(usable) == 1:
        assert quick.dispatch is None
        model = quick
    else:
        assert isinstance(quick.dispatch, D.Background), quick.dispatch
        assert quick.variant == next(v for v, _ in QUICK_VARIANTS if v in usable)
        model = D.settled(quick, timeout=240)
        decision = model.dispatch.to_json()
        assert decision["variant"] == model.variant and not decision["from_cache"]
        assert [v["variant"] for v in decision["variants"]] == usable
        chosen = next(v for v in decision["variants"] if v["status"] == "chosen")
        assert chosen["forward_msps"] > 0 and chosen["train_msps"] > 0
        print(f"{name}: served {quick.variant}, chose {model.variant} in {decision['measure_s']:.1f} s "
              f"({decision['compile_s']:.1f} s compiling)",
              [(v["variant"], v.get("forward_msps"), v.get("train_msps"), v.get("reason")) for v in decision["variants"]])
    rng = np.random.default_rng(17)
    x = rng.standard_normal((65_537, spec.n_input_dims), dtype=np.float32)
    with CpuBackend("float64").compile(spec) as oracle:
        oracle.set_params(model.get_params())
        assert rel_err(model.forward(x), oracle.forward(x)) <= FWD_TOL
    model.close()
    if len(usable) > 1:
        again = backend.compile(spec, cache=cache)
        assert again.variant == model.variant and again.dispatch.from_cache
        again.close()


def test_variants_sharing_a_module_compile_it_once(backend, tmp_path, monkeypatch):
    """mma, wgmma+mma and wgmma build the same mma module (wgmma leaves its fused training kernels
    unused), the split variants share theirs with mma-f16acc and cublaslt: one NVRTC run per
    distinct source over the whole measurement."""
    from mmad.backends.cuda import cublaslt, mma

    sources = collections.Counter()
    real = mma.nvrtc_compile

    def counted(source, *args, **kwargs):
        sources[source] += 1
        return real(source, *args, **kwargs)

    monkeypatch.setattr(mma, "nvrtc_compile", counted)
    monkeypatch.setattr(cublaslt, "nvrtc_compile", counted)
    monkeypatch.delenv("MMAD_DISPATCH", raising=False)
    spec = bench_spec("M")
    model = D.settled(backend.compile(spec, cache=KernelCache(tmp_path)), timeout=240)
    model.close()
    assert sources and max(sources.values()) == 1, sources.values()
    mma_modules = [s for s in sources if "#define FWD_ACC16" in s]
    usable = _usable(backend, spec)
    assert len(mma_modules) == len({"mma", "mma-f16acc"} & set(usable))  # mma's serves wgmma and wgmma+mma too


def test_the_oneblob_model_is_measured_with_its_encoding_on_the_device(backend, tmp_path, monkeypatch):
    """The OneBlob config (32 inputs, 512 encoded columns, 256-wide Tanh) at 2^20 rows: the
    measurement times the model as served, its encoding on the device, and ends."""
    monkeypatch.delenv("MMAD_DISPATCH", raising=False)
    spec = MLPSpec.from_json(ONEBLOB)
    quick = backend.compile(spec, cache=KernelCache(tmp_path), batch_rows=1 << 20)
    model = D.settled(quick, timeout=240)
    decision = model.dispatch
    if decision is not None:
        print(f"OneBlob: served {quick.variant}, chose {model.variant} in {decision.measure_s:.1f} s "
              f"({decision.compile_s:.1f} s compiling)")
        assert decision.rows == 1 << 20 and decision.measure_s > 0
    x = np.random.default_rng(3).uniform(0, 1, (4096, 32)).astype(np.float32)
    with CpuBackend("float64").compile(spec) as oracle:
        oracle.set_params(model.get_params())
        assert rel_err(model.forward(x), oracle.forward(x)) <= FWD_TOL
    model.close()
