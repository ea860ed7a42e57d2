"""tiny-cuda-nn's grid encodings on the vulkan backend against the cpu float64 oracle.

The grids run on the device (``shaders/glsl/grid.comp``): a kernel encodes the first layer's input
from the raw dims (interpolating the table's compute-type copy), the backward runs on through the
first layer into d loss / d encoded input, and the tables' gradients are summed with fp32
atomicAdd where the device offers it (lavapipe does), else (and with MMAD_VULKAN_GRID_GRADIENT=sorted)
by a bitonic sort of the table reads by table row and a gather (deterministic). The fp16 cases run on
every variant the device offers (simt on lavapipe in CI; coopmat too on a GPU host); fp32 models run
on simt, which the backend picks for them. The cases, the data and the tolerances are test_webgpu_grids.py's
(docs/design.md): forward ≤ 3e-3 (fp16) / 1e-5 (fp32) relative to float64; gradients ≤ the forward
tolerance + 1.25 × the emulating oracle's own distance from float64, and ≤ 2e-3 from the emulating
oracle; the loss of 40 Adam steps within 5 % of the oracle's at every step.
"""

from __future__ import annotations

import numpy as np
import pytest

from mmad.backends.cache import KernelCache
from mmad.backends.contract import EpochPosition
from mmad.backends.numerics import epoch_rows
from mmad.errors import SpecError
from oracle import rel_err
from test_webgpu_grids import (
    ADAM, CASES, FWD_TOL, HASH_2D, INSTANT_NGP, check_forward_and_gradients, check_training, grid_inputs, grid_spec,
    oracle, random_params, targets,
)

vulkan = pytest.importorskip("mmad.backends.vulkan", reason="the vulkan Python package is not installed")

pytestmark = pytest.mark.vulkan


from test_vulkan import backend, variant  # noqa: E402,F401 - the Vulkan backend (skips without a device), its variants

# the gradients' bound against the emulating oracle when the tables' sums are atomic adds: they land
# in another order than the oracle's bincount, as on cuda (test_cuda_grids.CUDA_GRAD_VS_EMULATE);
# the sorted gradient keeps the oracle's order and test_webgpu_grids' bound; float64's is the same
ATOMIC_GRAD_VS_EMULATE = 1e-2


def grads_vs_emulate(m) -> dict:
    return {"grad_vs_emulate": ATOMIC_GRAD_VS_EMULATE} if m.grid_gradient == "atomic" else {}


@pytest.mark.parametrize("interpolation", ["Linear", "Nearest", "Smoothstep"])
@pytest.mark.parametrize("case", list(CASES))
def test_grid_forward_gradients_and_adam(backend, variant, case, interpolation):
    doc, dims = CASES[case]
    spec = grid_spec({**doc, "interpolation": interpolation}, dims)
    rng = np.random.default_rng()  # fresh data and tables each run
    params = random_params(spec, rng)
    x = grid_inputs(rng, 600, dims)
    y = targets(rng, x)
    with backend.compile(spec, variant) as m:
        assert m.variant == variant
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y, **grads_vs_emulate(m))
        check_training(m, spec, params, x, y)


ENCODE_CASES = {**{f"{case}-{interp}": ({**CASES[case][0], "interpolation": interp}, CASES[case][1], 3)
                   for case in CASES for interp in ("Linear", "Nearest", "Smoothstep")},
                "instant-ngp": (INSTANT_NGP, 6, 4)}


def test_encoded_input_equals_the_emulating_oracle_bit_for_bit(backend):
    """grid.comp's encode (tcnn's positions, cells, weights and corner order; the host columns
    copied, the padding zero) gives the first layer's input of the emulating cpu oracle bit for
    bit, for every grid type and interpolation in 2 and 3 dims (with 4 dims' 16 corners the
    oracle's sums land an ulp away in places: test_hash_grid_4d_fp32 bounds them)."""
    from mmad.backends import numerics as nm

    rng = np.random.default_rng()
    for name, (encoding, dims, n_out) in ENCODE_CASES.items():
        spec = grid_spec(encoding, dims, n_out=n_out)
        params = random_params(spec, rng)
        x = grid_inputs(rng, 300, dims)
        emulate = oracle(spec, params, "emulate")
        want, _ = nm.encode_with_lookups(spec.encoding, x.astype(emulate.dtype), emulate._grids)
        with backend.compile(spec, "simt") as m:
            m.set_params(params)
            m.forward(x)
            in_pad = m.geo.in_pad
            enc = np.frombuffer(m._batch["enc"].read(300 * in_pad * 4), np.float32).reshape(300, in_pad)
        np.testing.assert_array_equal(enc[:, :spec.n_encoded_dims], want.astype(np.float32), err_msg=name)
        assert not enc[:, spec.n_encoded_dims:].any(), name


def test_hash_grid_4d_fp32(backend):
    """4 input dims, one feature per level, fp32 (on simt, the backend's choice for fp32): the device
    then matches float64 to float32's rounding."""
    spec = grid_spec({"otype": "HashGrid", "n_levels": 3, "log2_hashmap_size": 10, "base_resolution": 3,
                      "per_level_scale": 2.0, "n_features_per_level": 1}, 4, precision="fp32")
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 400, 4)
    y = targets(rng, x)
    with backend.compile(spec) as m:
        assert m.variant == "simt"
        m.set_params(params)
        errors = check_forward_and_gradients(m, spec, params, x, y, **grads_vs_emulate(m))
        assert max(errors.values()) <= 1e-5, errors
        check_training(m, spec, params, x, y)


def test_instant_ngp_composite(backend, variant):
    """instant-NGP's shape: a HashGrid of the 3-D position beside SphericalHarmonics of the
    direction (encoded on the host, uploaded beside the raw dims), 6 inputs, 12 + 16 encoded columns."""
    spec = grid_spec(INSTANT_NGP, 6, n_out=4)
    assert spec.n_encoded_dims == 28
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 500, 6)
    direction = rng.normal(size=(500, 3))
    x[:, 3:] = (direction / np.linalg.norm(direction, axis=1, keepdims=True) + 1) / 2
    y = targets(rng, x, 4)
    with backend.compile(spec, variant) as m:
        grid = m.geo.grid
        assert [g.index for g in grid.parts] == [0] and grid.host == ((12, 16, 6),) and grid.x_cols == 22
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y, **grads_vs_emulate(m))
        check_training(m, spec, params, x, y)


@pytest.mark.parametrize("gradient", vulkan.GRID_GRADIENTS)
def test_two_grids_in_chunks_with_sgd(backend, variant, monkeypatch, gradient):
    """Two grid parts (two tables) around a host-encoded part, a batch in several training chunks
    (and, sorted, several table-gradient chunks whose sums are added) and SGD with momentum and
    l2_reg (tcnn's SGD steps a table like the layers); with either table gradient."""
    if gradient == "atomic" and not backend._open_device(0).info.float32_atomic_add:
        pytest.skip("this Vulkan device does not offer shaderBufferFloat32AtomicAdd")
    monkeypatch.setenv(vulkan.GRID_GRADIENT_ENV, gradient)
    monkeypatch.setattr(vulkan, "MAX_GRID_LOOKUPS", 1 << 12)  # 256-row chunks: 16 table reads a row
    monkeypatch.setattr(vulkan.VulkanModel, "max_chunk_rows", 256)
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
    with backend.compile(spec, variant) as m:
        assert m.grid_gradient == gradient
        assert len(m.geo.grid.parts) == 2 and len(m._grid_chunks(1000)) == 4 and len(m._chunks(1024)) == 4
        m.set_params(params)
        check_forward_and_gradients(m, spec, params, x, y, **grads_vs_emulate(m))
        check_training(m, spec, params, x, y)


def test_grid_parameters_state_and_determinism(backend, monkeypatch):
    """The tables are parameters ``grid{k}`` and Adam's per-value step counts ``steps.grid{k}``
    are optimizer state, as on the cpu backend: they match the oracle's after training (values
    only some batches read step less often), restore exactly, and with the sorted table gradient
    (MMAD_VULKAN_GRID_GRADIENT=sorted) the same steps repeat bit for bit."""
    monkeypatch.setenv(vulkan.GRID_GRADIENT_ENV, "sorted")
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
        # fp32 against float64: typically 2e-7 apart, but Adam's m / sqrt(v) turns a rounding
        # difference in a gradient near 0 (or a ReLU or cell edge an input sits on) into a step of
        # up to the learning rate: over 100 runs a parameter set moved by up to 1.1e-4
        got = m.get_params()
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
            # the gradients repeat bit for bit too (the reduction has a fixed order)
            g1, g2 = m.loss_and_grads(x, y)[1], m.loss_and_grads(x, y)[1]
            assert all(np.array_equal(g1[k], g2[k]) for k in g1)
        # a state written without step counts: every value Adam moved counts the optimizer's steps
        without = {k: v for k, v in state.items() if not k.startswith("steps.")}
        m.set_optimizer_state(without)
        moved = state["v.grid0"] != 0
        np.testing.assert_array_equal(m.get_optimizer_state()["steps.grid0"], np.where(moved, state["step"][0], 0))


def test_grid_model_with_ema_and_device_inputs(backend, variant):
    """tcnn's EMA wrapper averages the tables like the layers (inference reads the averages), and
    a grid model's inputs stay on the device (the kernels read raw inputs)."""
    optimizer = {"otype": "EMA", "decay": 0.9, "nested": ADAM}
    spec = grid_spec(HASH_2D, 2, optimizer=optimizer)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    x = grid_inputs(rng, 500, 2)
    y = targets(rng, x)
    with backend.compile(spec, variant) as m:
        m.set_params(params)
        xd, yd = m.upload(x), m.upload_target(y)
        np.testing.assert_array_equal(m.download(xd), x)  # a grid model's device input is the raw input
        losses = m.train_step(xd, yd, 20)
        ref = oracle(spec, params)
        reference = ref.train_step(x, y, 20)
        assert np.max(np.abs(losses / reference - 1)) <= 0.05
        out = m.forward(xd)
        assert not isinstance(out, np.ndarray)
        # inference serves the averages (tables included): the oracle given the trained weights and
        # the device's averages computes the same forward; the raw trained weights' is far from it
        # (after 20 steps the two trajectories differ by more than the forward's tolerance, so the
        # oracle's own averages are not the reference)
        state = m.get_optimizer_state()
        assert "ema.grid0" in state and not np.array_equal(state["ema.grid0"], m.get_params()["grid0"])
        averaged = oracle(spec, m.get_params())
        raw = averaged.forward(x)
        averaged.set_optimizer_state(state)
        served = m.download(out)
        assert rel_err(served, averaged.forward(x)) <= FWD_TOL["fp16"]
        assert rel_err(m.forward(x), averaged.forward(x)) <= FWD_TOL["fp16"]
        assert rel_err(served, raw) > 10 * FWD_TOL["fp16"]
        # a restored average is what inference serves
        with backend.compile(spec, variant) as twin:
            twin.set_params(m.get_params())
            twin.set_optimizer_state(state)
            np.testing.assert_array_equal(twin.forward(x), m.forward(x))


def test_train_epochs_on_a_grid_model(backend, variant, monkeypatch):
    """A dataset held on the device (raw inputs and the host-encoded parts) trains through
    train_epochs exactly as train_step does on the same batches (with the sorted table gradient,
    whose sums repeat bit for bit; atomic adds land in another order each run)."""
    monkeypatch.setenv(vulkan.GRID_GRADIENT_ENV, "sorted")
    spec = grid_spec(INSTANT_NGP, 6, n_out=4)
    rng = np.random.default_rng()
    params = random_params(spec, rng)
    rows, batch = 700, 300
    x = grid_inputs(rng, rows, 6)
    y = targets(rng, x, 4)
    with backend.compile(spec, variant, KernelCache()) as device, backend.compile(spec, variant, KernelCache()) as host:
        for m in (device, host):
            m.set_params(params)
        data = device.put_dataset([(x[:400], y[:400]), (x[400:], y[400:])], rows, np.float32, np.float32)
        assert data.x.cols == 22 and data.nbytes >= device.dataset_bytes(rows, np.float32, np.float32)
        position = EpochPosition(int(rng.integers(0, 2**32)))
        expected = EpochPosition(position.seed)
        got = device.train_epochs(data, batch, 5, position)
        want = []
        for _ in range(5):
            r = epoch_rows(expected.seed, expected.epoch, rows, expected.cursor, batch)
            want.append(host.train_step(x[r], y[r], 1)[0])
            expected.advance(rows, batch)
        assert np.array_equal(got, np.array(want, np.float32))
        p_dev, p_host = device.get_params(), host.get_params()
        assert all(np.array_equal(p_dev[k], p_host[k]) for k in p_dev)


def test_tables_past_the_binding_limit_are_refused():
    """Every parameter buffer is bound whole: tables larger than the device binds are a SpecError
    in the user's terms (checked at compile time against maxStorageBufferRange)."""
    spec = grid_spec({"otype": "HashGrid", "n_levels": 16, "log2_hashmap_size": 19}, 3)
    geometry = vulkan.Geometry.build(spec, 32768)
    table_values = spec.grid_shapes["grid0"][0] * 2
    assert geometry.n_values == geometry.n_params + table_values and geometry.grid.parts[0].lookups == 16 * 8
    with pytest.raises(SpecError) as info:
        vulkan.check_tables_fit(spec, geometry, 32 << 20)
    assert info.value.field == "encoding" and "maxStorageBufferRange" in str(info.value)
    assert "log2_hashmap_size" in str(info.value)
    vulkan.check_tables_fit(spec, geometry, 128 << 20)


def test_grid_gradient_setting_is_checked_against_the_device(monkeypatch):
    """MMAD_VULKAN_GRID_GRADIENT: atomic where the device offers shaderBufferFloat32AtomicAdd,
    else sorted; a value that is not a choice, or atomic on a device without it, is refused."""
    from dataclasses import replace

    from mmad.backends.vulkan import runtime as vr
    from mmad.errors import BackendUnavailable

    with_atomics = vr.DeviceInfo(0, "GPU", "discrete", "1.3.0", "0x1", 32, 49152, 1024, (65535, 65535, 65535),
                                 1 << 30, 1.0, True, True, True, float32_atomic_add=True)
    without = replace(with_atomics, name="old GPU", float32_atomic_add=False)
    monkeypatch.delenv(vulkan.GRID_GRADIENT_ENV, raising=False)
    assert vulkan.grid_gradient(with_atomics) == "atomic" and vulkan.grid_gradient(without) == "sorted"
    monkeypatch.setenv(vulkan.GRID_GRADIENT_ENV, "sorted")
    assert vulkan.grid_gradient(with_atomics) == "sorted"
    monkeypatch.setenv(vulkan.GRID_GRADIENT_ENV, "atomic")
    with pytest.raises(BackendUnavailable, match="old GPU does not offer shaderBufferFloat32AtomicAdd"):
        vulkan.grid_gradient(without)
    monkeypatch.setenv(vulkan.GRID_GRADIENT_ENV, "fast")
    with pytest.raises(SpecError, match="must be one of atomic, sorted; got 'fast'"):
        vulkan.grid_gradient(with_atomics)


def test_grid_models_share_the_grid_kernels_between_variants():
    """coopmat trains grid models with the grid kernels simt uses (one source, the same headers):
    only the fused MLP kernels differ, and both backwards run on into d loss / d encoded input."""
    spec = grid_spec(INSTANT_NGP, 6, n_out=4)
    simt = vulkan.kernel_sources(spec, vulkan.Geometry.build(spec, 49152), "simt", "sorted")
    coop = vulkan.kernel_sources(spec, vulkan.Geometry.build(spec, 49152, (16, 16, 16)), "coopmat", "sorted")
    grid_kernels = {name for name in simt if name.startswith("grid_")}
    assert grid_kernels == {"grid_encode", "grid_keys", "grid_gather", "grid_sort", "grid_sort_block"}
    assert grid_kernels <= set(coop)
    # the encode's header has the tile geometry's defines too (R, THREADS, ...), which differ: the
    # grid part of each (its defines and arrays, and the stage) is the same
    for name in grid_kernels:
        if name.startswith("grid_sort"):  # no model header at all
            assert simt[name] == coop[name]
            continue
        grid_part = lambda src: src[src.index("#define GRID_PARTS"):]  # noqa: E731
        assert grid_part(simt[name]) == grid_part(coop[name]), name
    # coopmat2's too (its plan for a made-up device of 256-invocation workgroup-scope 16x16x16 shapes)
    shape = dict(m=16, n=16, k=16, a="f16", b="f16", c="f32", result="f32", scope="workgroup", workgroup_invocations=256)
    plan = vulkan.coopmat2_plan(spec, [shape], {}, 49152, 1024, grid=True)
    coop2 = vulkan.kernel_sources(spec, vulkan.Geometry.build(spec, 49152, coopmat2=plan), "coopmat2", "sorted")
    assert plan.delta_stride == plan.in_pad + 8  # the backward's shared tile also holds d loss / d encoded input
    for name in grid_kernels:
        if not name.startswith("grid_sort"):
            assert coop2[name][coop2[name].index("#define GRID_PARTS"):] == grid_part(simt[name]), name
    for sources in (simt, coop, coop2):
        assert "#define GRID_PARTS 1" in sources["backward"] and "#define GRID_PARTS 1" in sources["optimizer"]
    assert vulkan.pipeline_interface("coopmat", True)["backward"] == (7, 44)
    assert vulkan.pipeline_interface("simt", True)["backward"] == (6, 44)


def test_fp32_models_take_the_simt_variant(backend):
    """The cooperative matrices multiply fp16 operands: a precision fp32 model, grid or not, runs on
    simt when the backend chooses, and asking for coopmat is refused by name."""
    fp32 = grid_spec(HASH_2D, 2, precision="fp32")
    assert vulkan.variant_choices(fp32) == ("simt",)
    assert vulkan.variant_choices(grid_spec(HASH_2D, 2)) == ("coopmat2", "coopmat", "simt")
    for variant in ("coopmat", "coopmat2"):
        with pytest.raises(SpecError, match=f"vulkan:{variant} multiplies fp16 operands; a precision fp32 model runs "
                                            "on vulkan:simt") as info:
            backend.compile(fp32, variant)
        assert info.value.field == "precision"
