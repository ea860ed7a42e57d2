"""The cuda backend against the float64 cpu oracle, on a CUDA GPU (skipped without one).

Fresh random inputs, targets and biases for every case (never zeros); the measure is
||out - ref|| / ||ref||. Tolerances: forward 3e-3 (docs/design.md, fp16); loss 3e-3; gradients per
tensor within 1e-2 of the cpu backend's fp16 emulation (same rounding points) and within 3e-3 +
1.25x the emulation's own distance from float64 (ReLU masks flipped by fp16 rounding put fp16
gradients 1-4% from float64 on the GPU; tests/oracle.py:grad_errors); 200 Adam steps must
end within 5% of the oracle's loss.
The 2^20-row forward compares a random subset of 4096 rows (rows are independent).
"""

from __future__ import annotations

import numpy as np
from oracle import case_rng, grad_errors, rel_err
import pytest

from mmad.backends.cache import KernelCache
from mmad.backends.contract import init_params
from mmad.backends.cpu import CpuBackend
from mmad.backends.cuda.cublaslt_trained import SPLIT_VARIANTS
from mmad.errors import CompileError, InvalidInput
from mmad.spec import ACTIVATIONS, LOSSES, MLPSpec, bench_spec

pytestmark = pytest.mark.gpu

FWD_TOL = 3e-3
LOSS_TOL = 3e-3
GRAD_TOL_EMULATE = 1e-2
BATCHES = [1, 7, 1000, 65_537, 1 << 20]


def _cuda_backend():
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed: the cuda backend cannot run here")
    from mmad.backends.cuda import CudaBackend

    backend = CudaBackend()
    rows = {r.variant: r for r in backend.probe()}
    if not rows["mma"].available:
        pytest.skip(f"the cuda mma variant is unavailable here: {rows['mma'].reason}")
    return backend


@pytest.fixture(scope="module")
def backend():
    return _cuda_backend()


@pytest.fixture(scope="module")
def cache():
    # the default directory (MMAD_CACHE_DIR): a spec compiled once is a cache hit everywhere after
    return KernelCache()


def random_params(spec, rng):
    params = init_params(spec)
    for name in params:
        if name.startswith("b"):
            params[name] = rng.uniform(-0.2, 0.2, size=params[name].shape).astype(np.float32)
    return params


def make_pair(backend, cache, spec, rng, variant="mma"):  # named: compile(variant=None) measures
    model = backend.compile(spec, variant=variant, cache=cache)
    oracle = CpuBackend("float64").compile(spec)
    params = random_params(spec, rng)
    model.set_params(params)
    oracle.set_params(params)
    return model, oracle


_models: dict = {}


def cached_pair(backend, cache, spec, rng):
    key = spec.content_hash()
    if key not in _models:
        _models[key] = make_pair(backend, cache, spec, rng)
    model, oracle = _models[key]
    params = random_params(spec, rng)
    model.set_params(params)
    oracle.set_params(params)
    return model, oracle


def test_probe_reports_every_variant(backend):
    rows = {r.variant: r for r in backend.probe()}
    assert set(rows) == {"wgmma", "wgmma+mma", "mma", "mma-f16acc", "cublaslt", "mma-f16acc+cublaslt", "wgmma+cublaslt"}
    assert "compute_capability" in rows["mma"].details
    for row in rows.values():
        assert row.available or row.reason, row


# every activation once, ReLU (the benchmark activation) on all four models: each distinct spec
# costs an NVRTC compile, so the list is chosen to cover, not to multiply. Exponential runs on
# the shallow S with inputs scaled by 1/2: deeper stacks of exp overflow fp16 (65504) on
# standard-normal data, a limit of fp16 activations, not of the kernels.
MODEL_CASES = [("S", "None"), ("M", "ReLU"), ("L", "LeakyReLU"), ("S", "Sigmoid"), ("M", "Tanh"),
               ("L", "SiLU"), ("S", "Softplus"), ("M", "Squareplus"), ("S", "Exponential"),
               ("M", "Sine"), ("S", "ReLU"), ("L", "ReLU"), ("W", "ReLU")]


def test_the_case_list_covers_every_activation():
    assert {a for _, a in MODEL_CASES} == set(ACTIVATIONS)


def inputs(rng, rows, spec):
    x = rng.standard_normal((rows, spec.n_input_dims), dtype=np.float32)
    return x * np.float32(0.5) if spec.activation == "Exponential" else x


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize(("name", "activation"), MODEL_CASES)
def test_forward_matches_oracle(backend, cache, name, activation, batch):
    rng = case_rng(name, activation, batch)
    spec = bench_spec(name, activation=activation)
    model, oracle = cached_pair(backend, cache, spec, rng)
    x = inputs(rng, batch, spec)
    out = model.forward(x)
    assert out.shape == (batch, spec.n_output_dims) and out.dtype == np.float32
    check = np.arange(batch) if batch <= 65_537 else np.sort(rng.choice(batch, 4096, replace=False))
    err = rel_err(out[check], oracle.forward(x[check]))
    assert err <= FWD_TOL, f"{name}/{activation}/batch {batch}: forward rel. err {err:.2e}"


@pytest.mark.parametrize(("name", "activation"), MODEL_CASES)
def test_f16acc_forward_matches_oracle(backend, cache, name, activation):
    """mma-f16acc's fp16-out forward (fp16 accumulators, tiny-cuda-nn's fully fused arithmetic):
    every activation on S/M/L/W, fp16 device inputs and outputs at every batch size, against the
    float64 oracle with the forward's tolerance; fp32 outputs go through mma's fp32 forward."""
    import cupy as cp

    rng = case_rng("f16acc", name, activation)
    spec = bench_spec(name, activation=activation)
    model, oracle = make_pair(backend, cache, spec, rng, variant="mma-f16acc")
    assert model.variant == "mma-f16acc"
    for batch in BATCHES:
        x16 = inputs(rng, batch, spec).astype(np.float16)
        out = model.forward(cp.asarray(x16), out_dtype=np.float16)
        assert out.dtype == cp.float16 and out.shape == (batch, spec.n_output_dims)
        check = np.arange(batch) if batch <= 65_537 else np.sort(rng.choice(batch, 4096, replace=False))
        err = rel_err(cp.asnumpy(out)[check].astype(np.float64), oracle.forward(x16[check].astype(np.float32)))
        assert err <= FWD_TOL, f"{name}/{activation}/batch {batch}: fp16-accumulated forward rel. err {err:.2e}"
    x = inputs(rng, 1000, spec)
    assert rel_err(model.forward(x), oracle.forward(x)) <= FWD_TOL
    model.close()


def test_f16acc_trains_exactly_as_mma(backend, cache):
    """mma-f16acc changes only the fp16-out forwards: from the same parameters its training steps
    give mma's losses and parameters bit for bit."""
    rng = np.random.default_rng()
    spec = bench_spec("S")
    params = random_params(spec, rng)
    x = rng.standard_normal((5000, spec.n_input_dims), dtype=np.float32)
    y = rng.standard_normal((5000, spec.n_output_dims), dtype=np.float32)
    results = []
    for variant in ("mma", "mma-f16acc"):
        model = backend.compile(spec, variant=variant, cache=cache)
        model.set_params(params)
        results.append((np.asarray(model.train_step(x, y, steps=5)), model.get_params()))
        model.close()
    (loss_a, params_a), (loss_b, params_b) = results
    np.testing.assert_array_equal(loss_a, loss_b)
    for name in params_a:
        np.testing.assert_array_equal(params_a[name], params_b[name])


@pytest.mark.parametrize("activation", ["Sigmoid", "Exponential", "Squareplus", "Sine"])
def test_output_activation_forward(backend, cache, activation):
    rng = np.random.default_rng(11)
    spec = bench_spec("S", output_activation=activation, activation="Tanh")
    model, oracle = cached_pair(backend, cache, spec, rng)
    x = rng.standard_normal((999, spec.n_input_dims), dtype=np.float32)
    err = rel_err(model.forward(x), oracle.forward(x))
    assert err <= FWD_TOL, f"output {activation}: rel. err {err:.2e}"


def check_grads(model, oracle, x, y, label, vs_emulate=GRAD_TOL_EMULATE):
    loss, grads = model.loss_and_grads(x, y)
    ref_loss, ref_grads = oracle.loss_and_grads(x, y)
    assert np.isfinite(loss)
    assert abs(loss - ref_loss) <= LOSS_TOL * abs(ref_loss), f"{label}: loss {loss} vs {ref_loss}"
    assert set(grads) == set(ref_grads)
    errors = grad_errors(grads, model.spec, oracle.get_params(), x, y, ref_grads)
    for k, (vs64, err_emulate, inherent) in errors.items():
        assert err_emulate <= vs_emulate, f"{label}: gradient {k} {err_emulate:.2e} from the fp16 emulation"
        assert vs64 <= FWD_TOL + 1.25 * inherent, (
            f"{label}: gradient {k} {vs64:.2e} from float64 (the fp16 emulation itself: {inherent:.2e})")
    return max((e[0], k) for k, e in errors.items())


@pytest.mark.parametrize(("name", "activation", "batch"), [("S", "ReLU", 1000), ("M", "LeakyReLU", 65_537),
                                                      ("M", "ReLU", 7)])
def test_fused_weight_gradients_equal_the_separate_kernels(backend, cache, monkeypatch, name, activation, batch):
    """mlp_train_fused (weight gradients accumulated inside the training kernel) against the
    separate weight-gradient kernels on the same parameters and data: the same fp16 operands,
    only the fp32 summation order differs."""
    from mmad.backends.cuda import knobs

    rng = case_rng(name, activation, batch, "fused")
    spec = bench_spec(name, activation=activation)
    fused, oracle = make_pair(backend, cache, spec, rng)
    monkeypatch.setenv(knobs.FUSED_WGRAD_ENV, "0")
    separate = backend.compile(spec, variant="mma", cache=cache)
    separate.set_params(oracle.get_params())
    assert fused.fused_wgrad and not separate.fused_wgrad
    x = inputs(rng, batch, spec)
    y = rng.standard_normal((batch, spec.n_output_dims), dtype=np.float32)
    loss_f, grads_f = fused.loss_and_grads(x, y)
    loss_s, grads_s = separate.loss_and_grads(x, y)
    assert abs(loss_f - loss_s) <= 1e-6 * abs(loss_s)
    for k in grads_s:
        assert rel_err(grads_f[k], grads_s[k]) <= 1e-5, f"{k}: {rel_err(grads_f[k], grads_s[k]):.2e}"
    check_grads(fused, oracle, x, y, f"fused {name}/{activation}/batch {batch}")


GRAD_CASES = ([(n, a, b) for n, a in MODEL_CASES for b in (1, 7, 1000)]
              + [(n, a, 65_537) for n, a in MODEL_CASES if n in ("S", "M")])


@pytest.mark.parametrize(("name", "activation", "batch"), GRAD_CASES)
def test_gradients_match_oracle(backend, cache, name, activation, batch):
    rng = case_rng(name, activation, batch, "g")
    spec = bench_spec(name, activation=activation)
    model, oracle = cached_pair(backend, cache, spec, rng)
    x = inputs(rng, batch, spec)
    y = rng.standard_normal((batch, spec.n_output_dims), dtype=np.float32)
    check_grads(model, oracle, x, y, f"{name}/{activation}/batch {batch}")


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss(backend, cache, loss):
    rng = np.random.default_rng(5)
    spec = bench_spec("S", loss=loss, output_activation="None")
    model, oracle = make_pair(backend, cache, spec, rng)
    x = rng.standard_normal((777, spec.n_input_dims), dtype=np.float32)
    y = rng.standard_normal((777, spec.n_output_dims), dtype=np.float32)
    check_grads(model, oracle, x, y, f"loss {loss}")


@pytest.mark.parametrize(("width", "n_in", "n_out", "layers", "encoding"), [
    (16, 3, 1, 1, {"otype": "Identity"}),
    (32, 5, 3, 3, {"otype": "Frequency", "n_frequencies": 4}),
    (48, 2, 7, 2, {"otype": "OneBlob", "n_bins": 8}),
    (80, 17, 2, 5, {"otype": "Identity"}),
    (96, 64, 33, 2, {"otype": "Identity"}),
    (112, 9, 4, 1, {"otype": "Identity"}),
    (128, 100, 20, 3, {"otype": "Identity"}),
])
def test_widths_and_odd_shapes(backend, cache, width, n_in, n_out, layers, encoding):
    rng = np.random.default_rng(width)
    spec = bench_spec("M").replace(n_neurons=width, n_input_dims=n_in, n_output_dims=n_out,
                                   n_hidden_layers=layers, encoding=encoding, activation="SiLU")
    model, oracle = make_pair(backend, cache, spec, rng)
    x = rng.uniform(0, 1, (1001, n_in)).astype(np.float32)
    y = rng.standard_normal((1001, n_out), dtype=np.float32)
    assert rel_err(model.forward(x), oracle.forward(x)) <= FWD_TOL
    check_grads(model, oracle, x, y, f"width {width}, {n_in}->{n_out}")


# W is left out: 200 float64 oracle steps of it take minutes on the CPU
TRAIN_CASES = [(n, a, "Adam") for n, a in MODEL_CASES if n != "W"] + [("M", "Tanh", "SGD")]


@pytest.mark.parametrize(("name", "activation", "optimizer"), TRAIN_CASES)
def test_200_steps_follow_the_oracle(backend, cache, name, activation, optimizer):
    rng = case_rng(name, activation, optimizer)
    opt = ({"otype": "Adam", "learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-15}
           if optimizer == "Adam" else {"otype": "SGD", "learning_rate": 1e-2, "momentum": 0.9})
    spec = bench_spec(name, activation=activation, optimizer=opt)
    model, oracle = make_pair(backend, cache, spec, rng)
    batch = 512
    x = inputs(rng, batch, spec)
    # a learnable target: a fixed smooth function of the input
    proj = rng.standard_normal((spec.n_input_dims, spec.n_output_dims)) / np.sqrt(spec.n_input_dims)
    y = np.tanh(x @ proj).astype(np.float32)
    losses = model.train_step(x, y, steps=200)
    ref = oracle.train_step(x, y, steps=200)
    assert np.isfinite(losses).all()
    assert losses[-1] < losses[0]
    assert abs(losses[-1] - ref[-1]) <= 0.05 * ref[-1], f"final loss {losses[-1]} vs oracle {ref[-1]}"
    state = model.get_optimizer_state()
    assert int(state["step"][0]) == 200


@pytest.mark.parametrize("variant", ["mma", "cublaslt"])
def test_spherical_harmonics_and_triangle_wave(backend, cache, variant):
    """tiny-cuda-nn's parameter-free encodings, computed on the host (numerics.encode) before the
    upload as Frequency is: a direction through SphericalHarmonics degree 4 beside a triangle wave
    of the other two inputs; forward (host and device inputs) and gradients against the float64
    oracle, and 40 Adam steps following its loss curve."""
    if not {r.variant: r for r in backend.probe()}[variant].available:
        pytest.skip(f"the cuda {variant} variant is unavailable here")
    spec = MLPSpec.from_json({
        "n_input_dims": 5, "n_output_dims": 3, "network": {"n_neurons": 32, "n_hidden_layers": 2, "activation": "ReLU"},
        "encoding": {"otype": "Composite", "nested": [
            {"otype": "SphericalHarmonics", "degree": 4, "n_dims_to_encode": 3},
            {"otype": "TriangleWave", "n_frequencies": 6}]}})
    rng = np.random.default_rng()
    model, oracle = make_pair(backend, cache, spec, rng, variant=variant)
    try:
        x = rng.uniform(0, 1, (1000, 5)).astype(np.float32)
        direction = x[:, :3] * 2 - 1  # SphericalHarmonics reads unit directions mapped into [0, 1]
        x[:, :3] = (direction / np.linalg.norm(direction, axis=1, keepdims=True) + 1) / 2
        y = rng.uniform(-1, 1, (1000, 3)).astype(np.float32)
        ref = oracle.forward(x)
        assert rel_err(model.forward(x), ref) <= FWD_TOL
        assert rel_err(model.download(model.forward(model.upload(x))), ref) <= FWD_TOL
        check_grads(model, oracle, x, y, f"SH+TriangleWave {variant}")
        losses, reference = model.train_step(x, y, 40), oracle.train_step(x, y, 40)
        assert losses[-1] < 0.8 * losses[0]
        np.testing.assert_allclose(losses, reference, rtol=0.05)
    finally:
        model.close()


@pytest.mark.parametrize("variant", ["mma", "wgmma"])
def test_training_is_deterministic_at_2_20_rows(backend, cache, variant):
    row = {r.variant: r for r in backend.probe()}[variant]
    if not row.available:
        pytest.skip(f"the cuda {variant} variant is unavailable here: {row.reason}")
    rng = np.random.default_rng(3)
    spec = bench_spec("M")
    x = rng.standard_normal((1 << 20, spec.n_input_dims), dtype=np.float32)
    y = rng.standard_normal((1 << 20, spec.n_output_dims), dtype=np.float32)
    results = []
    for _ in range(2):
        model = backend.compile(spec, variant=variant, cache=cache)
        dx, dy = model.upload(x), model.upload(y)
        losses = model.train_step(dx, dy, steps=3)
        results.append((losses, model.get_params()))
        model.close()
    (l0, p0), (l1, p1) = results
    assert np.array_equal(l0, l1)
    for k in p0:
        assert np.array_equal(p0[k], p1[k]), k
    assert np.isfinite(l0).all() and l0[-1] < l0[0]


def test_device_arrays_stay_on_device(backend, cache):
    import cupy

    rng = np.random.default_rng(8)
    spec = bench_spec("S")
    model, oracle = make_pair(backend, cache, spec, rng)
    x = rng.standard_normal((300, spec.n_input_dims), dtype=np.float32)
    out = model.forward(model.upload(x))
    assert isinstance(out, cupy.ndarray)
    assert rel_err(model.download(out), oracle.forward(x)) <= FWD_TOL


HALF_IO_CASES = [  # (variant, spec overrides): fp16 in/out kernels, odd widths, an encoding, an output activation
    ("mma", {"name": "S"}),
    ("mma", {"name": "M", "n_input_dims": 17, "n_output_dims": 3}),
    ("mma", {"name": "M", "encoding": {"otype": "Frequency", "n_frequencies": 4}, "n_input_dims": 3}),
    ("mma-f16acc", {"name": "S"}),
    ("mma-f16acc", {"name": "M", "n_input_dims": 17, "n_output_dims": 3}),
    ("mma-f16acc", {"name": "L", "output_activation": "Sigmoid", "activation": "SiLU"}),
    ("mma-f16acc", {"name": "W"}),
    ("cublaslt", {"name": "M"}),
    ("cublaslt", {"name": "W"}),
    ("cublaslt", {"name": "M", "output_activation": "Sigmoid", "activation": "SiLU"}),
]


@pytest.mark.parametrize(("variant", "overrides"), HALF_IO_CASES)
def test_half_io_forward_matches_oracle(backend, cache, variant, overrides):
    """``forward(x16, out_dtype=float16)``: fp16 device inputs read as they are, fp16 outputs."""
    import cupy as cp

    rows = {r.variant: r for r in backend.probe()}
    if not rows[variant].available:
        pytest.skip(f"the cuda {variant} variant is unavailable here: {rows[variant].reason}")
    overrides = dict(overrides)
    spec = bench_spec(overrides.pop("name"), **overrides)
    rng = case_rng(variant, spec.content_hash())
    model, oracle = make_pair(backend, cache, spec, rng, variant=variant)
    for batch in (1, 7, 1000, 65_537):
        x16 = inputs(rng, batch, spec).astype(np.float16)
        out = model.forward(cp.asarray(x16), out_dtype=np.float16)
        assert isinstance(out, cp.ndarray) and out.dtype == cp.float16 and out.shape == (batch, spec.n_output_dims)
        err = rel_err(cp.asnumpy(out).astype(np.float64), oracle.forward(x16.astype(np.float32)))
        assert err <= FWD_TOL, f"{variant} {spec.n_input_dims}->{spec.n_output_dims}, batch {batch}: {err:.2e}"
    host = model.forward(x16, out_dtype="float16")  # host in, host out, same dtype rule
    assert isinstance(host, np.ndarray) and host.dtype == np.float16
    # the service's path: host input, output written into a host buffer in the buffer's dtype
    ref = oracle.forward(x16.astype(np.float32))
    for x_host, dtype in ((x16, np.float16), (x16.astype(np.float32), np.float32), (x16, np.float32)):
        buf = np.full((x16.shape[0], spec.n_output_dims), np.nan, dtype)
        model.forward_to_host(x_host, buf)
        err = rel_err(buf.astype(np.float64), ref)
        assert err <= FWD_TOL, f"forward_to_host {x_host.dtype} -> {np.dtype(dtype)}: {err:.2e}"
    with pytest.raises(InvalidInput, match="out_dtype"):
        model.forward(x16, out_dtype=np.int32)


def test_params_and_optimizer_state_round_trip(backend, cache):
    rng = np.random.default_rng(9)
    spec = bench_spec("S")
    model, _ = make_pair(backend, cache, spec, rng)
    x = rng.standard_normal((64, spec.n_input_dims), dtype=np.float32)
    y = rng.standard_normal((64, spec.n_output_dims), dtype=np.float32)
    model.train_step(x, y, steps=3)
    params, state = model.get_params(), model.get_optimizer_state()
    other = backend.compile(spec, variant="mma", cache=cache)
    other.set_params(params)
    other.set_optimizer_state(state)
    a = model.train_step(x, y, steps=2)
    b = other.train_step(x, y, steps=2)
    assert np.array_equal(a, b)


def test_cache_hit_compiles_nothing(backend, tmp_path, monkeypatch):
    from mmad.backends.cuda import mma

    cache = KernelCache(tmp_path)
    spec = bench_spec("S", activation="Sine")
    backend.compile(spec, variant="mma", cache=cache).wait_for_training_kernels()
    assert cache.stats.misses == 2  # the serving and the training module

    def no_compiler(*args, **kwargs):
        raise AssertionError("NVRTC was called on a cache hit")

    monkeypatch.setattr(mma, "nvrtc_compile", no_compiler)
    model = backend.compile(spec, variant="mma", cache=cache)
    model.wait_for_training_kernels()
    assert cache.stats.hits == 2
    x = np.random.default_rng(1).standard_normal((10, spec.n_input_dims), dtype=np.float32)
    assert np.isfinite(model.forward(x)).all()


def test_compile_error_names_the_model_and_shows_the_log(backend, tmp_path, monkeypatch):
    from mmad.backends.cuda import mma

    monkeypatch.setattr(mma, "read_source", lambda path: "this is not CUDA;\n")
    with pytest.raises(CompileError) as info:
        backend.compile(bench_spec("S"), variant="mma", cache=KernelCache(tmp_path))
    text = str(info.value)
    assert "model" in text and "error" in text.lower() and "this is not CUDA" in text


# -- the cublaslt variant (nvmath-python): ReLU through the RELU_BIAS epilog, other activations
# through fp32 accumulators and the element-wise kernels
LT_CASES = [("W", "ReLU"), ("M", "Tanh"), ("S", "Sine")]


@pytest.fixture(scope="module")
def lt_backend(backend):
    rows = {r.variant: r for r in backend.probe()}
    if not rows["cublaslt"].available:
        pytest.skip(f"the cuda cublaslt variant is unavailable here: {rows['cublaslt'].reason}")
    return backend


@pytest.mark.parametrize(("name", "activation"), LT_CASES)
def test_cublaslt_forward_and_gradients(lt_backend, cache, name, activation):
    rng = case_rng(name, activation, "lt")
    spec = bench_spec(name, activation=activation)
    model, oracle = make_pair(lt_backend, cache, spec, rng, variant="cublaslt")
    assert model.variant == "cublaslt"
    for batch in (1, 7, 1000, 65_537):
        x = inputs(rng, batch, spec)
        err = rel_err(model.forward(x), oracle.forward(x))
        assert err <= FWD_TOL, f"cublaslt {name}/{activation}/batch {batch}: forward rel. err {err:.2e}"
    x = inputs(rng, 1000, spec)
    y = rng.standard_normal((1000, spec.n_output_dims), dtype=np.float32)
    # ReLU layers take the RELU_BIAS epilog's fp16 bias, a rounding the emulation does not make:
    # (W0 of model W measured 1.24e-2 from the emulation on the H100)
    check_grads(model, oracle, x, y, f"cublaslt {name}/{activation}",
                vs_emulate=2e-2 if activation == "ReLU" else GRAD_TOL_EMULATE)


def test_cublaslt_device_outputs_do_not_alias(lt_backend, cache):
    """Without an output activation the forward hands back the matmul's own result: two calls on
    device arrays must still give two independent outputs."""
    import cupy as cp

    rng = np.random.default_rng(17)
    spec = bench_spec("M")
    model, oracle = make_pair(lt_backend, cache, spec, rng, variant="cublaslt")
    x1, x2 = inputs(rng, 3000, spec), inputs(rng, 3000, spec)
    out1 = model.forward(cp.asarray(x1))
    out2 = model.forward(cp.asarray(x2))
    assert out1.flags.c_contiguous and out1.shape == (3000, spec.n_output_dims)
    assert rel_err(cp.asnumpy(out1), oracle.forward(x1)) <= FWD_TOL
    assert rel_err(cp.asnumpy(out2), oracle.forward(x2)) <= FWD_TOL


def test_cublaslt_follows_the_oracle_for_200_steps(lt_backend, cache):
    rng = np.random.default_rng(21)
    spec = bench_spec("S", activation="SiLU")
    model, oracle = make_pair(lt_backend, cache, spec, rng, variant="cublaslt")
    x = inputs(rng, 512, spec)
    y = np.tanh(x @ (rng.standard_normal((spec.n_input_dims, spec.n_output_dims)) / 6)).astype(np.float32)
    losses, ref = model.train_step(x, y, steps=200), oracle.train_step(x, y, steps=200)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert abs(losses[-1] - ref[-1]) <= 0.05 * ref[-1], f"final loss {losses[-1]} vs oracle {ref[-1]}"


# -- the pairs: cublaslt's training, mma-f16acc's or wgmma's forward
SPLIT_CASES = [("mma-f16acc+cublaslt", "L", "ReLU"), ("mma-f16acc+cublaslt", "M", "Tanh"),
               ("wgmma+cublaslt", "L", "ReLU"), ("wgmma+cublaslt", "M", "Tanh"),
               ("wgmma+cublaslt", "W", "ReLU")]  # W: wgmma forwards (streamed weights), no wgmma training


@pytest.mark.parametrize(("variant", "name", "activation"), SPLIT_CASES)
def test_split_variant_trains_as_cublaslt_and_forwards_as_its_forward_variant(lt_backend, cache, variant, name,
                                                                              activation):
    """Its losses and parameters after training are cublaslt's bit for bit; every forward (fp32
    and fp16 out, host and device inputs, a group, before and after training) is bit for bit
    that of a model of its forward variant holding the same parameters, and within tolerance of
    float64."""
    import cupy as cp

    rows = {r.variant: r for r in lt_backend.probe()}
    if not rows[variant].available:
        pytest.skip(f"cuda:{variant} is unavailable here: {rows[variant].reason}")
    rng = case_rng(variant, name, activation, "split")
    spec = bench_spec(name, activation=activation)
    split, oracle = make_pair(lt_backend, cache, spec, rng, variant=variant)
    assert split.variant == variant
    lt = lt_backend.compile(spec, variant="cublaslt", cache=cache)
    # the forward variant's kernels on a model of their own (wgmma's forwards: wgmma+mma, which
    # takes every model whose forward fits)
    served = lt_backend.compile(spec, variant={"wgmma": "wgmma+mma"}.get(SPLIT_VARIANTS[variant],
                                                                          SPLIT_VARIANTS[variant]), cache=cache)
    lt.set_params(split.get_params())

    def forwards_agree(label):
        served.set_params(split.get_params())
        oracle.set_params(split.get_params())
        x = inputs(rng, 1000, spec)
        out = split.forward(x)
        np.testing.assert_array_equal(out, served.forward(x), err_msg=label)
        assert rel_err(out, oracle.forward(x)) <= FWD_TOL, label
        x16 = cp.asarray(x).astype(cp.float16)
        ref16 = cp.asnumpy(served.forward(x16, out_dtype=np.float16))
        np.testing.assert_array_equal(cp.asnumpy(split.forward(x16, out_dtype=np.float16)), ref16, err_msg=label)
        # the daemon's paths: a group of device pairs, and host rows into a host array
        grouped, ref_grouped = (cp.empty((1000, spec.n_output_dims), dtype=cp.float16) for _ in range(2))
        nonfinite = cp.zeros(1, dtype=cp.uint32)
        split.forward_group([(x16, grouped)], nonfinite)
        served.forward_group([(x16, ref_grouped)])
        np.testing.assert_array_equal(cp.asnumpy(grouped), cp.asnumpy(ref_grouped), err_msg=label)
        assert int(nonfinite[0]) == 0
        to_host = np.empty((1000, spec.n_output_dims), dtype=np.float16)
        split.forward_to_host(cp.asnumpy(x16), to_host)
        np.testing.assert_array_equal(to_host, ref16, err_msg=label)

    forwards_agree("before training")
    for steps in (1, 4):  # the forward between the calls serves each call's result
        x = inputs(rng, 2048, spec)
        y = rng.standard_normal((2048, spec.n_output_dims), dtype=np.float32)
        np.testing.assert_array_equal(split.train_step(x, y, steps=steps), lt.train_step(x, y, steps=steps))
        for key, value in lt.get_params().items():
            np.testing.assert_array_equal(split.get_params()[key], value, err_msg=key)
        forwards_agree(f"after {steps} step(s)")
    for model in (lt, served):
        model.close()
