"""tiny-cuda-nn's grid encodings on the wgpu backend against the cpu float64 oracle.

The grids run on the device (webgpu/wgsl.py ``_grid_wgsl``): the forward interpolates the table
inside the first layer's load, the backward runs through the first layer into d loss / d encoded
input, and the tables' gradients are a sort of the chunk's table reads by table row and a gather
(WGSL has no float atomics). Each case starts from random tables (N(0, 0.5): the default ±1e-4
initialisation would hide the grid in the output) and fresh random inputs, partly outside the unit
cube (the 32-bit wrap-around of cells past the grid's edge). Tolerances are test_webgpu.py's
(docs/design.md): forward ≤ 3e-3 (fp16) / 1e-5 (fp32) relative to float64; gradients ≤ the forward
tolerance + 1.25 × the emulating oracle's own distance from float64, and ≤ 2e-3 from the emulating
oracle; the loss of 40 Adam steps within 5 % of the oracle's at every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from mmad.backends.contract import init_params
from mmad.backends.cpu import CpuBackend
from mmad.spec import MLPSpec
from oracle import grad_errors, rel_err
from test_optimizers import _wgpu_backend

FWD_TOL = {"fp32": 1e-5, "fp16": 3e-3}
GRAD_VS_EMULATE = 2e-3
ADAM = {"otype": "Adam", "learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-15}

pytestmark = pytest.mark.wgpu


@pytest.fixture(scope="module")
def backend():
    be, _ = _wgpu_backend()
    yield be
    be.close()


def grid_spec(encoding: dict, n_in: int, precision: str = "fp16", optimizer: dict = ADAM, n_out: int = 3) -> MLPSpec:
    return MLPSpec.from_json({"n_input_dims": n_in, "n_output_dims": n_out, "encoding": encoding, "seed": 5,
                              "network": {"n_neurons": 16, "n_hidden_layers": 1, "activation": "ReLU"},
                              "optimizer": optimizer, "precision": precision})


def random_params(spec: MLPSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    params = init_params(spec)
    for name in spec.grid_shapes:
        params[name] = rng.normal(0, 0.5, params[name].shape).astype(np.float32)
    return params


def grid_inputs(rng: np.random.Generator, rows: int, dims: int) -> np.ndarray:
    """Mostly in the unit cube, a tenth of the rows up to 0.1 outside it."""
    x = rng.uniform(0, 1, (rows, dims))
    x[: rows // 10] = rng.uniform(-0.1, 1.1, (rows // 10, dims))
    return x.astype(np.float32)


def targets(rng: np.random.Generator, x: np.ndarray, n_out: int = 3) -> np.ndarray:
    """A smooth function of the inputs that a grid learns within a few dozen steps."""
    proj = rng.normal(size=(x.shape[1], n_out)) * 3
    return np.sin(x @ proj).astype(np.float32)


def oracle(spec: MLPSpec, params: dict, mode: str = "float64"):
    model = CpuBackend(mode).compile(spec)
    model.set_params(params)
    return model


def check_forward_and_gradients(m, spec: MLPSpec, params: dict, x: np.ndarray, y: np.ndarray,
                                grad_vs_emulate: float = GRAD_VS_EMULATE) -> dict:
    """Forward, loss and every gradient (the MLP's and the tables') against the oracles; returns
    the measured errors for the report. ``grad_vs_emulate``: the bound against the emulating
    oracle (a device that sums in another order than it lands further from it: cuda)."""
    tol = FWD_TOL[spec.precision]
    ref = oracle(spec, params)
    forward_err = rel_err(m.forward(x), ref.forward(x))
    assert forward_err <= tol, forward_err
    loss, grads = m.loss_and_grads(x, y)
    ref_loss, ref_grads = ref.loss_and_grads(x, y)
    emu_loss, emu_grads = oracle(spec, params, "emulate").loss_and_grads(x, y)
    assert abs(loss - ref_loss) <= tol * abs(ref_loss) + 1.25 * abs(emu_loss - ref_loss)
    assert set(grads) == set(ref_grads)
    errors = grad_errors(grads, spec, params, x, y, ref64=ref_grads)
    for name, (vs64, vs_emu, inherent) in errors.items():
        assert vs64 <= tol + 1.25 * inherent, (name, vs64, inherent)
        if spec.precision != "fp32":
            assert vs_emu <= grad_vs_emulate, (name, vs_emu)
    # the values no sample read have exactly 0 (Adam skips them); against the oracle with the same
    # rounding points (a contribution fp16 rounds to 0 is 0 in both)
    exact = ref_grads if spec.precision == "fp32" else emu_grads
    for name in spec.grid_shapes:
        assert np.array_equal(grads[name] == 0, exact[name] == 0), name
    return {"forward": forward_err, **{name: e[0] for name, e in errors.items()}}


def check_training(m, spec: MLPSpec, params: dict, x: np.ndarray, y: np.ndarray, steps: int = 40) -> float:
    """``steps`` optimizer steps following the float64 oracle's loss at every step within 5 %;
    returns the largest deviation."""
    m.set_params(params)
    losses = m.train_step(x, y, steps)
    reference = oracle(spec, params).train_step(x, y, steps)
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.85 * losses[0], "training did not reduce the loss"
    deviation = float(np.max(np.abs(losses / reference - 1)))
    assert deviation <= 0.05, deviation
    return deviation


HASH_2D = {"otype": "HashGrid", "n_levels": 5, "log2_hashmap_size": 8, "base_resolution": 4, "per_level_scale": 2.0}
CASES = {
    # 2-D: the first two levels fit densely, the rest hash into 2^8 rows (collisions)
    "hash2d": (HASH_2D, 2),
    # 3-D, 4 features: from level 1 on the 2^9-row table is hashed
    "hash3d": ({"otype": "HashGrid", "n_levels": 4, "log2_hashmap_size": 9, "base_resolution": 3,
                "per_level_scale": 1.5, "n_features_per_level": 4}, 3),
    "dense2d": ({"otype": "DenseGrid", "n_levels": 3, "base_resolution": 4, "per_level_scale": 1.7}, 2),
    # 3-D tiled: every level wraps the dense index into base_resolution^3 rows
    "tiled3d": ({"otype": "TiledGrid", "n_levels": 3, "base_resolution": 3, "per_level_scale": 2.0}, 3),
}


@pytest.mark.parametrize("interpolation", ["Linear", "Nearest", "Smoothstep"])
@pytest.mark.parametrize("case", list(CASES))
def test_grid_forward_gradients_and_adam(backend, case, interpolation):
    doc, dims = CASES[case]
    spec = grid_spec({**doc, "interpolation": interpolation}, dims)
    if doc["otype"] == "HashGrid":
        levels = spec.encoding.grid_levels(dims)
        assert any(lv.entries < lv.resolution**dims for lv in levels), "the case should exercise the hash"
    rng = np.random.default_rng()  # fresh data and tables each run
    params = random_params(spec, rng)
    x = grid_inputs(rng, 600, dims)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y)
        check_training(m, spec, params, x, y)


def test_hash_grid_4d_fp32(backend):
    """4 input dims, one feature per level, fp32: the device then matches float64 to float32's rounding."""
    spec = grid_spec({"otype": "HashGrid", "n_levels": 3, "log2_hashmap_size": 10, "base_resolution": 3,
                      "per_level_scale": 2.0, "n_features_per_level": 1}, 4, precision="fp32")
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 400, 4)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        m.set_params(params)
        errors = check_forward_and_gradients(m, spec, params, x, y)
        assert max(errors.values()) <= 1e-5, errors
        check_training(m, spec, params, x, y)


INSTANT_NGP = {"otype": "Composite", "nested": [
    {"otype": "HashGrid", "n_dims_to_encode": 3, "n_levels": 6, "n_features_per_level": 2, "log2_hashmap_size": 10,
     "base_resolution": 4, "per_level_scale": 1.447269237440378},
    {"otype": "SphericalHarmonics", "degree": 4}]}


def test_instant_ngp_composite(backend):
    """instant-NGP's shape: a HashGrid of the 3-D position beside SphericalHarmonics of the
    direction (encoded on the host), 6 inputs, 12 + 16 encoded columns."""
    spec = grid_spec(INSTANT_NGP, 6, n_out=4)
    assert spec.n_encoded_dims == 28
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 500, 6)
    direction = rng.normal(size=(500, 3))
    x[:, 3:] = (direction / np.linalg.norm(direction, axis=1, keepdims=True) + 1) / 2
    y = targets(rng, x, 4)
    with backend.compile(spec) as m:
        assert [g.index for g in m.plan.grids] == [0] and m.plan.host_parts == ((12, 16, 6),)
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y)
        check_training(m, spec, params, x, y)


def test_two_grids_in_chunks_with_sgd(backend, monkeypatch):
    """Two grid parts (two tables) around a host-encoded part, a batch in several training chunks
    (the tables' gradients summed over chunks) and SGD with momentum and l2_reg (tcnn's SGD
    steps a table like the layers)."""
    from mmad.backends.webgpu import wgsl

    monkeypatch.setattr(wgsl, "MAX_GRID_LOOKUPS", 1 << 12)  # 256-row chunks: 16 table reads a row
    encoding = {"otype": "Composite", "nested": [
        {"otype": "DenseGrid", "n_dims_to_encode": 2, "n_levels": 2, "base_resolution": 5, "per_level_scale": 2.0},
        {"otype": "TriangleWave", "n_dims_to_encode": 1, "n_frequencies": 4},
        {"otype": "HashGrid", "n_dims_to_encode": 2, "n_levels": 4, "log2_hashmap_size": 7, "base_resolution": 4,
         "interpolation": "Smoothstep"}]}
    spec = grid_spec(encoding, 5, optimizer={"otype": "SGD", "learning_rate": 0.1, "momentum": 0.9, "l2_reg": 1e-3})
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 1000, 5)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        assert m.plan.chunk_rows == 256 and len(m.plan.grids) == 2
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y)
        check_training(m, spec, params, x, y)


def test_grid_parameters_state_and_determinism(backend):
    """The tables are parameters ``grid{k}`` and Adam's per-value step counts ``steps.grid{k}``
    are optimizer state, as on the cpu backend: they match the oracle's after training (values
    only some batches read step less often), restore exactly, and the same steps repeat bit for bit."""
    spec = grid_spec(HASH_2D, 2, precision="fp32")
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    # two batches reading different parts of the grid: their step counts differ per value
    batches = [(x, targets(rng, x)) for x in (grid_inputs(rng, 300, 2) * 0.5, grid_inputs(rng, 300, 2) * 0.5 + 0.5)]
    ref = oracle(spec, params)
    with backend.compile(spec) as m:
        m.set_params(params)
        for x, y in batches * 2:
            m.train_step(x, y, 3)
            ref.train_step(x, y, 3)
        state, ref_state = m.get_optimizer_state(), ref.get_optimizer_state()
        assert set(state) == set(ref_state)
        assert state["steps.grid0"].dtype == np.uint32
        np.testing.assert_array_equal(state["steps.grid0"], ref_state["steps.grid0"])
        assert set(np.unique(state["steps.grid0"])) > {0, 12}  # some values stepped with one batch only
        got = m.get_params()
        # fp32 against float64: Adam can turn a rounding difference in a gradient near zero into a
        # step of up to the learning rate (over 100 vulkan runs of this test: up to 1.1e-4)
        for name, value in ref.get_params().items():
            assert rel_err(got[name], value) <= 1e-3, name
        # restore params + state into a fresh model: it steps as the first one does, bit for bit
        x, y = batches[0]
        saved = m.get_params()
        with backend.compile(spec) as twin:
            twin.set_params(saved)
            twin.set_optimizer_state(state)
            first = m.train_step(x, y, 4)
            assert np.array_equal(twin.train_step(x, y, 4), first)
            assert all(np.array_equal(v, m.get_params()[k]) for k, v in twin.get_params().items())
            np.testing.assert_array_equal(twin.get_optimizer_state()["steps.grid0"],
                                          m.get_optimizer_state()["steps.grid0"])
        # a state written without step counts: every value Adam moved counts the optimizer's steps
        without = {k: v for k, v in state.items() if not k.startswith("steps.")}
        m.set_optimizer_state(without)
        moved = state["v.grid0"] != 0
        np.testing.assert_array_equal(m.get_optimizer_state()["steps.grid0"], np.where(moved, state["step"][0], 0))


def test_grid_model_with_ema_and_device_inputs(backend):
    """tcnn's EMA wrapper averages the tables like the layers (inference reads the averages), and
    a grid model's inputs stay on the device (the kernels read raw inputs)."""
    optimizer = {"otype": "EMA", "decay": 0.9, "nested": ADAM}
    spec = grid_spec(HASH_2D, 2, optimizer=optimizer)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 500, 2)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        m.set_params(params)
        xd, yd = m.upload(x), m.upload(y)
        losses = m.train_step(xd, yd, 20)
        ref = oracle(spec, params)
        reference = ref.train_step(x, y, 20)
        assert np.max(np.abs(losses / reference - 1)) <= 0.05
        out = m.forward(xd)
        assert not isinstance(out, np.ndarray)
        # inference serves the averages (tables included): the oracle given the trained weights and
        # the device's averages computes the same forward; the raw trained weights' is far from it
        # (after 20 fp16 steps the device's and the oracle's trajectories may differ by more than
        # the forward's tolerance: 1 run in 20 here, so the oracle's own averages are not the reference)
        state = m.get_optimizer_state()
        assert "ema.grid0" in state and not np.array_equal(state["ema.grid0"], m.get_params()["grid0"])
        averaged = oracle(spec, m.get_params())
        raw = averaged.forward(x)
        averaged.set_optimizer_state(state)
        served = m.download(out)
        assert rel_err(served, averaged.forward(x)) <= FWD_TOL["fp16"]
        assert rel_err(served, raw) > 10 * FWD_TOL["fp16"]


def test_tables_past_the_binding_limit_are_refused():
    """Every parameter buffer is bound whole: tables larger than the adapter binds are a SpecError
    in the user's terms at compile time (the plan needs no adapter)."""
    from mmad.backends.webgpu.wgsl import make_plan
    from mmad.errors import SpecError

    spec = grid_spec({"otype": "HashGrid", "n_levels": 16, "log2_hashmap_size": 19}, 3)
    table_bytes = spec.grid_shapes["grid0"][0] * 2 * 4  # instant-NGP's table: 2^19 rows a level past the dense ones
    assert 32 << 20 < table_bytes < 128 << 20
    limits = {"max-compute-workgroup-storage-size": 32768, "max-compute-workgroups-per-dimension": 65535,
              "max-storage-buffer-binding-size": 32 << 20}
    with pytest.raises(SpecError) as info:
        make_plan(spec, limits, 2)
    assert info.value.field == "encoding" and "max-storage-buffer-binding-size" in str(info.value)
    assert "log2_hashmap_size" in str(info.value)
    plan = make_plan(spec, {**limits, "max-storage-buffer-binding-size": 128 << 20}, 2)
    assert plan.p_all == plan.p + spec.grid_shapes["grid0"][0] * 2 and plan.grids[0].lookups == 16 * 8
