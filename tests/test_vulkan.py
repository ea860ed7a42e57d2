"""vulkan backend against the float64 cpu oracle, on whatever Vulkan device is present.

CI runs these on Mesa lavapipe (simt only: lavapipe has no cooperative matrices); on a GPU
host the same tests run every available variant (``MMAD_TEST_VULKAN_VARIANTS=simt,coopmat,coopmat2``
narrows the set). Every test runs with ``gc.collect()`` around it so that a cffi lifetime bug
(a nested struct freed before the driver reads it) shows up as a failure here, not in serving.

Tolerances (docs/design.md): forward fp16 ≤ 3e-3 and fp32 ≤ 1e-5 relative to float64. Gradients
carry the contract's fp16 rounding of every layer's delta (loss-scaled), which at small
magnitudes costs more than the forward's rounding: they are checked against the cpu oracle's
``emulate`` mode (same rounding points) at ≤ 1e-2 and against float64 at ≤ 5e-2.
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

from mmad.backends.cache import KernelCache
from mmad.backends.cpu import CpuBackend
from mmad.errors import CompileError, InvalidInput, LaunchError, SpecError
from mmad.spec import ACTIVATIONS, LOSSES, MLPSpec, bench_spec

vulkan = pytest.importorskip("mmad.backends.vulkan", reason="the vulkan Python package is not installed")

pytestmark = pytest.mark.vulkan

FWD_TOL = 3e-3
GRAD_TOL_EMULATE = 1e-2
GRAD_TOL_FLOAT64 = 5e-2


@pytest.fixture(scope="module")
def backend():
    b = vulkan.VulkanBackend()
    rows = {r.variant: r for r in b.probe()}
    if not rows["simt"].available:
        pytest.skip(f"no usable Vulkan device: {rows['simt'].reason}")
    compile_model = b.compile

    def compile_or_skip(spec, variant=None, *args, **kwargs):
        """coopmat2 runs widths in multiples of its shapes only (32 on NVIDIA): a test model it
        refuses by name skips on coopmat2 with the reason (tests/test_vulkan_coopmat2.py tests the
        refusal itself)."""
        try:
            return compile_model(spec, variant, *args, **kwargs)
        except SpecError as exc:
            if variant == "coopmat2" and exc.field == "network.n_neurons":
                pytest.skip(f"vulkan:coopmat2 refuses this test model: {exc}")
            raise

    b.compile = compile_or_skip
    yield b
    b.close()


def _variants() -> list[str]:
    wanted = os.environ.get("MMAD_TEST_VULKAN_VARIANTS", "simt,coopmat,coopmat2").split(",")
    return [v.strip() for v in wanted if v.strip()]


@pytest.fixture(scope="module", params=_variants())
def variant(request, backend):
    row = {r.variant: r for r in backend.probe()}[request.param]
    if not row.available:
        pytest.skip(f"vulkan {request.param} unavailable here: {row.reason}")
    return request.param


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return KernelCache(tmp_path_factory.mktemp("kernels"))


@pytest.fixture(autouse=True)
def collect_garbage():
    gc.collect()
    yield
    gc.collect()


_models: dict = {}


def model_for(backend, variant, cache, spec):
    """Compiled models are reused across tests (parameters reset) to keep CI time down."""
    key = (variant, spec.content_hash())
    if key not in _models:
        _models[key] = backend.compile(spec, variant, cache)
    m = _models[key]
    m.set_params(vulkan.init_params(spec))
    return m


def data(spec: MLPSpec, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed + rows)
    x = rng.uniform(-1, 1, (rows, spec.n_input_dims)).astype(np.float32)
    y = rng.uniform(-1, 1, (rows, spec.n_output_dims)).astype(np.float32)
    return x, y


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "NaN or Inf in the vulkan result"
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_grads(spec, model, x, y):
    loss, grads = model.loss_and_grads(x, y)
    loss64, grads64 = CpuBackend("float64").compile(spec).loss_and_grads(x, y)
    _, grads_emu = CpuBackend("emulate").compile(spec).loss_and_grads(x, y)
    assert abs(loss - loss64) <= 1e-3 * abs(loss64)
    for name in grads64:
        assert grads[name].shape == grads64[name].shape
        if np.linalg.norm(grads64[name]) == 0:
            continue
        assert rel(grads[name], grads_emu[name]) <= GRAD_TOL_EMULATE, name
        assert rel(grads[name], grads64[name]) <= GRAD_TOL_FLOAT64, name


# -- probe ---------------------------------------------------------------------------------
def test_probe_rows_describe_the_device(backend):
    rows = backend.probe()
    assert [r.variant for r in rows] == ["coopmat2", "coopmat", "simt"]
    for r in rows:
        assert r.backend == "vulkan" and r.device and r.api_version
        assert r.details["max_shared_bytes"] >= 16384 and r.details["subgroup_size"] >= 1
        assert r.available or r.reason
    coop2, coop, simt = rows
    assert simt.software == (simt.details["device_type"] == "cpu")
    # NVIDIA's workgroup-scope matrices and cooperative vectors: offered or not, used or why not
    for ext in vulkan.NV_COOPERATIVE_EXTENSIONS:
        note = coop.details[ext]
        assert note.startswith(("not offered by", "offered, not used: ", "offered, used by vulkan:coopmat2")), note
    assert coop.details["VK_NV_cooperative_matrix2"] == (
        "offered, used by vulkan:coopmat2" if coop2.available else
        f"not offered by {coop.device}" if "does not offer VK_NV_cooperative_matrix2" in coop2.reason
        else f"offered, not used: {coop2.reason}")
    assert coop.details["subgroup_size_control"].startswith(("required ", "the driver's"))


def test_glsl_extension_check():
    """The probe's reason for an unused NVIDIA extension asks the compiler itself."""
    glsl = pytest.importorskip("mmad.backends.vulkan.glsl")
    assert glsl.knows_extension("GL_KHR_cooperative_matrix")
    assert not glsl.knows_extension("GL_MMAD_no_such_extension")


@pytest.mark.parametrize("variant,setting", [("coopmat", "MMAD_VULKAN_COOPMAT"), ("coopmat2", "MMAD_VULKAN_COOPMAT2")])
def test_probe_honours_coopmat_switch(monkeypatch, variant, setting):
    monkeypatch.setenv(setting, "0")
    b = vulkan.VulkanBackend()
    row = {r.variant: r for r in b.probe()}[variant]
    assert not row.available and row.reason == f"disabled by {setting}=0"
    b.close()


# -- forward -------------------------------------------------------------------------------
FORWARD_CASES = [(m, r) for m in "SMLW" for r in (1, 7, 1000)] + [("S", 65537), ("M", 65537), ("L", 65537)]


@pytest.mark.parametrize("name,rows", FORWARD_CASES)
def test_forward_matches_float64_oracle(backend, variant, cache, name, rows):
    spec = bench_spec(name)
    model = model_for(backend, variant, cache, spec)
    x, _ = data(spec, rows)
    out = model.forward(x)
    assert out.shape == (rows, spec.n_output_dims) and out.dtype == np.float32
    assert rel(out, CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("where", ["hidden", "output"])
def test_every_activation_forward_and_backward(backend, variant, cache, activation, where):
    spec = bench_spec("S", **{"activation" if where == "hidden" else "output_activation": activation})
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 1000)
    assert rel(model.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL
    check_grads(spec, model, x, y)


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_value_and_gradient(backend, variant, cache, loss):
    spec = bench_spec("S", loss=loss, n_output_dims=3 if loss == "RelativeL2Luminance" else 16)
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 1000)
    check_grads(spec, model, x, y)


def test_odd_shapes_and_encodings(backend, variant, cache):
    doc = {"n_input_dims": 3, "n_output_dims": 5,
           "network": {"n_neurons": 48, "n_hidden_layers": 3, "activation": "SiLU", "output_activation": "Sigmoid"},
           "encoding": {"otype": "Composite", "nested": [
               {"otype": "Frequency", "n_frequencies": 4, "n_dims_to_encode": 2},
               {"otype": "OneBlob", "n_bins": 8}]}}
    spec = MLPSpec.from_json(doc)
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 333)
    x = (x + 1) / 2  # OneBlob expects [0, 1]
    assert rel(model.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL
    check_grads(spec, model, x, y)


def test_spherical_harmonics_and_triangle_wave(backend, variant, cache):
    """tiny-cuda-nn's parameter-free encodings, computed on the host (numerics.encode) before the
    upload as Frequency is: a direction through SphericalHarmonics degree 4 beside a triangle wave
    of the other two inputs; forward and gradients against the float64 oracle, and training."""
    doc = {"n_input_dims": 5, "n_output_dims": 3,
           "network": {"n_neurons": 32, "n_hidden_layers": 2, "activation": "ReLU"},
           "encoding": {"otype": "Composite", "nested": [
               {"otype": "SphericalHarmonics", "degree": 4, "n_dims_to_encode": 3},
               {"otype": "TriangleWave", "n_frequencies": 6}]}}
    spec = MLPSpec.from_json(doc)
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 400, seed=int(time.time_ns() % 2**31))
    x = (x + 1) / 2  # SphericalHarmonics reads directions mapped into [0, 1]
    direction = x[:, :3] * 2 - 1
    x[:, :3] = (direction / np.linalg.norm(direction, axis=1, keepdims=True) + 1) / 2
    assert rel(model.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL
    check_grads(spec, model, x, y)
    losses = model.train_step(x, y, 40)
    reference = CpuBackend("float64").compile(spec).train_step(x, y, 40)  # the same initial weights
    assert losses[-1] < 0.8 * losses[0]
    np.testing.assert_allclose(losses, reference, rtol=0.05)


def test_specialized_activation_and_loss_pipelines(backend, variant, cache, monkeypatch):
    """GPUs bake activations and loss into the pipeline; lavapipe reads push constants. Both
    paths run here (the one this device does not default to is forced)."""
    spec = bench_spec("S", activation="Sine", output_activation="Sigmoid", loss="L1", seed=11)
    default = "1" if backend.probe()[1].software else "0"
    monkeypatch.setenv("MMAD_VULKAN_SPECIALIZE", default)
    model = backend.compile(spec, variant, cache)
    try:
        x, y = data(spec, 500)
        assert rel(model.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL
        check_grads(spec, model, x, y)
    finally:
        model.close()


def test_fp32_precision_is_tight(backend, variant, cache):
    if variant in vulkan.COOPERATIVE:
        pytest.skip(f"precision fp32 runs no MMA; the {variant} variant is fp16 only")
    spec = bench_spec("M", precision="fp32")
    model = model_for(backend, variant, cache, spec)
    x, _ = data(spec, 777)
    assert rel(model.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= 1e-5


# -- backward ------------------------------------------------------------------------------
@pytest.mark.parametrize("name,rows", [("S", 1000), ("M", 1000), ("L", 1000), ("W", 1000), ("S", 65537),
                                       ("M", 7), ("S", 1)])
def test_gradients_match_oracle(backend, variant, cache, name, rows):
    spec = bench_spec(name)
    model = model_for(backend, variant, cache, spec)
    check_grads(spec, model, *data(spec, rows))


@pytest.mark.skipif(os.environ.get("MMAD_TEST_VULKAN_LARGE") != "1",
                    reason="2^20-row cases run on GPU hosts only (MMAD_TEST_VULKAN_LARGE=1)")
def test_batch_of_2_pow_20(backend, variant, cache):
    spec = bench_spec("M")
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 1 << 20)
    assert rel(model.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL
    check_grads(spec, model, x, y)


def test_training_in_row_chunks_matches_oracle(backend, variant, cache):
    """Batches whose buffers exceed maxStorageBufferRange train in row chunks (W at 2^20 rows
    on NVIDIA); a small cap forces that path here: 4 chunks, one step over all of them."""
    spec = bench_spec("M", seed=21)
    model = backend.compile(spec, variant, cache)
    try:
        model.max_chunk_rows = 256
        assert len(model._chunks(1024)) == 4
        x, y = data(spec, 1000)
        check_grads(spec, model, x, y)
        losses = model.train_step(x, y, steps=5)
        ref = CpuBackend("float64").compile(spec).train_step(x, y, steps=5)
        assert np.all(np.abs(losses - ref) <= 0.05 * ref)
    finally:
        model.close()


def test_stored_deltas_are_fp16_values(backend, variant, cache):
    """The contract rounds every delta to fp16 before it is stored: simt keeps them in fp32
    storage (r16), coopmat stores fp16 (the device's conversion rounds). Either way the output
    layer's stored deltas must be the fp16-rounded loss gradient of the oracle's prediction."""
    spec = bench_spec("M", seed=5)
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 1000)
    model.loss_and_grads(x, y)
    rows_pad = 1024  # ROW_ALIGN multiple: one chunk; the layers' deltas are blocks of rows_pad rows
    dtype = np.float16 if variant in vulkan.COOPERATIVE else np.float32
    assert model.geo.training_row_bytes()["d"] == model.geo.z_cols * np.dtype(dtype).itemsize
    raw = model._batch["d"].read(rows_pad * model.geo.z_cols * np.dtype(dtype).itemsize)
    d = np.frombuffer(raw, dtype).astype(np.float32)
    assert np.count_nonzero(d) > d.size // 10
    assert np.array_equal(d, d.astype(np.float16).astype(np.float32))
    # L2 loss, no output activation: delta = fp16(2 (pred - y) * loss_scale / (rows * outputs))
    pred = CpuBackend("emulate").compile(spec).forward(x)
    want = ((2 * spec.loss_scale / y.size) * (pred - y)).astype(np.float16).astype(np.float32)
    start = model.geo.offsets()["Z_COL"][-1] * rows_pad
    got = d[start:start + rows_pad * model.geo.out_pad].reshape(rows_pad, model.geo.out_pad)
    assert not got[1000:].any() and not got[:, spec.n_output_dims:].any(), "padding has deltas"
    assert rel(got[:1000, :spec.n_output_dims], want) <= 1e-2


@pytest.mark.parametrize("activation", ["ReLU", "LeakyReLU"])
def test_derivative_at_pre_activations_fp16_rounds_to_zero(backend, variant, cache, activation):
    """coopmat keeps no fp32 hidden pre-activations for these activations, only the fp16
    activation flagged with z's side of 0: a unit with 0 < z < 2^-25 (its fp16 activation is 0)
    must still pass gradients (ReLU' = 1), and one with z = +0 exactly must not (ReLU' = 0)."""
    spec = bench_spec("S", activation=activation, seed=3)
    model = model_for(backend, variant, cache, spec)
    params = vulkan.init_params(spec)
    params["W0"][:2] = 0.0
    params["b0"][:2] = [2.0 ** -26, 0.0]  # unit 0: tiny positive z; unit 1: z = 0 on every row
    model.set_params(params)
    x, y = data(spec, 1000)
    _, grads = model.loss_and_grads(x, y)
    oracle = CpuBackend("emulate").compile(spec)
    oracle.set_params(params)
    _, want = oracle.loss_and_grads(x, y)
    assert want["b0"][0] != 0 and abs(grads["b0"][0] - want["b0"][0]) <= 1e-2 * abs(want["b0"][0])
    assert abs(grads["b0"][1] - want["b0"][1]) <= 1e-2 * abs(want["b0"][0])
    if activation == "ReLU":
        assert grads["b0"][1] == 0 and want["b0"][1] == 0
    assert rel(grads["W0"][:2], want["W0"][:2]) <= GRAD_TOL_EMULATE


def test_gradients_are_deterministic(backend, variant, cache):
    spec = bench_spec("S")
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 5000)
    loss_a, grads_a = model.loss_and_grads(x, y)
    loss_b, grads_b = model.loss_and_grads(x, y)
    assert loss_a == loss_b
    for name in grads_a:
        assert np.array_equal(grads_a[name], grads_b[name]), name


# -- training ------------------------------------------------------------------------------
def follow_oracle(backend, variant, cache, spec, rows, steps, tol=0.05):
    model = model_for(backend, variant, cache, spec)
    model.set_optimizer_state(CpuBackend("fp32").compile(spec).get_optimizer_state())  # fresh: zeros, step 0
    ref = CpuBackend("float64").compile(spec)
    x, y = data(spec, rows, seed=7)
    losses = model.train_step(x, y, steps=steps)
    ref_losses = ref.train_step(x, y, steps=steps)
    assert losses.shape == (steps,) and np.isfinite(losses).all()
    assert np.all(np.abs(losses - ref_losses) <= tol * ref_losses), (losses[-5:], ref_losses[-5:])
    assert losses[-1] < 0.9 * losses[0], "training did not reduce the loss"
    assert model.get_optimizer_state()["step"][0] == steps
    return model, ref


@pytest.mark.parametrize("name,rows,steps", [("S", 256, 200), ("M", 128, 200), ("L", 64, 30), ("W", 16, 10)])
def test_adam_follows_oracle_loss_curve(backend, variant, cache, name, rows, steps):
    # the loss curve is the criterion (docs/design.md): with epsilon 1e-15 Adam moves every weight by
    # about lr per step whatever its gradient's size, so weights whose gradients are pure rounding
    # noise wander differently in fp16 and float64 without changing the loss
    follow_oracle(backend, variant, cache, bench_spec(name), rows, steps)


def test_sgd_with_momentum_and_l2(backend, variant, cache):
    spec = bench_spec("S", optimizer={"otype": "SGD", "learning_rate": 0.5, "momentum": 0.9, "l2_reg": 1e-4})
    follow_oracle(backend, variant, cache, spec, 200, 40)


def test_adam_with_l2_and_huber(backend, variant, cache):
    spec = bench_spec("S", loss="Huber",
                      optimizer={"otype": "Adam", "learning_rate": 1e-2, "l2_reg": 1e-3, "beta2": 0.999})
    follow_oracle(backend, variant, cache, spec, 100, 50)


# -- state, device arrays, lifetime --------------------------------------------------------
def test_optimizer_state_round_trip_resumes_exactly(backend, variant, cache):
    spec = bench_spec("S")
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 300)
    model.set_optimizer_state(CpuBackend("fp32").compile(spec).get_optimizer_state())
    model.train_step(x, y, steps=3)
    params, state = model.get_params(), model.get_optimizer_state()
    after = model.train_step(x, y, steps=2)
    model.set_params(params)
    model.set_optimizer_state(state)
    again = model.train_step(x, y, steps=2)
    assert np.array_equal(after, again)
    assert state["step"][0] == 3


def test_params_round_trip_and_validation(backend, variant, cache):
    spec = bench_spec("S")
    model = model_for(backend, variant, cache, spec)
    rng = np.random.default_rng(3)
    params = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in model.get_params().items()}
    model.set_params(params)
    got = model.get_params()
    assert all(np.array_equal(got[k], params[k]) for k in params)
    with pytest.raises(InvalidInput):
        model.set_params({**params, "W0": params["W0"][:, :3]})
    with pytest.raises(InvalidInput):
        model.forward(np.zeros((4, spec.n_input_dims + 1), np.float32))
    with pytest.raises(InvalidInput):
        model.train_step(*data(spec, 4), steps=0)


def test_device_arrays_stay_on_device(backend, variant, cache):
    spec = bench_spec("M")
    model = model_for(backend, variant, cache, spec)
    x, y = data(spec, 999)

    def round_trip() -> int:
        """Upload, forward and train on device arrays, free them; the bytes held meanwhile."""
        dx = model.upload(x)
        dy = model.upload_target(y)
        out = model.forward(dx)
        assert isinstance(out, vulkan.VulkanArray) and out.shape == (999, spec.n_output_dims)
        assert np.array_equal(model.download(out), model.forward(x))
        assert np.allclose(model.download(dx), x)
        assert np.isfinite(model.train_step(dx, dy, steps=1)).all()
        held = model.device_bytes()
        for a in (dx, dy, out):
            a.free()
        return held

    # the first round may grow the model's own batch buffers (grown, never shrunk; their size
    # depends on which tests ran on this model before): what must not grow is the second round
    round_trip()
    before = model.device_bytes()
    assert round_trip() > before  # the device arrays were on the device
    assert model.device_bytes() == before  # and freeing them gave every byte back


@pytest.mark.parametrize("n_in", [32, 5])  # bench S's input, and one the kernels pad to 16 columns
def test_fp16_device_arrays(backend, variant, cache, n_in):
    """float16 rows uploaded stay float16 on the device and ``forward(..., out_dtype=float16)``
    writes an fp16 device output (the cuda backend's fp16 I/O): the kernels round every input to
    fp16 anyway, so the fp16 forward equals the float32 forward with its output rounded to fp16,
    bit for bit, and training on fp16 device rows equals training on the same values as float32."""
    spec = bench_spec("S").replace(n_input_dims=n_in)
    model = model_for(backend, variant, cache, spec)
    rng = np.random.default_rng()
    x16 = rng.uniform(-1, 1, (700, n_in)).astype(np.float16)
    y = rng.uniform(-1, 1, (700, spec.n_output_dims)).astype(np.float32)
    dx = model.upload(x16)
    assert dx.dtype == np.float16 and dx.buffer.size == dx.rows_pad * dx.padded_cols * 2  # 2 bytes a value
    np.testing.assert_array_equal(model.download(dx), x16)
    out = model.forward(dx, out_dtype=np.float16)
    assert isinstance(out, vulkan.VulkanArray) and out.dtype == np.float16
    got = model.download(out)
    assert got.dtype == np.float16 and got.shape == (700, spec.n_output_dims)
    want32 = model.forward(x16.astype(np.float32))
    np.testing.assert_array_equal(got, want32.astype(np.float16))
    assert rel(got, CpuBackend("float64").compile(spec).forward(x16.astype(np.float64))) <= FWD_TOL
    np.testing.assert_array_equal(model.download(model.forward(dx)), want32)  # fp16 in, fp32 out
    again = model.forward(dx, out_dtype=np.float16)
    model.forward_into(dx, again).run(times=2)  # the recorded fp16 program, re-submitted
    np.testing.assert_array_equal(model.download(again), got)
    loss16, grads16 = model.loss_and_grads(dx, y)
    loss32, grads32 = model.loss_and_grads(x16.astype(np.float32), y)
    assert loss16 == loss32 and all(np.array_equal(grads16[k], grads32[k]) for k in grads32)
    for a in (dx, out, again):
        a.free()


def test_encoded_inputs_are_stored_as_float32(backend, cache):
    """An encoding's output is float32 whatever the rows were sent as: an encoded model's device
    input is float32 (its fp16 output still comes back fp16)."""
    spec = MLPSpec.from_json({"n_input_dims": 3, "n_output_dims": 2, "network": {"n_neurons": 32, "n_hidden_layers": 1},
                              "encoding": {"otype": "Frequency", "n_frequencies": 4}})
    model = model_for(backend, "simt", cache, spec)
    x16 = np.random.default_rng().uniform(-1, 1, (300, 3)).astype(np.float16)
    dx = model.upload(x16)
    assert dx.dtype == np.float32
    out = model.download(model.forward(dx, out_dtype=np.float16))
    np.testing.assert_array_equal(out, model.forward(x16.astype(np.float32)).astype(np.float16))


def test_gpu_timestamps_time_every_dispatch(backend, variant, cache):
    spec = bench_spec("S", seed=7)
    model = backend.compile(spec, variant, cache)
    try:
        with pytest.raises(InvalidInput):
            model.gpu_times("forward")  # nothing has run yet
        x, y = data(spec, 300)
        dx = model.upload(x)
        out = model.forward(dx)
        model.set_gpu_timestamps(True)
        model.forward_into(dx, out).run(times=3)
        fwd = model.gpu_times("forward")
        assert [k for k, _ in fwd] == [f"{variant}/forward"] and fwd[0][1] > 0
        model.train_step(dx, model.upload_target(y), steps=2)
        train = model.gpu_times("train")
        kernels = [k.split("/")[1] for k, _ in train]
        n_layers = spec.n_hidden_layers + 1
        # the cooperative variants: a training pipeline of their own
        first = "forward_train" if variant in vulkan.COOPERATIVE else "forward"
        assert kernels == [first, "backward"] + ["wgrad"] * n_layers + ["finalize", "optimizer"]
        assert all(t >= 0 for _, t in train) and sum(t for _, t in train) > 0
        model.set_gpu_timestamps(False)
        model.forward_into(dx, out)
        with pytest.raises(vulkan.vr.LaunchError):  # recorded without timestamps
            model.gpu_times("forward")
    finally:
        model.close()


def test_fp16_conversion_probe(backend, cache):
    """The probe's values tell round-to-nearest-even from truncation and from ties-away; the
    device's answer is what the coopmat kernels are specialised with."""
    x = vulkan.conversion_probe_values()
    with np.errstate(over="ignore"):
        rne = x.astype(np.float16).view(np.uint16)
        bits = x.view(np.uint32)
        toward_zero = (bits & 0xFFFFE000).view(np.float32).astype(np.float16).view(np.uint16)
        ties_away = ((bits + 0x1000) & 0xFFFFE000).view(np.float32).astype(np.float16).view(np.uint16)
    assert not np.array_equal(toward_zero, rne) and not np.array_equal(ties_away, rne)
    device = backend._open_device(0)
    rounds_rne = vulkan.fp16_conversion_is_rne(device, cache)
    if device.info.software or "NVIDIA" in device.info.name:
        assert rounds_rne  # LLVM (lavapipe) and NVIDIA's driver (measured) convert with RNE


SUBGROUP_PROBE = """#version 450
#extension GL_KHR_shader_subgroup_basic : require
layout(local_size_x = 64) in;
layout(std430, binding = 0) writeonly buffer Out { uint SIZES[]; };
void main() {
    if (gl_LocalInvocationID.x == 0u) { SIZES[0] = gl_SubgroupSize; SIZES[1] = gl_NumSubgroups; }
}
"""


def test_pipelines_require_the_probed_subgroup_size(backend, cache):
    """Where the device lets a pipeline require its subgroup size (VK_EXT_subgroup_size_control,
    core in 1.3: lavapipe and NVIDIA do), a pipeline asked for the probed size runs with it, in
    full subgroups (the coopmat kernels count subgroups by it); a size outside the device's range
    is not required (the driver's choice)."""
    device = backend._open_device(0)
    info = device.info
    if info.subgroup_size_range is None:
        pytest.skip(f"{info.name} cannot require a compute pipeline's subgroup size")
    lo, hi = info.subgroup_size_range
    assert lo <= info.subgroup_size <= hi
    spirv = vulkan.build_spirv(SUBGROUP_PROBE, "subgroup probe", cache, info.name)
    for asked, required in ((info.subgroup_size, info.subgroup_size), (hi * 2, None)):
        pipeline = vulkan.vr.Pipeline(device, spirv, 1, 0, name="subgroup-probe", subgroup_size=asked)
        out = device.buffer(16)
        program = None
        try:
            assert pipeline.subgroup_size == required
            program = vulkan.vr.Program(device, [vulkan.vr.Dispatch(pipeline, [out], b"", (1, 1, 1))])
            program.run()
            size, count = np.frombuffer(out.read(8), np.uint32)
            if required:
                assert (size, count) == (required, 64 // required)
        finally:
            if program is not None:
                program.destroy()
            out.free()
            pipeline.destroy()
    assert {"forward", "backward", "wgrad"} <= set(vulkan.SUBGROUP_SIZED["coopmat"])


def test_close_frees_and_refuses_further_use(backend, variant, cache):
    spec = bench_spec("S", seed=99)
    device = backend._open_device(0)
    device.staging(1)  # the device's staging buffer lives as long as the device (a first forward makes it)
    start = device.bytes_allocated
    model = backend.compile(spec, variant, cache)
    model.forward(data(spec, 10)[0])
    assert device.bytes_allocated > start
    model.close()
    assert device.bytes_allocated == start
    with pytest.raises(LaunchError):
        model.forward(data(spec, 10)[0])


def test_backend_close_closes_its_models(variant, cache):
    backend = vulkan.VulkanBackend()
    spec = bench_spec("S")
    model = backend.compile(spec, variant, cache)
    model.forward(data(spec, 3)[0])
    backend.close()
    with pytest.raises(LaunchError):
        model.forward(data(spec, 3)[0])
    model.close()  # a second close is harmless


def test_kernel_cache_hit_skips_the_compiler(backend, variant, tmp_path):
    cache = KernelCache(tmp_path)
    spec = bench_spec("S", seed=5)
    backend.compile(spec, variant, cache).close()
    misses = cache.stats.misses
    backend.compile(spec, variant, cache).close()
    assert cache.stats.misses == misses and cache.stats.hits >= 5


def test_compile_errors_carry_log_and_numbered_source():
    from mmad.backends.vulkan.glsl import compile_glsl
    source = "#version 450\nlayout(local_size_x = 1) in;\nvoid main() { undefined_thing = 1; }\n"
    with pytest.raises(CompileError) as info:
        compile_glsl(source, "broken kernel")
    text = str(info.value)
    assert "undefined_thing" in info.value.log and "    3  void main()" in text


def test_out_of_device_memory_is_a_launch_error(backend, variant):
    device = backend._open_device(0)
    before = device.bytes_allocated
    with pytest.raises(LaunchError, match="VK_ERROR_OUT_OF_(DEVICE|HOST)_MEMORY"):
        device.buffer(1 << 46)  # 64 TiB
    assert device.bytes_allocated == before


def test_bf16_and_oversized_layers_are_refused(backend, variant, cache):
    with pytest.raises(SpecError):
        backend.compile(bench_spec("S", precision="bf16"), variant, cache)
    with pytest.raises(SpecError):
        backend.compile(bench_spec("S", n_output_dims=4096), variant, cache)


def test_memory_type_choice_prefers_cached_host_memory_for_staging():
    """Staging (read back by the CPU) takes HOST_CACHED memory where a type offers it; buffers
    that are only written by the host keep the first coherent type; device-local stays device-local.
    The types below are NVIDIA's order: uncached host-visible memory comes before cached."""
    from types import SimpleNamespace

    from mmad.backends.vulkan.runtime import Device

    fake = SimpleNamespace(memory_types=[(0x1, 0), (0x2 | 0x4, 1), (0x2 | 0x4 | 0x8, 1)],
                           info=SimpleNamespace(name="fake"))
    assert Device.memory_type(fake, 0b111, host_visible=True, cached=True) == 2
    assert Device.memory_type(fake, 0b111, host_visible=True) == 1
    assert Device.memory_type(fake, 0b111, host_visible=False) == 0
    assert Device.memory_type(fake, 0b011, host_visible=True, cached=True) == 1  # no cached type allowed
    with pytest.raises(LaunchError, match="no suitable memory type"):
        Device.memory_type(fake, 0b000, host_visible=True, cached=True)


def test_staging_buffer_is_host_cached_where_offered(backend):
    model = backend.compile(bench_spec("S"), variant="simt")
    with model:
        device = model.device
        staging = device.staging(1 << 20)
        offered = any(flags & 0xE == 0xE for flags, _ in device.memory_types)
        assert (device.memory_type_flags(staging) & 0xE == 0xE) == offered
        x = np.random.default_rng().uniform(-1, 1, (5000, 32)).astype(np.float32)
        out = np.empty((5000, 16), np.float32)
        model.forward_to_host(x, out)  # reads back through it
        assert np.array_equal(out, model.forward(x))


@pytest.mark.parametrize("n_in", [3, 32])
@pytest.mark.parametrize(("in_dtype", "out_dtype"), [(np.float16, np.float16), (np.float32, np.float32),
                                                     (np.float16, np.float32), (np.float32, np.float16)])
def test_forward_to_host_equals_forward(backend, variant, cache, n_in, in_dtype, out_dtype):
    """The staged forward_to_host (rows converted straight into and out of mapped memory, padded
    columns and rows zeroed) gives forward's result bit for bit, with and without threads."""
    from concurrent.futures import ThreadPoolExecutor

    spec = MLPSpec.from_json({**bench_spec("S").to_json(), "n_input_dims": n_in})
    rng = np.random.default_rng()
    with backend.compile(spec, variant=variant, cache=cache) as model:
        for rows in (1, 1000, 9000):
            x = rng.uniform(-1, 1, (rows, n_in)).astype(in_dtype)
            want = model.forward(x.astype(np.float32)).astype(out_dtype)
            out = np.full((rows, spec.n_output_dims), np.nan, out_dtype)
            model.forward_to_host(x, out)
            assert np.array_equal(out, want), (rows, n_in)
            with ThreadPoolExecutor(3) as pool:
                out[...] = np.nan
                model.forward_to_host(x, out, pool)
            assert np.array_equal(out, want), (rows, n_in, "threads")
        bad = rng.uniform(-1, 1, (9000, n_in)).astype(in_dtype)
        bad[-1, 0] = np.nan
        from mmad.errors import NonFiniteInput
        with pytest.raises(NonFiniteInput):
            model.forward_to_host(bad, np.empty((9000, spec.n_output_dims), out_dtype), check_finite=True)
