"""wgpu backend against the cpu float64 oracle (docs/design.md tolerances), on whatever adapter wgpu finds.

In CI that is Mesa lavapipe (a CPU Vulkan driver); on the GPU host, NVIDIA's Vulkan driver.
Gradients of fp16 models are compared twice: with the cpu backend's ``emulate`` mode (the same
rounding points, so they must agree closely) and with float64, where they may differ by no more
than fp16 rounding itself makes the emulating oracle differ (plus the forward tolerance).
"""

from __future__ import annotations

import numpy as np
import pytest

from mmad.backends.cpu import CpuBackend
from mmad.errors import CompileError, InvalidInput, LaunchError
from mmad.spec import ACTIVATIONS, LOSSES, MLPSpec, OptimizerSpec, bench_spec
from test_optimizers import _wgpu_backend

FWD_TOL = {"fp32": 1e-5, "fp16": 3e-3, "bf16": 2e-2}
GRAD_VS_EMULATE = 2e-3


@pytest.fixture(scope="module")
def backend():
    be, _ = _wgpu_backend()
    yield be
    be.close()


_models: dict = {}


def compiled(backend, spec: MLPSpec):
    key = (id(backend), spec.content_hash())
    if key not in _models:
        _models[key] = backend.compile(spec)
    return _models[key]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    assert np.isfinite(a).all(), "NaN/Inf in the wgpu result"
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def data(spec: MLPSpec, rows: int, seed: int = 0, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, spec.n_input_dims)) * scale).astype(np.float32)
    y = rng.standard_normal((rows, spec.n_output_dims)).astype(np.float32)
    return x, y


def check_grads(spec: MLPSpec, grads: dict, x: np.ndarray, y: np.ndarray, loss: float) -> None:
    ref_loss, ref = CpuBackend("float64").compile(spec).loss_and_grads(x, y)
    emu_loss, emu = CpuBackend("emulate").compile(spec).loss_and_grads(x, y)
    assert abs(loss - ref_loss) <= FWD_TOL[spec.precision] * abs(ref_loss) + 1.25 * abs(emu_loss - ref_loss)
    for name, g in grads.items():
        assert g.shape == ref[name].shape
        inherent = float(np.linalg.norm(emu[name] - ref[name]) / np.linalg.norm(ref[name]))
        assert rel(g, ref[name]) <= FWD_TOL[spec.precision] + 1.25 * inherent, name
        if spec.precision != "fp32":
            assert rel(g, emu[name]) <= GRAD_VS_EMULATE, name


def test_probe(backend):
    row = backend.probe()[0]
    assert (row.backend, row.variant, row.available) == ("wgpu", "default", True)
    assert row.api_version.startswith("wgpu-native ")
    assert row.device and row.details["backend_type"]
    assert row.details["limits"]["max-compute-workgroup-storage-size"] >= 16384
    assert row.details["f16"] == ("shader-f16" in row.details["features"])
    assert row.details["cooperative_matrix"].startswith(
        "offered (8x8 f32)" if "cooperative-matrix" in row.details["features"] else "cooperative-matrix not offered")
    cpu_adapter = row.details["adapter_type"] == "CPU" or "llvmpipe" in row.device.lower()
    assert row.software == cpu_adapter


@pytest.mark.parametrize("model", ["S", "M", "L", "W"])
def test_forward_bench_models(backend, model):
    spec = bench_spec(model)
    m = compiled(backend, spec)
    ref = CpuBackend("float64").compile(spec)
    for rows in (1, 7, 1000, 65537):
        x, _ = data(spec, rows, seed=rows)
        out = m.forward(x)
        assert out.shape == (rows, spec.n_output_dims) and out.dtype == np.float32
        assert rel(out, ref.forward(x)) <= FWD_TOL["fp16"], rows


@pytest.mark.parametrize("model,rows", [("S", 1000), ("M", 1000), ("L", 1000), ("W", 1000), ("S", 65537)])
def test_backward_bench_models(backend, model, rows):
    spec = bench_spec(model)
    x, y = data(spec, rows, seed=7)
    loss, grads = compiled(backend, spec).loss_and_grads(x, y)
    check_grads(spec, grads, x, y, loss)


# Every distinct spec is a new shader, and lavapipe's LLVM takes seconds per fused pipeline: the
# activation, loss, precision and encoding checks use a small network and pair the activations
# (hidden, output) so that CI stays within its time budget.
def small_spec(**network) -> MLPSpec:
    net = {"n_neurons": 16, "n_hidden_layers": 1, "activation": "SiLU", "output_activation": "None"}
    net.update(network)
    return MLPSpec.from_json({"n_input_dims": 8, "n_output_dims": 4, "network": net})


ACTIVATION_PAIRS = list(zip(ACTIVATIONS[:5], ACTIVATIONS[5:]))


@pytest.mark.parametrize("hidden,output", ACTIVATION_PAIRS + [(b, a) for a, b in ACTIVATION_PAIRS[:1]])
def test_activations(backend, hidden, output):
    spec = small_spec(activation=hidden, output_activation=output)
    # exp of exp overflows fp16 for unit-scale inputs; keep the network in range
    x, y = data(spec, 1000, seed=3, scale=0.1 if "Exponential" in (hidden, output) else 1.0)
    m = compiled(backend, spec)
    assert rel(m.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL["fp16"]
    loss, grads = m.loss_and_grads(x, y)
    check_grads(spec, grads, x, y, loss)


def test_every_activation_is_covered():
    covered = {a for pair in ACTIVATION_PAIRS for a in pair}
    assert covered == set(ACTIVATIONS)


@pytest.mark.parametrize("loss_name", LOSSES)
def test_losses(backend, loss_name):
    doc = small_spec(activation="Tanh").to_json()
    doc["loss"] = {"otype": loss_name, "delta": 0.5} if loss_name == "Huber" else {"otype": loss_name}
    spec = MLPSpec.from_json(doc)
    x, y = data(spec, 1000, seed=4)
    loss, grads = compiled(backend, spec).loss_and_grads(x, y)
    check_grads(spec, grads, x, y, loss)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_precisions(backend, precision):
    spec = small_spec().replace(precision=precision)
    x, y = data(spec, 1000, seed=5)
    m = compiled(backend, spec)
    assert rel(m.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL[precision]
    loss, grads = m.loss_and_grads(x, y)
    check_grads(spec, grads, x, y, loss)


def test_emulated_fp16_storage(backend):
    """fp16 without native f16 (f32 storage, rounding in the shader) matches the same contract."""
    from mmad.backends.webgpu import WgpuBackend

    be = WgpuBackend(native_f16=False)
    spec = small_spec(n_neurons=32, n_hidden_layers=2)
    with be.compile(spec) as m:
        assert m.storage == "f32"
        x, y = data(spec, 1000, seed=6)
        emu = CpuBackend("emulate").compile(spec)
        # same rounding points as the emulation; a different f32 summation order (FMA contraction on
        # NVIDIA) tips an occasional value across an fp16 rounding boundary: 1.5e-5 on an H200
        assert rel(m.forward(x), emu.forward(x)) <= 1e-4
        loss, grads = m.loss_and_grads(x, y)
        check_grads(spec, grads, x, y, loss)
    be.close()


def test_whole_layer_staging(backend):
    """The hardware-adapter tiling (whole layers staged in workgroup memory) on any adapter."""
    from mmad.backends.webgpu import WgpuBackend

    be = WgpuBackend(max_stage_rows=4096)
    spec = bench_spec("S")
    with be.compile(spec) as m:
        assert max(stage.kc for stage in m.plan.fwd) > 16
        x, y = data(spec, 1000, seed=9)
        assert rel(m.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL["fp16"]
        loss, grads = m.loss_and_grads(x, y)
        check_grads(spec, grads, x, y, loss)
    be.close()


ENCODINGS = {
    "parts": {"otype": "Composite", "nested": [{"otype": "Identity", "n_dims_to_encode": 1},
                                               {"otype": "Frequency", "n_frequencies": 6, "n_dims_to_encode": 2},
                                               {"otype": "OneBlob", "n_bins": 8}]},
    # tiny-cuda-nn's Composite rules: parts read from dims_to_encode_begin; Identity's scale/offset
    "begin": {"otype": "Composite", "nested": [{"otype": "OneBlob", "n_bins": 16, "n_dims_to_encode": 3,
                                                "dims_to_encode_begin": 1},
                                               {"otype": "Identity", "scale": 0.5, "offset": -0.25,
                                                "n_dims_to_encode": 2, "dims_to_encode_begin": 0}]},
    "oneblob": {"otype": "OneBlob", "n_bins": 4},
}


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_encodings(backend, name):
    """Identity, Frequency and OneBlob (numerics.encode's definitions, tiny-cuda-nn's, applied on
    the host before the upload), on inputs in [0, 1], at its edges and outside it (OneBlob wraps
    around)."""
    spec = MLPSpec.from_json({"n_input_dims": 4, "n_output_dims": 3, "encoding": ENCODINGS[name],
                              "network": {"n_neurons": 16, "n_hidden_layers": 1, "activation": "SiLU"}})
    rng = np.random.default_rng(8)
    edges = np.array([0.0, 1.0, 0.5, 1e-6, 1 - 1e-6, -0.03, 1.03, -0.5, 1.5, 3.0, -2.25, 1 / 16])
    x = np.concatenate([rng.uniform(0, 1, (1000, 4)), rng.uniform(-2, 3, (200, 4)),
                        np.tile(edges[:, None], (1, 4)), rng.permutation(np.tile(edges, 4)).reshape(-1, 4)])
    x = x.astype(np.float32)
    y = rng.standard_normal((len(x), 3)).astype(np.float32)
    m = compiled(backend, spec)
    assert rel(m.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL["fp16"]
    loss, grads = m.loss_and_grads(x, y)
    check_grads(spec, grads, x, y, loss)


def test_spherical_harmonics_and_triangle_wave(backend):
    """tiny-cuda-nn's parameter-free encodings, computed on the host (numerics.encode) before the
    upload: a direction through SphericalHarmonics degree 4 beside a triangle wave of the other
    two inputs; forward and gradients against the float64 oracle, and 40 Adam steps following it."""
    spec = MLPSpec.from_json({"n_input_dims": 5, "n_output_dims": 3,
                              "network": {"n_neurons": 32, "n_hidden_layers": 2, "activation": "ReLU"},
                              "encoding": {"otype": "Composite", "nested": [
                                  {"otype": "SphericalHarmonics", "degree": 4, "n_dims_to_encode": 3},
                                  {"otype": "TriangleWave", "n_frequencies": 6}]}})
    x, y = data(spec, 400, seed=int(np.random.default_rng().integers(2**31)))
    x = np.abs(x) % 1.0  # TriangleWave's inputs anywhere; SphericalHarmonics' a direction in [0, 1]
    direction = np.random.default_rng().normal(size=(len(x), 3))
    x[:, :3] = (direction / np.linalg.norm(direction, axis=1, keepdims=True) + 1) / 2
    m = backend.compile(spec)
    try:
        assert rel(m.forward(x), CpuBackend("float64").compile(spec).forward(x)) <= FWD_TOL["fp16"]
        loss, grads = m.loss_and_grads(x, y)
        check_grads(spec, grads, x, y, loss)
        losses = m.train_step(x, y, 40)
        reference = CpuBackend("float64").compile(spec).train_step(x, y, 40)  # the same initial weights
        assert losses[-1] < 0.9 * losses[0]  # it learns (unit-variance targets: ~18% in 40 steps)
        np.testing.assert_allclose(losses, reference, rtol=0.05)
    finally:
        m.close()


def _task(spec: MLPSpec, rows: int):
    """A fixed smooth regression task (never zeros)."""
    rng = np.random.default_rng(11)
    x = rng.uniform(-1, 1, (rows, spec.n_input_dims)).astype(np.float32)
    proj = rng.standard_normal((spec.n_input_dims, spec.n_output_dims)) / np.sqrt(spec.n_input_dims)
    return x, np.sin(2 * x @ proj).astype(np.float32)


@pytest.mark.parametrize("model,steps,rows", [("S", 200, 256), ("M", 200, 256), ("L", 40, 128), ("W", 20, 64)])
def test_adam_follows_oracle(backend, model, steps, rows):
    spec = bench_spec(model)
    x, y = _task(spec, rows)
    m = backend.compile(spec)
    try:
        losses = m.train_step(x, y, steps=steps)
        ref = CpuBackend("float64").compile(spec)
        ref_losses = ref.train_step(x, y, steps=steps)
        assert np.isfinite(losses).all()
        # docs/design.md: the loss curve follows the oracle's within 5 % (checked at every step)
        assert np.all(np.abs(losses - ref_losses) <= 0.05 * ref_losses), np.max(np.abs(losses / ref_losses - 1))
        assert losses[-1] < 0.8 * losses[0], "training did not reduce the loss"
        # the parameters themselves drift apart (Adam's normalised steps amplify fp16 rounding),
        # so only their finiteness is required here
        assert all(np.isfinite(p).all() for p in m.get_params().values())
        assert m.get_optimizer_state()["step"][0] == steps
    finally:
        m.close()


def test_sgd_momentum_and_state_roundtrip(backend):
    spec = bench_spec("S").replace(optimizer=OptimizerSpec("SGD", 0.05, momentum=0.9, l2_reg=1e-4))
    x, y = _task(spec, 300)
    with backend.compile(spec) as m:
        ref = CpuBackend("float64").compile(spec)
        losses, ref_losses = m.train_step(x, y, steps=30), ref.train_step(x, y, steps=30)
        assert np.all(np.abs(losses - ref_losses) <= 0.05 * ref_losses)
        state = m.get_optimizer_state()
        assert set(state) == set(ref.get_optimizer_state())
        params = m.get_params()
        # restoring params + state and repeating a step reproduces it exactly (deterministic kernels)
        first = m.train_step(x, y, steps=3)
        m.set_params(params)
        m.set_optimizer_state(state)
        assert np.array_equal(m.train_step(x, y, steps=3), first)


def test_params_roundtrip_and_set(backend):
    spec = bench_spec("M")
    with backend.compile(spec) as m:
        rng = np.random.default_rng(12)
        new = {k: (rng.standard_normal(v.shape) * 0.1).astype(np.float32) for k, v in m.get_params().items()}
        m.set_params(new)
        got = m.get_params()
        assert all(np.array_equal(got[k], new[k]) for k in new)
        ref = CpuBackend("float64").compile(spec)
        ref.set_params(new)
        x, _ = data(spec, 333, seed=13)
        assert rel(m.forward(x), ref.forward(x)) <= FWD_TOL["fp16"]
        with pytest.raises(InvalidInput):
            m.set_params({"W0": new["W0"]})


def test_device_arrays_stay_on_device(backend):
    spec = bench_spec("S")
    with backend.compile(spec) as m:
        x, y = data(spec, 5000, seed=14)
        xd, yd = m.upload(x), m.upload(y)
        out = m.forward(xd)
        assert not isinstance(out, np.ndarray) and out.shape == (5000, spec.n_output_dims)
        np.testing.assert_array_equal(m.download(out), m.forward(x))
        np.testing.assert_array_equal(m.download(xd), x)
        host_losses = m.train_step(x, y, steps=1)
        assert np.isfinite(m.train_step(xd, yd, steps=2)).all() and host_losses.shape == (1,)
        assert m.device_bytes() > 0
        del out
        for _ in range(5):  # pooled outputs: `out = forward(x)` in a loop cycles through two buffers
            out = m.forward(xd)
        del out
        assert sum(len(free) for free in m._pool.values()) == 2
        with pytest.raises(InvalidInput):
            m.forward(np.zeros((3, spec.n_input_dims + 1), np.float32))
    with pytest.raises(LaunchError):
        m.forward(x)


def test_kernel_cache_and_compile_errors(backend, tmp_path, monkeypatch):
    from mmad.backends import webgpu
    from mmad.backends.cache import KernelCache

    cache = KernelCache(tmp_path)
    spec = bench_spec("S", seed=99)
    backend.compile(spec, cache=cache).close()
    backend.compile(spec, cache=cache).close()
    assert (cache.stats.misses, cache.stats.hits) == (1, 1)
    monkeypatch.setattr(webgpu, "generate_wgsl", lambda *a: "fn broken( {")
    with pytest.raises(CompileError) as info:
        backend.compile(bench_spec("S", seed=98))
    assert "fn broken" in str(info.value) and info.value.log


def test_forced_selection(backend, monkeypatch):
    from mmad.backends import select

    monkeypatch.setenv("MMAD_BACKEND", "wgpu")
    chosen, row = select()
    assert (row.backend, row.variant) == ("wgpu", "default")
    chosen.close()
