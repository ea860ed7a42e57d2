"""tiny-cuda-nn's grid encodings on the cuda backend (mma variant) against the cpu float64 oracle.

The grids run on the device (``shaders/cuda/grid.cu``, ``backends/cuda/grids.py``): a kernel per
grid part encodes the mma kernels' input from the raw dims, the first layer's deltas turn into
d loss / d encoded input and are added into the tables' fp32 gradient with atomics (tcnn's
scatter: not bit-reproducible, so the repeat checks of the wgpu and vulkan tests do not apply),
and tcnn's grid Adam steps the tables. The cases, data and tolerances are test_webgpu_grids.py's
(docs/design.md), in fp16 (the mma variant computes in fp16). GPU tests skip without a CUDA GPU;
the source checks at the end need only nvcc.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import Future

import numpy as np
import pytest

from mmad.backends.cache import KernelCache
from mmad.backends.contract import EpochPosition
from mmad.backends.cuda import mma
from mmad.backends.cuda.grids import CudaGridModel, GridPlan
from mmad.backends.cuda.mma import MmaPlan
from mmad.backends.numerics import epoch_rows
from mmad.demo import IMAGE_CONFIG
from mmad.errors import CompileError, InvalidInput, SpecError
from mmad.spec import MLPSpec
from oracle import rel_err
from test_cuda import _cuda_backend
from test_cuda_layouts import nvcc_local_memory
from test_webgpu_grids import (
    ADAM, CASES, FWD_TOL, HASH_2D, INSTANT_NGP, check_forward_and_gradients, check_training, grid_inputs, grid_spec,
    oracle, random_params, targets,
)

TWO_GRIDS = {"otype": "Composite", "nested": [
    {"otype": "DenseGrid", "n_dims_to_encode": 2, "n_levels": 2, "base_resolution": 5, "per_level_scale": 2.0},
    {"otype": "TriangleWave", "n_dims_to_encode": 1, "n_frequencies": 4},
    {"otype": "HashGrid", "n_dims_to_encode": 2, "n_levels": 4, "log2_hashmap_size": 7, "base_resolution": 4,
     "interpolation": "Smoothstep"}]}
SGD = {"otype": "SGD", "learning_rate": 0.1, "momentum": 0.9, "l2_reg": 1e-3}
# the gradients' bound against the emulating oracle: the device sums in another order (mma
# accumulators, fp32 atomics), so a delta's fp16 rounding lands an ulp apart on some rows and the
# sum of hundreds of rows into a coarse table's values moves by more than on the wgpu and vulkan
# backends, which emulate the oracle's order (H100: up to 4.5e-3 with a 128-wide first layer, 1 run in
# ~6 of test_two_grids_with_sgd_and_wide_mlp); the float64 bound applies unchanged
CUDA_GRAD_VS_EMULATE = 1e-2
IMAGE = IMAGE_CONFIG["encoding"]


@pytest.fixture(scope="module")
def backend():
    return _cuda_backend()


@pytest.mark.gpu
@pytest.mark.parametrize("interpolation", ["Linear", "Nearest", "Smoothstep"])
@pytest.mark.parametrize("case", list(CASES))
def test_grid_forward_gradients_and_adam(backend, case, interpolation):
    doc, dims = CASES[case]
    spec = grid_spec({**doc, "interpolation": interpolation}, dims)
    rng = np.random.default_rng()  # fresh data and tables each run
    params = random_params(spec, rng)
    x = grid_inputs(rng, 600, dims)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        assert m.variant == "mma-f16acc"  # a grid model left to the backend
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y, CUDA_GRAD_VS_EMULATE)
        check_training(m, spec, params, x, y)


class HeldCompiles:
    """mma.in_background standing in: each compile waits until the test runs it (``finish``) or
    fails it (``fail``), so a model is seen between its serving and its training kernels."""

    def __init__(self):
        self.held: list[tuple[object, Future]] = []

    def __call__(self, fn, name):
        future: Future = Future()
        self.held.append((fn, future))
        return future

    def finish(self):
        for fn, future in self.held:
            future.set_result(fn())

    def fail(self, exc):
        for _, future in self.held:
            future.set_exception(exc)


@pytest.fixture
def held(monkeypatch) -> HeldCompiles:
    """The mma training modules' background compiles, held until the test lets them run."""
    compiles = HeldCompiles()
    monkeypatch.setattr(mma, "in_background", compiles)
    return compiles


@pytest.mark.gpu
def test_a_grid_model_serves_before_its_training_kernels_are_built(backend, held, tmp_path):
    """compile() returns with the serving kernels alone (the training module still compiling):
    forwards match the float64 oracle then, and training, once its kernels are in, follows the
    oracle's losses as it does with every kernel built up front."""
    spec = grid_spec(IMAGE, 2)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 700, 2)
    y = targets(rng, x)
    with backend.compile(spec, cache=KernelCache(tmp_path)) as m:
        assert len(held.held) == 1 and not m.training_ready
        m.set_params(params)
        assert rel_err(m.forward(x), oracle(spec, params).forward(x)) <= FWD_TOL["fp16"]
        xh = x.astype(np.float16)  # fp16 in and out: the oracle reads the same rounded inputs
        half = m.forward(xh, out_dtype=np.float16)
        ref = oracle(spec, params).forward(xh.astype(np.float32))
        assert half.dtype == np.float16 and rel_err(half, ref) <= FWD_TOL["fp16"] + 1e-3  # + fp16 output rounding
        assert not m.training_ready  # nothing above waited for the training kernels
        held.finish()
        assert m.training_ready
        check_training(m, spec, params, x, y)


@pytest.mark.gpu
def test_a_failed_training_compile_fails_training_and_leaves_serving(backend, held, tmp_path):
    """The training module's compile error reaches the training request (CompileError with its
    log); the model keeps answering forwards."""
    spec = grid_spec(HASH_2D, 2)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 300, 2)
    with backend.compile(spec, cache=KernelCache(tmp_path)) as m:
        m.set_params(params)
        held.fail(CompileError("the mma training kernels", "error: injected by the test"))
        with pytest.raises(CompileError, match="injected by the test"):
            m.train_step(x, targets(rng, x), 2)
        assert rel_err(m.forward(x), oracle(spec, params).forward(x)) <= FWD_TOL["fp16"]


@pytest.mark.gpu
def test_hash_grid_4d_one_feature(backend):
    """4 input dims (16 corners), one feature per level: the scalar table reads and scatter."""
    spec = grid_spec({"otype": "HashGrid", "n_levels": 3, "log2_hashmap_size": 10, "base_resolution": 3,
                      "per_level_scale": 2.0, "n_features_per_level": 1}, 4)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 400, 4)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y, CUDA_GRAD_VS_EMULATE)
        check_training(m, spec, params, x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("features,interpolation", [(1, "Linear"), (4, "Smoothstep"), (2, "Nearest")])
def test_grid_backward_in_global_memory(backend, features, interpolation):
    """Levels past the shared-memory sums (BACKWARD_SMEM_VALUES): the scatter with global
    reductions, two threads a row (one for Nearest), single values, pairs or 16-byte rows."""
    spec = grid_spec({"otype": "HashGrid", "n_levels": 4, "log2_hashmap_size": 12, "base_resolution": 8,
                      "per_level_scale": 2.0, "n_features_per_level": features, "interpolation": interpolation}, 3)
    plan = GridPlan(spec)
    assert GridPlan.shared_levels(plan.parts[0])[0] < 4, "some levels add into global memory"
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 1000, 3)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y, CUDA_GRAD_VS_EMULATE)


@pytest.mark.gpu
def test_instant_ngp_composite(backend):
    """A HashGrid of the 3-D position beside SphericalHarmonics of the direction (encoded on the
    device too: enc_forward_0 writes its 16 columns from the raw input)."""
    spec = grid_spec(INSTANT_NGP, 6, n_out=4)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 500, 6)
    direction = rng.normal(size=(500, 3))
    x[:, 3:] = (direction / np.linalg.norm(direction, axis=1, keepdims=True) + 1) / 2
    y = targets(rng, x, 4)
    with backend.compile(spec) as m:
        assert [(p.encoding.otype, p.column, p.width) for p in m.grid_plan.free] == [("SphericalHarmonics", 12, 16)]
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y, CUDA_GRAD_VS_EMULATE)
        check_training(m, spec, params, x, y)


@pytest.mark.gpu
def test_two_grids_with_sgd_and_wide_mlp(backend):
    """Two grid parts (two tables) around a parameter-free part, SGD with momentum and l2_reg (tcnn's
    SGD steps a table like the layers), a 128-wide MLP (the backward's deltas are 128 wide)."""
    spec = MLPSpec.from_json({"n_input_dims": 5, "n_output_dims": 3, "encoding": TWO_GRIDS, "seed": 5,
                              "network": {"n_neurons": 128, "n_hidden_layers": 2, "activation": "ReLU"},
                              "optimizer": SGD, "precision": "fp16"})
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 1000, 5)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        assert len(m.grid_plan.parts) == 2
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y, CUDA_GRAD_VS_EMULATE)
        check_training(m, spec, params, x, y)


@pytest.mark.gpu
def test_grid_parameters_and_state(backend):
    """The tables are parameters ``grid{k}`` and Adam's per-value step counts ``steps.grid{k}``
    optimizer state, as on the cpu backend: the counts equal the oracle's after training on two
    batches that read different parts of the grid, and a fresh model given the parameters and the
    state continues as the first one does (within the atomics' rounding)."""
    spec = grid_spec(HASH_2D, 2)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    batches = [(x, targets(rng, x)) for x in (grid_inputs(rng, 300, 2) * 0.5, grid_inputs(rng, 300, 2) * 0.5 + 0.5)]
    ref = oracle(spec, params, "emulate")
    with backend.compile(spec) as m:
        m.set_params(params)
        for x, y in batches * 2:
            m.train_step(x, y, 3)
            ref.train_step(x, y, 3)
        state, ref_state = m.get_optimizer_state(), ref.get_optimizer_state()
        assert set(state) == set(ref_state)
        assert state["steps.grid0"].dtype == np.uint32
        np.testing.assert_array_equal(state["steps.grid0"], ref_state["steps.grid0"])
        assert set(np.unique(state["steps.grid0"])) > {0, 12}
        x, y = batches[0]
        with backend.compile(spec) as twin:
            twin.set_params(m.get_params())
            twin.set_optimizer_state(state)
            np.testing.assert_array_equal(twin.get_optimizer_state()["steps.grid0"], state["steps.grid0"])
            first = m.train_step(x, y, 4)
            np.testing.assert_allclose(twin.train_step(x, y, 4), first, rtol=1e-3)
            for name, value in m.get_params().items():
                assert rel_err(twin.get_params()[name], value) <= 1e-3, name
        without = {k: v for k, v in state.items() if not k.startswith("steps.")}
        m.set_optimizer_state(without)
        moved = state["v.grid0"] != 0
        np.testing.assert_array_equal(m.get_optimizer_state()["steps.grid0"], np.where(moved, state["step"][0], 0))


@pytest.mark.gpu
def test_grid_model_with_ema_and_device_inputs(backend):
    """tcnn's EMA wrapper averages the tables like the layers (inference reads the averages); device
    inputs stay on the device, and an fp16 output comes from the fp16 encoded input."""
    spec = grid_spec(HASH_2D, 2, optimizer={"otype": "EMA", "decay": 0.9, "nested": ADAM})
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 500, 2)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        m.set_params(params)
        xd, yd = m.upload(x), m.upload(y)
        losses = m.train_step(xd, yd, 20)
        reference = oracle(spec, params).train_step(x, y, 20)
        assert np.max(np.abs(losses / reference - 1)) <= 0.05
        out = m.forward(xd)
        assert not isinstance(out, np.ndarray)
        state = m.get_optimizer_state()
        assert "ema.grid0" in state and not np.array_equal(state["ema.grid0"], m.get_params()["grid0"])
        averaged = oracle(spec, m.get_params())
        raw = averaged.forward(x)
        averaged.set_optimizer_state(state)
        served = m.download(out)
        assert rel_err(served, averaged.forward(x)) <= FWD_TOL["fp16"]
        assert rel_err(served, raw) > 10 * FWD_TOL["fp16"]
        half = m.download(m.forward(xd, out_dtype=np.float16))
        assert half.dtype == np.float16 and rel_err(half.astype(np.float32), served) <= 1e-3


@pytest.mark.gpu
def test_train_epochs_on_a_grid_model(backend):
    """A dataset held on the device (raw inputs, fp16 targets) trains
    through the epoch order: each step encodes its drawn rows; the same batches through
    train_step on a twin give the same losses and parameters (within the atomics' rounding)."""
    spec = grid_spec(INSTANT_NGP, 6, n_out=4)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    rows, batch = 700, 300
    x = grid_inputs(rng, rows, 6)
    y = targets(rng, x, 4).astype(np.float16)
    with backend.compile(spec) as device, backend.compile(spec) as host:
        for m in (device, host):
            m.set_params(params)
        data = device.put_dataset([(x[:400], y[:400]), (x[400:], y[400:])], rows, np.float32, np.float16)
        assert data.x.shape == (rows, 6) and data.nbytes >= device.dataset_bytes(rows, np.float32, np.float16)
        position = EpochPosition(int(rng.integers(0, 2**32)))
        expected = EpochPosition(position.seed)
        got = device.train_epochs(data, batch, 5, position)
        want = []
        for _ in range(5):
            r = epoch_rows(expected.seed, expected.epoch, rows, expected.cursor, batch)
            want.append(host.train_step(x[r], y[r].astype(np.float32), 1)[0])
            expected.advance(rows, batch)
        np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-3)
        assert (position.epoch, position.cursor) == (expected.epoch, expected.cursor)
        p_dev, p_host = device.get_params(), host.get_params()
        for name in p_dev:
            assert rel_err(p_dev[name], p_host[name]) <= 1e-3, name


@pytest.mark.gpu
def test_image_config_on_the_fp16_accumulating_variant(backend):
    """tiny-cuda-nn's hash-grid image config on mma-f16acc (its MLP's fp16-out forward accumulates
    in fp16), random tables: a 4096-row fp16 forward against the float64 oracle; batches of 1, 7
    and 1000 rows give those rows' outputs bit for bit (rows are independent). The design bound
    holds for a batch, not row by row: a single row of fp16 accumulators measured 3.6e-3 once
    (mma: below 3e-3), as tiny-cuda-nn's would. Training is mma's, bit for bit."""
    import cupy as cp

    spec = MLPSpec.from_json({**IMAGE_CONFIG, "precision": "fp16"})
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 4096, 2).astype(np.float32)
    y = rng.random((4096, 3), dtype=np.float32)
    ref = oracle(spec, params).forward(x)
    losses = []
    for variant in ("mma", "mma-f16acc"):
        with backend.compile(spec, variant=variant) as m:
            assert m.variant == variant
            m.set_params(params)
            full = cp.asnumpy(m.forward(cp.asarray(x), out_dtype=np.float16))
            err = rel_err(full.astype(np.float64), ref)
            assert err <= FWD_TOL["fp16"], f"{variant}: {err:.2e}"
            for rows in (1, 7, 1000):
                part = cp.asnumpy(m.forward(cp.asarray(x[:rows]), out_dtype=np.float16))
                np.testing.assert_array_equal(part, full[:rows])
            losses.append(np.asarray(m.train_step(x, y, steps=3)))
    np.testing.assert_array_equal(losses[0], losses[1])


@pytest.mark.gpu
def test_other_cuda_variants_refuse_grid_models(backend):
    spec = grid_spec(HASH_2D, 2)
    for variant in ("cublaslt", "wgmma"):
        with pytest.raises(SpecError, match="grid encodings run on the cuda backend's mma and mma-f16acc variants only"):
            backend.compile(spec, variant=variant)
    with backend.compile(spec) as m:
        with pytest.raises(InvalidInput, match="data-parallel training of a grid-encoded model"):
            m.parallel_start(None, 1, 1, EpochPosition(0))


def test_grid_source_builds_with_nvcc_without_spills(tmp_path):
    """The generated grid kernels of the instant-NGP composite (3-D hash, device-encoded SH), the
    hash-grid image config (16-byte row stores, coarse levels summed in shared memory), a 4-D
    one-feature grid and the two-grid SGD model with EMA, built by nvcc for sm_90: no local memory."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here: the generated CUDA source is only checked where it is")
    specs = [grid_spec(INSTANT_NGP, 6, n_out=4), grid_spec(IMAGE, 2),
             grid_spec({"otype": "HashGrid", "n_levels": 3, "n_features_per_level": 1}, 4),
             grid_spec(TWO_GRIDS, 5, optimizer={"otype": "EMA", "decay": 0.9, "nested": SGD})]
    for i, spec in enumerate(specs):
        plan = GridPlan(spec)
        src = tmp_path / f"grid{i}.cu"
        src.write_text(plan.source)
        done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", str(src),
                               "-o", str(tmp_path / f"grid{i}.cubin")], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        report = re.findall(r"Compiling entry function '(\w+)'.*?\n\s*(\d+) bytes stack frame, (\d+) bytes spill",
                            done.stderr, flags=re.S)
        assert {kernel for kernel, _, _ in report} == set(plan.kernels)
        assert all(int(stack) + int(spill) == 0 for _, stack, spill in report), report


class EncodedInputPlan(MmaPlan):
    encoded_input = CudaGridModel.encoded_input


@pytest.mark.parametrize("case", ["image", "instant_ngp"])
def test_mma_source_of_a_grid_model_builds_with_nvcc_without_spills(tmp_path, case):
    """A grid model's mma kernels (pair-major input, d loss / d input from the training kernels),
    built by nvcc for sm_90: the serving module holds the pair forwards and no plain or group
    forward (a grid model never runs them), the training module the training kernels; the pair
    forwards and the training kernels use no local memory."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here: the generated CUDA source is only checked where it is")
    spec = grid_spec(IMAGE, 2) if case == "image" else grid_spec(INSTANT_NGP, 6, n_out=4)
    plan = EncodedInputPlan(spec)
    report = nvcc_local_memory(nvcc, plan, tmp_path / "mma")
    assert set(plan.serve_kernels) == {"mlp_forward_pairs", "mlp_forward_pairs_half", "mlp_optimize", "mlp_load_tcnn"}
    kernels = ["mlp_forward_pairs", "mlp_forward_pairs_half", "mlp_train_fwd_bwd"] + (
        ["mlp_train_fused"] if plan.fused_wgrad else [])
    assert all(report[k] == 0 for k in kernels), report
