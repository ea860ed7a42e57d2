"""Dispatch by measurement (mmad.backends.dispatch) with fake variants whose speed the test sets
(tests/fake_variants.py), measured before returning and in the background.

Variants that fail to compile, fail at run time or compute wrong numbers are skipped with their
reasons. The cuda backend's wiring (candidates, quick variants, the
MMAD_DISPATCH knob) runs here with CuPy stubbed; the override and the reports go through a real
daemon on the cpu backend (the swap in the daemon: tests/test_background_dispatch.py).
"""

from __future__ import annotations

import json
import threading
import time
import types
from contextlib import nullcontext

import numpy as np
import pytest
from fake_variants import ROWS, FakeBackend

from mmad.backends import dispatch as D
from mmad.backends.cache import KernelCache
from mmad.backends.cpu import CpuModel
from mmad.errors import SpecError
from mmad.spec import MLPSpec

SPEC_DOC = {"n_input_dims": 8, "n_output_dims": 4, "network": {"n_neurons": 16, "n_hidden_layers": 2},
            "precision": "fp16", "seed": 3}
SPEC = MLPSpec.from_json(SPEC_DOC)


def fast_and_slow():
    # scores: a 1/0.5 + 10/5 = 4.0; b 0.5/0.5 + 12/5 = 3.4; c 2/0.5 + 5/5 = 5.0 -> b
    return FakeBackend({"a": (1.0, 10.0, "ok"), "b": (0.5, 12.0, "ok"), "c": (2.0, 5.0, "ok")})


def test_the_lowest_score_wins_and_every_variant_is_reported(tmp_path):
    fake = fast_and_slow()
    model = fake.compile(SPEC, KernelCache(tmp_path))
    assert model.variant == "b" and not model.dispatch.from_cache
    doc = model.dispatch.to_json()
    assert doc["variant"] == "b" and doc["backend"] == "fake" and doc["device"] == "Fake GPU sm_90"
    assert doc["rows"] == ROWS and doc["io"] == "fp16" and "lowest wins" in doc["score_rule"]
    by = {v["variant"]: v for v in doc["variants"]}
    assert [by[v]["status"] for v in "abc"] == ["measured", "chosen", "measured"]
    assert by["a"]["score"] == pytest.approx(4.0) and by["b"]["score"] == pytest.approx(3.4)
    assert by["c"]["score"] == pytest.approx(5.0)
    assert by["b"]["forward_s"] == pytest.approx(0.5) and by["b"]["train_s"] == pytest.approx(12.0)
    assert by["b"]["forward_msps"] == pytest.approx(ROWS / 0.5 / 1e6)
    assert all(v["rel_err_vs_float64"] < D.TOLERANCE["fp16"] for v in doc["variants"])
    # each measured once, then the winner compiled afresh: its weights are the seed's, untrained
    assert fake.compiles == {"a": 1, "b": 2, "c": 1} and model.step_count == 0
    assert all(np.array_equal(v, CpuModel(SPEC).get_params()[k]) for k, v in model.get_params().items())


def test_a_tie_goes_to_the_earlier_variant(tmp_path):
    fake = FakeBackend({"first": (1.0, 1.0, "ok"), "second": (1.0, 1.0, "ok")})
    assert fake.compile(SPEC, KernelCache(tmp_path)).variant == "first"


def test_failing_and_wrong_variants_are_skipped_with_their_reasons(tmp_path):
    fake = FakeBackend({"broken": (0.1, 0.1, "compile fails"), "crashes": (0.1, 0.1, "run fails"),
                        "wrong": (0.1, 0.1, "wrong"), "slow": (3.0, 30.0, "ok")})
    model = fake.compile(SPEC, KernelCache(tmp_path))
    assert model.variant == "slow"
    reasons = {v["variant"]: v.get("reason") for v in model.dispatch.to_json()["variants"]}
    assert reasons["broken"] == "failed to compile: the broken kernels: ptxas error: too many resources requested"
    assert reasons["crashes"] == "failed to run: RuntimeError: an illegal memory access was encountered"
    assert reasons["wrong"].startswith("wrong result: the forward differs from the float64 oracle by ")
    assert reasons["slow"] is None


def test_a_non_finite_training_loss_is_a_wrong_result(tmp_path, monkeypatch):
    fake = FakeBackend({"diverges": (0.1, 0.1, "ok"), "fine": (1.0, 1.0, "ok")})
    build = fake.build

    def build_nan(name, spec):
        model = build(name, spec)
        if name == "diverges":
            model.train_step = lambda x, y, steps=1: np.array([np.nan], np.float32)
        return model

    monkeypatch.setattr(fake, "build", build_nan)
    model = fake.compile(SPEC, KernelCache(tmp_path))
    assert model.variant == "fine"
    assert model.dispatch.to_json()["variants"][0]["reason"] == "wrong result: a training step's loss is nan"


def test_no_usable_variant_is_an_error_naming_each_reason(tmp_path):
    fake = FakeBackend({"broken": (0.1, 0.1, "compile fails"), "wrong": (0.1, 0.1, "wrong")})
    with pytest.raises(D.DispatchFailed, match=r"no variant of the fake backend runs this model correctly: "
                                               r"broken: failed to compile: .*; wrong: wrong result"):
        fake.compile(SPEC, KernelCache(tmp_path))
    with pytest.raises(D.DispatchFailed, match="no usable variant"):
        D.dispatch(SPEC, {}, backend="fake", device="x", cache=KernelCache(tmp_path))


def test_a_single_candidate_is_compiled_without_measuring(tmp_path):
    fake = FakeBackend({"only": (1.0, 1.0, "ok")})
    model = fake.compile(SPEC, KernelCache(tmp_path))
    assert model.variant == "only" and model.dispatch is None and fake.clock.timed == 0
    assert fake.compiles == {"only": 1}


def test_the_decision_is_cached_per_device_and_model_shape(tmp_path):
    first = fast_and_slow()
    first.compile(SPEC, KernelCache(tmp_path))
    timed = first.clock.timed
    assert timed == 6  # forward and training step of a, b and c

    again = fast_and_slow()  # a new process: a fresh backend and cache object on the same directory
    model = again.compile(SPEC, KernelCache(tmp_path))
    assert model.variant == "b" and model.dispatch.from_cache and again.clock.timed == 0
    assert again.compiles == {"b": 1}
    # the figures come back with the decision
    assert model.dispatch.to_json()["variants"] == first.compile(SPEC, KernelCache(tmp_path)).dispatch.to_json()[
        "variants"]

    reseeded = fast_and_slow()  # the seed changes no speed: the same decision
    reseeded.compile(SPEC.replace(seed=99), KernelCache(tmp_path))
    assert reseeded.clock.timed == 0

    for other in ({"spec": SPEC.replace(n_neurons=32)}, {"device": "Other GPU sm_80"},
                  {"key_extra": {"graphs": False}}):
        fake = fast_and_slow()
        fake.compile(other.pop("spec", SPEC), KernelCache(tmp_path), **other)
        assert fake.clock.timed == 6, other


def test_other_candidates_are_measured_again(tmp_path):
    fast_and_slow().compile(SPEC, KernelCache(tmp_path))
    fewer = FakeBackend({"a": (1.0, 10.0, "ok"), "c": (2.0, 5.0, "ok")})  # b no longer usable
    model = fewer.compile(SPEC, KernelCache(tmp_path))
    assert fewer.clock.timed == 4 and model.variant in ("a", "c") and not model.dispatch.from_cache


def _entries(directory):
    return sorted(directory.glob("*/*.bin"))


def test_a_corrupt_cache_entry_is_ignored_and_measured_again(tmp_path):
    fast_and_slow().compile(SPEC, KernelCache(tmp_path))
    [entry] = _entries(tmp_path)
    raw = bytearray(entry.read_bytes())
    raw[-5] ^= 0xFF  # a flipped byte in the payload: the checksum no longer matches
    entry.write_bytes(bytes(raw))
    cache, fake = KernelCache(tmp_path), fast_and_slow()
    assert fake.compile(SPEC, cache).variant == "b"
    assert fake.clock.timed == 6 and cache.stats.rebuilt_corrupt == 1
    assert fast_and_slow().compile(SPEC, KernelCache(tmp_path)).dispatch.from_cache  # rewritten intact


def test_an_intact_entry_that_is_not_a_decision_is_measured_again(tmp_path):
    fast_and_slow().compile(SPEC, KernelCache(tmp_path))
    [entry] = _entries(tmp_path)
    header = json.loads(entry.read_bytes().partition(b"\n")[0])
    cache = KernelCache(tmp_path)
    cache.store(header["key"], b'{"format": 1, "variant": "b"}')  # checksummed, but fields missing
    fake = fast_and_slow()
    assert fake.compile(SPEC, cache).variant == "b" and fake.clock.timed == 6
    assert fast_and_slow().compile(SPEC, KernelCache(tmp_path)).dispatch.from_cache


def test_the_measurement_uses_the_real_timer_by_default(tmp_path):
    """No timer passed: the benchmarks' median timer on the host clock (real seconds, positive)."""
    fake = FakeBackend({"a": (0.0, 0.0, "ok"), "b": (0.0, 0.0, "ok")})
    candidates = {name: (lambda s, name=name: fake.build(name, s)) for name in fake.variants}
    model = D.dispatch(SPEC, candidates, backend="fake", device="x", cache=KernelCache(tmp_path), rows=256)
    assert all(v["forward_s"] > 0 and v["train_s"] > 0 for v in model.dispatch.to_json()["variants"])


# -- in the background ------------------------------------------------------------------------------
VARIANT_SETS = {
    "fast-and-slow": {"a": (1.0, 10.0, "ok"), "b": (0.5, 12.0, "ok"), "c": (2.0, 5.0, "ok")},
    "a tie": {"first": (1.0, 1.0, "ok"), "second": (1.0, 1.0, "ok")},
    "failures": {"broken": (0.1, 0.1, "compile fails"), "crashes": (0.1, 0.1, "run fails"),
                 "wrong": (0.1, 0.1, "wrong"), "slow": (3.0, 30.0, "ok"), "slower": (4.0, 40.0, "ok")},
    "the split pair wins": {"mma": (1.4, 1.3, "ok"), "mma-f16acc": (1.0, 1.3, "ok"), "cublaslt": (1.9, 1.0, "ok"),
                            "mma-f16acc+cublaslt": (1.0, 1.0, "ok")},
}


def _quick_order(variants):
    """Quick variants in the order to try: the slowest correct one last, so the test sees a swap."""
    return [(name, "compiles at once") for name in reversed(variants)]


@pytest.mark.parametrize("case", VARIANT_SETS)
def test_the_background_measurement_ends_with_the_blocking_choice(tmp_path, case):
    """The same variants measured before returning and in the background: the same choice, the
    same figures and reasons; the background one served a quick variant meanwhile."""
    blocking = FakeBackend(VARIANT_SETS[case]).compile(SPEC, KernelCache(tmp_path / "blocking"))
    fake = FakeBackend(VARIANT_SETS[case])
    served = fake.compile(SPEC, KernelCache(tmp_path / "background"), quick=_quick_order(VARIANT_SETS[case]))
    assert isinstance(served.dispatch, D.Background)
    quick = served.variant
    model = D.settled(served, timeout=60)
    assert model.variant == blocking.variant
    keep = ("variant", "status", "forward_s", "train_s", "score", "reason")
    assert ([{k: v.get(k) for k in keep} for v in model.dispatch.to_json()["variants"]]
            == [{k: v.get(k) for k in keep} for v in blocking.dispatch.to_json()["variants"]])
    assert model.dispatch.to_json()["served_while_measuring"] == quick and model.dispatch.measure_s > 0
    # the measurement ran on the device's queue, its compiles on the compiler threads
    assert any(t.startswith("mmad-compile") for t in fake.threads) and fake.clock.timed > 0


def test_a_quick_variant_serves_at_once_and_answers_while_the_others_are_measured(tmp_path):
    gate = threading.Event()  # holds the measurement at its first call
    fake = FakeBackend(VARIANT_SETS["fast-and-slow"], gate=gate)
    model = fake.compile(SPEC, KernelCache(tmp_path), quick=[("c", "compiles at once")])
    try:
        doc = model.dispatch.to_json()
        assert model.variant == "c" and doc["state"] == "measuring in background"
        assert doc["reason"] == "serving c while the 2 other variants are measured: compiles at once"
        assert doc["candidates"] == ["a", "b", "c"]
        x = np.random.default_rng(1).standard_normal((64, SPEC.n_input_dims), dtype=np.float32)
        y = np.random.default_rng(2).standard_normal((64, SPEC.n_output_dims), dtype=np.float32)
        assert np.isfinite(model.forward(x)).all() and np.isfinite(model.train_step(x, y, 3)).all()
        assert not model.dispatch.done() and fake.clock.timed == 0
    finally:
        gate.set()
    settled = D.settled(model, timeout=60)
    assert settled.variant == "b" and settled.dispatch.to_json()["state"] == "decided"


def test_a_quick_variant_that_computes_wrong_numbers_is_passed_over(tmp_path):
    fake = FakeBackend({"wrong": (0.1, 0.1, "wrong"), "broken": (0.1, 0.1, "compile fails"), "ok": (1.0, 1.0, "ok")})
    model = fake.compile(SPEC, KernelCache(tmp_path), quick=[("wrong", "fast"), ("broken", "fast"), ("ok", "slow")])
    assert model.variant == "ok"
    reason = model.dispatch.reason
    assert reason.startswith("serving ok while the 2 other variants are measured: slow (not wrong: wrong result: "
                             "the forward differs from the float64 oracle by ")
    assert "broken: failed to compile: the broken kernels: ptxas error: too many resources requested" in reason
    assert D.settled(model, timeout=60).variant == "ok"


def test_the_chosen_variant_gets_the_trained_parameters_and_optimizer_state(tmp_path):
    gate = threading.Event()
    fake = FakeBackend(VARIANT_SETS["fast-and-slow"], gate=gate)
    model = fake.compile(SPEC, KernelCache(tmp_path), quick=[("c", "compiles at once")])
    rng = np.random.default_rng(5)
    x = rng.standard_normal((128, SPEC.n_input_dims), dtype=np.float32)
    y = rng.standard_normal((128, SPEC.n_output_dims), dtype=np.float32)
    model.train_step(x, y, 7)  # trained while the others are measured
    params, state = model.get_params(), model.get_optimizer_state()
    gate.set()
    chosen = D.settled(model, timeout=60)
    assert chosen.variant == "b" and chosen is not model
    assert all(np.array_equal(chosen.get_params()[k], v) for k, v in params.items())
    got = chosen.get_optimizer_state()
    assert int(got["step"][0]) == 7 and all(np.array_equal(got[k], v) for k, v in state.items())
    # and it trains on from there as the quick variant would have
    reference = CpuModel(SPEC, "fp32")
    reference.set_params(params)
    reference.set_optimizer_state(state)
    assert np.array_equal(chosen.train_step(x, y, 2), reference.train_step(x, y, 2))


def test_a_failed_background_measurement_leaves_the_quick_variant_serving_and_says_why(tmp_path):
    fake = FakeBackend({"quick": (1.0, 1.0, "fails when measured"), "broken": (0.1, 0.1, "compile fails")})
    model = fake.compile(SPEC, KernelCache(tmp_path), quick=[("quick", "compiles at once")])
    with pytest.raises(D.DispatchFailed, match="the background measurement failed: no variant of the fake backend "
                                               "runs this model correctly: quick: failed to run: RuntimeError: the "
                                               "device was lost; broken: failed to compile: "):
        D.settled(model, timeout=60)
    doc = model.dispatch.to_json()
    assert doc["state"] == "failed" and doc["variant"] == "quick" and doc["error"].endswith("; quick goes on serving")
    x = np.random.default_rng(3).standard_normal((16, SPEC.n_input_dims), dtype=np.float32)
    assert np.isfinite(model.forward(x)).all()
    assert not list(tmp_path.glob("*/*.bin"))  # nothing was decided: nothing stored


def test_a_cached_decision_serves_the_chosen_variant_at_once_without_measuring(tmp_path):
    D.settled(fast_and_slow().compile(SPEC, KernelCache(tmp_path), quick=[("c", "quick")]), timeout=60)
    again = fast_and_slow()  # a restart: a new backend on the same cache directory
    model = again.compile(SPEC, KernelCache(tmp_path), quick=[("c", "quick")])
    assert model.variant == "b" and model.dispatch.from_cache and model.dispatch.to_json()["state"] == "decided"
    assert again.compiles == {"b": 1} and again.clock.timed == 0


class HeldGate:
    """A gate that says when the measurement has reached it."""

    def __init__(self):
        self.reached, self.open = threading.Event(), threading.Event()

    def wait(self):
        self.reached.set()
        self.open.wait()


def test_a_model_no_longer_wanted_is_not_measured_further(tmp_path):
    gate = HeldGate()
    fake = FakeBackend(VARIANT_SETS["fast-and-slow"], gate=gate)
    model = fake.compile(SPEC, KernelCache(tmp_path), quick=[("c", "quick")])
    assert gate.reached.wait(60)  # the measurement is in its first variant
    model.dispatch.wanted = lambda: False  # replaced meanwhile: the measurement stops before its next variant
    gate.open.set()
    with pytest.raises(D.DispatchFailed, match="stopped: the model is no longer served"):
        model.dispatch.wait(60)
    assert fake.clock.timed == 2  # the variant it was in: forward and training
    assert not list(tmp_path.glob("*/*.bin"))
    # one no longer wanted before its turn is not measured at all
    queued = FakeBackend(VARIANT_SETS["fast-and-slow"])
    hold = HeldGate()
    blocker = FakeBackend(VARIANT_SETS["a tie"], gate=hold).compile(SPEC, KernelCache(tmp_path / "b"), quick=[("second", "q")])
    assert hold.reached.wait(60)  # the device's queue is busy with another model
    later = queued.compile(SPEC, KernelCache(tmp_path / "c"), quick=[("c", "quick")])
    later.dispatch.wanted = lambda: False
    hold.open.set()
    with pytest.raises(D.DispatchFailed, match="not measured: the model stopped being served before its turn"):
        later.dispatch.wait(60)
    assert queued.clock.timed == 0 and D.settled(blocker, timeout=60).variant == "first"


def test_the_timer_spends_its_budget_in_three_to_ten_samples():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    D.median_timer(budget_s=0.001)(slow, lambda: None, None)
    assert len(calls) == 1 + D.MIN_REPEATS  # a warm-up sample, then the fewest samples
    calls.clear()
    D.median_timer(budget_s=10.0)(lambda: calls.append(1), lambda: None, None)
    assert len(calls) == 1 + 10  # a warm-up sample, then at most ``repeats``
    calls.clear()
    D.median_timer()(lambda: calls.append(1), lambda: None, 2)  # no budget: three warm-up samples, ten timed
    assert len(calls) == (3 + 10) * 2


# -- the cuda backend's wiring, CuPy stubbed -------------------------------------------------------
@pytest.fixture
def stub_cuda(monkeypatch, tmp_path):
    """CudaBackend with a stubbed CuPy and probe: mma, cublaslt usable, wgmma per ``wgmma``; the
    variants are fake models timed by the fake clock."""
    from mmad.backends import cuda
    from mmad.backends.contract import ProbeRow

    fake = FakeBackend({"wgmma": (0.1, 0.1, "ok"), "wgmma+mma": (0.1, 1.0, "ok"), "mma": (1.0, 1.0, "ok"), "mma-f16acc": (1.5, 1.0, "ok"),
                        "cublaslt": (2.0, 2.0, "ok"), "mma-f16acc+cublaslt": (1.5, 2.0, "ok"),
                        "wgmma+cublaslt": (0.1, 2.0, "ok")})
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda index: nullcontext(), runtime=types.SimpleNamespace(getDeviceCount=lambda: 1)))
    monkeypatch.setattr(cuda, "cupy_module", lambda: cp)
    monkeypatch.setattr(cuda, "device_info", lambda cp: {"name": "NVIDIA H100 80GB HBM3", "cc": (9, 0)})
    monkeypatch.setattr(cuda, "median_timer", lambda clock, **kw: fake.clock.timer)
    monkeypatch.setattr(cuda.CudaBackend, "_build", staticmethod(
        lambda variant, spec, cp, info, cache, knobs: fake.build(variant, spec)))
    monkeypatch.setattr(cuda.CudaBackend, "_wgmma_fits", staticmethod(lambda spec, variant="wgmma+mma": True))

    def backend(wgmma_offered=False):
        b = cuda.CudaBackend()
        b._rows = [ProbeRow("cuda", "wgmma", wgmma_offered, reason="" if wgmma_offered else "off"),
                   ProbeRow("cuda", "wgmma+mma", wgmma_offered, reason="" if wgmma_offered else "off"),
                   ProbeRow("cuda", "mma", True, api_version="driver 12.8"),
                   ProbeRow("cuda", "mma-f16acc", True, api_version="driver 12.8"),
                   ProbeRow("cuda", "cublaslt", True), ProbeRow("cuda", "mma-f16acc+cublaslt", True),
                   ProbeRow("cuda", "wgmma+cublaslt", wgmma_offered, reason="" if wgmma_offered else "wgmma: off")]
        return b

    monkeypatch.setenv("MMAD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MMAD_DISPATCH", raising=False)
    return types.SimpleNamespace(fake=fake, backend=backend)


def test_cuda_measures_mma_and_cublaslt_and_leaves_wgmma_out_unless_offered(stub_cuda):
    quick = stub_cuda.backend().compile(SPEC)
    # served at once on cuBLASLt (library matmuls: the quickest to compile), measured meanwhile
    assert quick.variant == "cublaslt" and isinstance(quick.dispatch, D.Background)
    assert "the quickest to compile" in quick.dispatch.reason
    model = D.settled(quick)
    assert model.variant == "mma"
    doc = model.dispatch.to_json()
    assert [v["variant"] for v in doc["variants"]] == ["mma", "mma-f16acc", "cublaslt", "mma-f16acc+cublaslt"]
    assert doc["device"] == "NVIDIA H100 80GB HBM3 sm_90" and doc["io"] == "fp16" and doc["rows"] == D.ROWS
    # where the probe offers it (an sm_90 GPU, nvcc): a candidate like the others, and its pair
    # with cublaslt's training too
    offered = D.settled(stub_cuda.backend(wgmma_offered=True).compile(SPEC))
    assert offered.variant == "wgmma"
    assert [v["variant"] for v in offered.dispatch.to_json()["variants"]] == [
        "wgmma", "wgmma+mma", "mma", "mma-f16acc", "cublaslt", "mma-f16acc+cublaslt", "wgmma+cublaslt"]


def test_cuda_takes_the_pair_where_one_variant_trains_and_another_forwards_fastest(stub_cuda):
    """The model L on the H100: cuBLASLt trains fastest, mma-f16acc forwards fastest; the
    mma-f16acc+cublaslt variant (its forward and its training are theirs) scores best of all."""
    stub_cuda.fake.variants.update({"mma": (1.4, 1.3, "ok"), "mma-f16acc": (1.0, 1.3, "ok"),
                                    "cublaslt": (1.9, 1.0, "ok"), "mma-f16acc+cublaslt": (1.0, 1.0, "ok")})
    model = D.settled(stub_cuda.backend().compile(SPEC))
    assert model.variant == "mma-f16acc+cublaslt"
    scores = {v["variant"]: v["score"] for v in model.dispatch.to_json()["variants"]}
    assert scores["mma-f16acc+cublaslt"] == pytest.approx(2.0)
    assert scores["mma-f16acc"] == pytest.approx(2.3) and scores["cublaslt"] == pytest.approx(2.9)


def test_cuda_fixed_dispatch_and_a_named_variant_measure_nothing(stub_cuda, monkeypatch):
    backend = stub_cuda.backend()
    assert backend.compile(SPEC, variant="cublaslt").variant == "cublaslt"
    monkeypatch.setenv("MMAD_DISPATCH", "fixed")
    model = backend.compile(SPEC)
    assert model.variant == "mma" and model.dispatch is None
    assert stub_cuda.backend(wgmma_offered=True).compile(SPEC).variant == "wgmma"
    assert stub_cuda.fake.clock.timed == 0
    with pytest.raises(SpecError, match=r"the cuda backend has variants wgmma, wgmma\+mma, mma, mma-f16acc, cublaslt, "
                                        r"mma-f16acc\+cublaslt, wgmma\+cublaslt; got 'fast'"):
        backend.compile(SPEC, variant="fast")


def test_cuda_measures_at_the_batch_the_model_runs(stub_cuda, monkeypatch):
    """``compile(spec, batch_rows=n)``: the variants are measured on n rows (a decision of its own
    in the cache), at most MAX_DISPATCH_ROWS; without it on the dispatcher's 65,536."""
    from mmad.backends import cuda

    monkeypatch.setattr(cuda, "MAX_DISPATCH_ROWS", 8192)  # the fake variants compute on the host
    monkeypatch.setenv("MMAD_DISPATCH", "measure")  # measured before returning: no quick variant
    backend = stub_cuda.backend()
    assert backend.compile(SPEC).dispatch.rows == D.ROWS
    assert backend.compile(SPEC, batch_rows=4096).dispatch.rows == 4096
    big = backend.compile(SPEC, batch_rows=1 << 24)
    assert big.dispatch.rows == cuda.MAX_DISPATCH_ROWS and not big.dispatch.from_cache
    assert backend.compile(SPEC, batch_rows=4096).dispatch.from_cache


def test_cuda_dispatch_knob_is_checked(stub_cuda, monkeypatch):
    monkeypatch.setenv("MMAD_DISPATCH", "fastest")
    with pytest.raises(SpecError, match="MMAD_DISPATCH: must be one of background, measure, fixed; got 'fastest'"):
        stub_cuda.backend().compile(SPEC)


# -- the daemon: the per-model override and the reports ----------------------------------------------
def test_registry_compile_passes_the_override_else_the_forced_variant_else_none():
    """...and the model's max_batch_rows, the batch a backend that measures its variants measures at."""
    from mmad.engine.registry import Registry

    calls = []
    stub = types.SimpleNamespace(backend=types.SimpleNamespace(compile=lambda spec, variant, device, batch_rows: calls.append(
        variant if batch_rows is None else (variant, batch_rows))), settings=types.SimpleNamespace(backend=None))
    Registry._compile(stub, SPEC, 0, "cublaslt")
    Registry._compile(stub, SPEC, 0, None, 4096)
    stub.settings.backend = "cuda:mma"
    Registry._compile(stub, SPEC, 0)
    Registry._compile(stub, SPEC, 0, "cublaslt")
    stub.settings.backend = "cuda"
    Registry._compile(stub, SPEC, 0)
    assert calls == ["cublaslt", (None, 4096), "mma", "cublaslt", None]


SMALL = {"n_input_dims": 3, "n_output_dims": 2, "network": {"n_neurons": 16, "n_hidden_layers": 1}, "seed": 5}


def test_daemon_model_variant_override_and_reports(http):
    r = http.put("/v2/models/dispatch-override", json={"spec": SMALL, "config": {"variant": "numpy"}})
    assert r.status_code in (200, 201), r.text
    meta = http.get("/v2/models/dispatch-override").json()
    assert meta["variant"] == "numpy" and meta["dispatch"] is None and meta["config"]["variant"] == "numpy"
    assert http.get("/v2/models/dispatch-override/config").json()["parameters"]["variant"] == "numpy"
    plain = http.put("/v2/models/dispatch-plain", json={"spec": SMALL}).json()
    assert plain["variant"] == "numpy" and plain["config"]["variant"] is None
    # the cpu backend chooses nothing by measurement: no decisions to report
    assert http.get("/v2/devices").json()["dispatch"] == []

    r = http.put("/v2/models/dispatch-bad", json={"spec": SMALL, "config": {"variant": "mma"}})
    assert r.status_code == 400
    assert r.json()["error"] == "variant: the cpu backend has one variant, 'numpy'; got 'mma'"
    assert http.get("/v2/models/dispatch-bad").status_code == 404
    r = http.put("/v2/models/dispatch-bad", json={"spec": SMALL, "config": {"variant": ""}})
    assert r.status_code == 400 and r.json()["error"].startswith("config.variant: ")
    for name in ("dispatch-override", "dispatch-plain"):
        http.delete(f"/v2/models/{name}")


def test_reports_carry_the_decision(tmp_path):
    """The engine's ``model_status`` (the model metadata's mmad fields) and ``/v2/devices``'
    dispatch list, on a model the fake backend dispatched."""
    import asyncio

    from mmad.engine.inprocess import InProcessEngine
    from mmad.engine.registry import ModelConfig, ModelEntry, Replica
    from mmad.engine.inprocess import dispatch_report
    from mmad.settings import Settings

    model = fast_and_slow().compile(SPEC, KernelCache(tmp_path))
    entry = ModelEntry("m", SPEC, ModelConfig())
    entry.replicas = [Replica(1, model)]
    registry = types.SimpleNamespace(models={"m": entry}, versions=lambda name: [{"version": "1", "step": 0}],
                                     backend_label="fake:b", get=lambda name: entry)
    rt = types.SimpleNamespace(registry=registry, settings=Settings(), ready=True, workers=None)
    status = asyncio.run(InProcessEngine(rt).model_status("m"))
    assert status.variant == "b" and status.dispatch == model.dispatch.to_json() and status.devices == (1,)
    [report] = dispatch_report(rt)
    assert report["model"] == "m" and report["device_index"] == 1 and report["variant"] == "b"
    assert [v["variant"] for v in report["variants"]] == ["a", "b", "c"]


# -- mmad bench --dispatch ------------------------------------------------------------------------
def test_bench_dispatch_writes_the_choice_the_figures_and_the_decision(tmp_path, monkeypatch, capsys):
    """The cpu backend made to dispatch between two fake variants; ``--dispatch`` writes the report."""
    from mmad import cli
    from mmad.backends.cpu import CpuBackend

    monkeypatch.setenv("MMAD_BACKEND", "")
    fake = FakeBackend({"numpy": (1.0, 1.0, "ok"), "slow": (2.0, 2.0, "ok")})
    plain = CpuBackend.compile  # the float64 oracle stays the real cpu backend

    asked_rows = []

    def compile(self, spec, variant=None, cache=None, device=0, batch_rows=None):
        if self.numerics == "float64":
            return plain(self, spec)
        asked_rows.append(batch_rows)
        return fake.compile(spec, KernelCache(tmp_path / "c"))

    monkeypatch.setattr(CpuBackend, "compile", compile)
    out = tmp_path / "results" / "dispatch-cpu.json"
    assert cli.main(["bench", "--backend", "cpu", "--models", "S", "--rows", "1024", "--repeats", "2",
                     "--peer", "none", "--dispatch", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == (f"mmad bench --backend cpu --models S --rows 1024 --io fp16 --mode both --peer none "
                              f"--repeats 2 --dispatch {out}")
    assert doc["backend"] == "cpu" and doc["rows"] == 1024 and doc["errors"] == []
    assert asked_rows == [1024]  # the variants are chosen for the benchmark's batch
    s = doc["models"]["S"]
    assert s["variant"] == "numpy" and s["forward_msps"] > 0 and s["train_msps"] > 0
    assert s["torch_forward_msps"] is None and s["torch_train_msps"] is None  # --peer none
    assert s["dispatch"]["variant"] == "numpy"
    assert [v["variant"] for v in s["dispatch"]["variants"]] == ["numpy", "slow"]
    table = capsys.readouterr().out
    assert table.count("Dispatcher: S on cpu → numpy; M samples/s forward/train at 2048 rows: numpy ") == 1
    assert "slow " in table and "score 2.00" in table


def test_bench_dispatch_needs_a_backend_without_a_variant(capsys, monkeypatch):
    from mmad import cli

    monkeypatch.setenv("MMAD_BACKEND", "")
    assert cli.main(["bench", "--backend", "cpu:numpy", "--peer", "none", "--dispatch", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "--dispatch: reports the backend's own choice of variant: name one --backend without a variant" in err


def test_cuda_offers_ema_models_only_the_mma_variants_and_grid_models_take_mma_f16acc(stub_cuda):
    """tiny-cuda-nn's EMA wrapper runs on the mma kernels: the dispatcher measures mma and
    mma-f16acc only; a grid model left to the backend takes mma-f16acc without measuring
    (tiny-cuda-nn's arithmetic; a fresh model's tables tell nothing of trained ones), mma when named."""
    ema = MLPSpec.from_json({**SPEC_DOC, "optimizer": {"otype": "EMA", "decay": 0.9, "nested": {"otype": "Adam"}}})
    quick = stub_cuda.backend(wgmma_offered=True).compile(ema)
    assert quick.variant == "mma"  # cuBLASLt keeps no average: the first mma variant serves meanwhile
    model = D.settled(quick)
    assert [v["variant"] for v in model.dispatch.to_json()["variants"]] == ["mma", "mma-f16acc"]
    timed = stub_cuda.fake.clock.timed
    grid = MLPSpec.from_json({**SPEC_DOC, "n_input_dims": 2, "encoding": {"otype": "HashGrid", "n_levels": 2}})
    assert stub_cuda.backend().compile(grid).variant == "mma-f16acc"
    assert stub_cuda.backend().compile(grid, variant="mma").variant == "mma"
    assert stub_cuda.fake.clock.timed == timed
    with pytest.raises(SpecError, match="mma and mma-f16acc variants only"):
        stub_cuda.backend().compile(grid, variant="cublaslt")
