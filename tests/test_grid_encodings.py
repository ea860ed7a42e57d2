"""tiny-cuda-nn's grid encodings, spherical harmonics and triangle wave on the cpu backend.

References here are written independently of mmad/backends/encodings.py: the grid from a
per-sample port of tcnn's ``kernel_grid``/``grid_index`` in Python integers, the spherical
harmonics from the associated Legendre recurrence, the triangle wave from arcsin(cos(·)).
Gradients of the grid tables are checked by central differences in float64.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mmad.backends import load_backend
from mmad.backends import numerics as nm
from mmad.backends.contract import init_params, param_shapes
from mmad.backends.cpu import CpuBackend
from mmad.cli import demo_image
from mmad.errors import SpecError
from mmad.spec import MLPSpec

CONFIGS = Path(__file__).parent / "configs"
PRIMES = [1, 2654435761, 805459861, 3674653429]


def grid_spec(encoding: dict, n_in: int = 2, n_out: int = 3, **extra) -> MLPSpec:
    return MLPSpec.from_json({"n_input_dims": n_in, "n_output_dims": n_out, "encoding": encoding,
                              "network": {"n_neurons": 16, "n_hidden_layers": 1}, "precision": "fp32",
                              "seed": 11, **extra})


# -- the spec ------------------------------------------------------------------------------------
def test_tcnn_config_hash_is_accepted_verbatim():
    doc = json.loads((CONFIGS / "tcnn_config_hash.json").read_text())
    spec = MLPSpec.from_json(doc, n_input_dims=2, n_output_dims=3)
    enc = spec.encoding
    assert (enc.otype, enc.n_levels, enc.n_features_per_level, enc.log2_hashmap_size, enc.base_resolution,
            enc.per_level_scale, enc.interpolation) == ("HashGrid", 16, 2, 15, 16, 1.5, "Linear")
    assert spec.n_encoded_dims == 32
    levels = enc.grid_levels(2)
    # tcnn: level 0 scale 15 (16 vertices, 256 rows); from level 6 on the 2^15-row table is hashed
    assert (levels[0].scale, levels[0].resolution, levels[0].entries) == (15.0, 16, 256)
    assert levels[1].entries == 576 and levels[4].entries == 6568  # 81² = 6561, up to a multiple of 8
    assert [lv.entries for lv in levels[6:]] == [1 << 15] * 10
    assert spec.grid_shapes == {"grid0": (levels[-1].offset + levels[-1].entries, 2)}
    assert param_shapes(spec)["grid0"] == spec.grid_shapes["grid0"]
    assert MLPSpec.from_json(spec.to_json()) == spec


def test_instant_ngp_composite_is_accepted_verbatim():
    doc = {"n_input_dims": 6, "n_output_dims": 4, "encoding": {"otype": "Composite", "nested": [
        {"otype": "HashGrid", "n_dims_to_encode": 3, "n_levels": 16, "n_features_per_level": 2,
         "log2_hashmap_size": 19, "base_resolution": 16, "per_level_scale": 1.447269237440378},
        {"otype": "SphericalHarmonics", "degree": 4}]},
        "network": {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                    "n_neurons": 64, "n_hidden_layers": 2}}
    spec = MLPSpec.from_json(doc)
    assert spec.n_encoded_dims == 32 + 16
    (grid, b0, d0), (sh, b1, d1) = spec.encoding.parts(6)
    assert (grid.otype, b0, d0, sh.otype, sh.degree, b1, d1) == ("HashGrid", 0, 3, "SphericalHarmonics", 4, 3, 3)
    assert list(spec.grid_shapes) == ["grid0"] and MLPSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("doc, otype, grid_type", [
    ({"otype": "Grid"}, "HashGrid", "Hash"),
    ({"otype": "Grid", "type": "Dense"}, "DenseGrid", "Dense"),
    ({"otype": "HashGrid", "type": "tiled"}, "TiledGrid", "Tiled"),
    ({"otype": "DenseGrid"}, "DenseGrid", "Dense"),
])
def test_grid_otype_and_type(doc, otype, grid_type):
    enc = grid_spec(doc).encoding
    assert (enc.otype, enc.grid_type) == (otype, grid_type)


def test_grid_defaults_are_tcnns():
    enc = grid_spec({"otype": "HashGrid"}).encoding
    assert (enc.n_levels, enc.n_features_per_level, enc.log2_hashmap_size, enc.base_resolution,
            enc.per_level_scale, enc.interpolation) == (16, 2, 19, 16, 2.0, "Linear")
    dense = grid_spec({"otype": "DenseGrid", "n_levels": 4, "base_resolution": 4}).encoding
    # tcnn: exp(log(256 / base) / (n_levels − 1)), so the last level has 256 vertices
    assert dense.per_level_scale == pytest.approx(64 ** (1 / 3), rel=1e-6)
    assert grid_spec({"otype": "HashGrid", "n_features": 8, "n_features_per_level": 4}).encoding.n_levels == 2
    assert grid_spec({"otype": "SphericalHarmonics"}, n_in=3).encoding.degree == 4
    assert grid_spec({"otype": "TriangleWave"}).encoding.n_frequencies == 12


@pytest.mark.parametrize("doc, n_in, field, words", [
    ({"otype": "HashGrid"}, 1, "encoding", "2, 3 or 4 input dims"),
    ({"otype": "HashGrid"}, 5, "encoding", "2, 3 or 4 input dims"),
    ({"otype": "SphericalHarmonics"}, 2, "encoding", "3-D directions"),
    ({"otype": "SphericalHarmonics", "degree": 9}, 3, "encoding.degree", "from 1 to 8"),
    ({"otype": "HashGrid", "n_features_per_level": 3}, 2, "encoding.n_features_per_level", "1, 2, 4 or 8"),
    ({"otype": "HashGrid", "fixed_point_pos": True}, 2, "encoding.fixed_point_pos", "not supported"),
    ({"otype": "HashGrid", "stochastic_interpolation": True}, 2, "encoding.stochastic_interpolation", "not supported"),
    ({"otype": "HashGrid", "hash": "Prime"}, 2, "encoding.hash", "CoherentPrime"),
    ({"otype": "HashGrid", "interpolation": "Cubic"}, 2, "encoding.interpolation", "Smoothstep"),
    ({"otype": "HashGrid", "n_levels": 4, "n_features": 8}, 2, "encoding.n_features", "n_levels"),
    ({"otype": "DenseGrid", "n_levels": 1}, 2, "encoding.per_level_scale", "required"),
    ({"otype": "HashGrid", "n_levels": 129}, 2, "encoding.n_levels", "from 1 to 128"),
    ({"otype": "HashGrid", "log2_hashmap_size": 24, "n_levels": 16, "n_features_per_level": 4}, 3, "encoding",
     "grid tables hold"),
    ({"otype": "HashGrid", "bogus": 1}, 2, "encoding.bogus", "unknown field"),
])
def test_grid_spec_errors_name_the_field(doc, n_in, field, words):
    with pytest.raises(SpecError) as info:
        grid_spec(doc, n_in=n_in)
    assert info.value.field == field and words in str(info.value)


@pytest.mark.parametrize("otype", ["HashGrid", "DenseGrid", "TiledGrid"])
def test_cuda_variants_without_grid_kernels_refuse_the_grids(otype):
    """Grids run on every backend (the cuda one on its mma variants: tests/test_cuda_grids.py); the
    cuda variants without grid kernels refuse a grid model by name, also inside a Composite,
    before anything touches a GPU."""
    plain = grid_spec({"otype": otype, "n_levels": 2}, n_in=2)
    composite = grid_spec({"otype": "Composite", "nested": [{"otype": "SphericalHarmonics", "n_dims_to_encode": 3},
                                                            {"otype": otype, "n_levels": 2}]}, n_in=5)
    try:
        backend = load_backend("cuda")
    except Exception as exc:  # its Python package is not installed here
        pytest.skip(f"cuda: {exc}")
    for spec in (plain, composite):
        for variant in ("cublaslt", "wgmma"):
            with pytest.raises(SpecError) as info:
                backend.compile(spec, variant=variant)
            assert info.value.field == "variant"
            assert f"the {variant} variant has none" in str(info.value)


# -- the grid forward against a per-sample port of tcnn -------------------------------------------
def ref_levels(enc, dims):
    """(scale, resolution, offset, rows) per level, recomputed from tcnn's constructor."""
    out, offset = [], 0
    log2s = np.float32(math.log2(np.float32(enc.per_level_scale)))
    for level in range(enc.n_levels):
        scale = float(np.float32(np.float32(2.0 ** float(np.float32(level) * log2s)) * np.float32(enc.base_resolution))
                      - np.float32(1))
        res = math.ceil(scale) + 1
        rows = -(-min(res**dims, 2**31 - 1) // 8) * 8
        if enc.otype == "HashGrid":
            rows = min(rows, 1 << enc.log2_hashmap_size)
        elif enc.otype == "TiledGrid":
            rows = min(rows, enc.base_resolution**dims)
        out.append((scale, res, offset, rows))
        offset += rows
    return out


def ref_index(enc, res, rows, corner):
    dims = len(corner)
    max_base = {2: 0xFFFF, 3: 0x659, 4: 0xFF}[dims]
    index, stride = 0, 1
    if res <= max_base:
        for d in range(dims):
            index = (index + corner[d] * stride) % 2**32
            stride *= res
    else:
        stride = 0xFFFFFFFF
    if enc.otype == "HashGrid" and rows < stride:
        index = 0
        for d in range(dims):
            index ^= (corner[d] * PRIMES[d]) % 2**32
    return index % rows


def ref_grid(enc, x_row, table):
    """tcnn's kernel_grid for one sample, in float64."""
    dims, f = len(x_row), enc.n_features_per_level
    out = []
    for scale, res, offset, rows in ref_levels(enc, dims):
        pos = [xi * scale + 0.5 for xi in x_row]
        cell = [math.floor(p) for p in pos]
        frac = [p - c for p, c in zip(pos, cell)]
        if enc.interpolation == "Smoothstep":
            frac = [t * t * (3 - 2 * t) for t in frac]
        acc = [0.0] * f
        if enc.interpolation == "Nearest":
            acc = list(table[offset + ref_index(enc, res, rows, cell)])
        else:
            for c in range(1 << dims):
                bits = [(c >> d) & 1 for d in range(dims)]
                w = math.prod(frac[d] if bits[d] else 1 - frac[d] for d in range(dims))
                row = table[offset + ref_index(enc, res, rows, [cell[d] + bits[d] for d in range(dims)])]
                acc = [a + w * v for a, v in zip(acc, row)]
        out += acc
    return out


GRIDS = [
    # 2-D hash: the first levels fit densely, the rest are hashed into 2^8 rows
    ({"otype": "HashGrid", "n_levels": 5, "log2_hashmap_size": 8, "base_resolution": 4, "per_level_scale": 2.0}, 2),
    ({"otype": "HashGrid", "n_levels": 4, "log2_hashmap_size": 9, "base_resolution": 3, "per_level_scale": 1.5,
      "n_features_per_level": 4}, 3),
    ({"otype": "HashGrid", "n_levels": 3, "log2_hashmap_size": 10, "base_resolution": 3, "per_level_scale": 2.0,
      "n_features_per_level": 1}, 4),
    ({"otype": "DenseGrid", "n_levels": 3, "base_resolution": 4, "per_level_scale": 1.7}, 2),
    ({"otype": "TiledGrid", "n_levels": 3, "base_resolution": 3, "per_level_scale": 2.0}, 3),
]
INTERPOLATIONS = ["Linear", "Nearest", "Smoothstep"]


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("doc, dims", GRIDS)
def test_grid_forward_matches_tcnn_port(doc, dims, interpolation):
    spec = grid_spec({**doc, "interpolation": interpolation}, n_in=dims)
    enc = spec.encoding
    rng = np.random.default_rng(3)
    (name, shape), = spec.grid_shapes.items()
    table = rng.normal(size=shape)
    x = rng.uniform(-0.1, 1.1, (40, dims))  # also past the unit cube: the 32-bit wrap-around
    got = nm.encode(enc, x, [table])
    want = np.array([ref_grid(enc, row, table) for row in x.tolist()])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    hashed = [lv for lv in enc.grid_levels(dims) if lv.entries < lv.resolution**dims]
    assert (enc.otype != "HashGrid") or hashed, "the case should exercise the hash"
    # float32 inputs: tcnn's fp32 arithmetic, close to the float64 result
    got32 = nm.encode(enc, x.astype(np.float32), [table.astype(np.float32)])
    assert got32.dtype == np.float32
    near_cell_edge = np.zeros(len(x), bool)  # a cell boundary within float32 rounding moves a sample's corners
    for lv in enc.grid_levels(dims):
        pos = x * lv.scale + 0.5
        near_cell_edge |= (np.abs(pos - np.round(pos)) < 1e-4).any(axis=1)
    np.testing.assert_allclose(got32[~near_cell_edge], want[~near_cell_edge], rtol=2e-4, atol=2e-5)


# -- gradients: central differences in float64 -------------------------------------------------------
def fd_model(spec):
    model = CpuBackend("float64").compile(spec)
    rng = np.random.default_rng(5)
    params = {k: (v if not k.startswith("grid") else rng.normal(0, 0.5, v.shape)).astype(np.float32)
              for k, v in init_params(spec).items()}
    model.set_params(params)
    return model, rng


def loss_at(model, x, y):
    loss, _ = model._loss_and_grads(x, y)
    return loss


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("doc, dims", GRIDS)
def test_grid_table_gradients_by_central_differences(doc, dims, interpolation):
    spec = grid_spec({**doc, "interpolation": interpolation}, n_in=dims, n_out=2,
                     network={"n_neurons": 16, "n_hidden_layers": 1, "activation": "Tanh"})
    model, rng = fd_model(spec)
    x = rng.uniform(0, 1, (24, dims))
    y = rng.normal(size=(24, 2))
    _, grads = model._loss_and_grads(x, y)
    g = grads["grid0"]
    table = model._params["grid0"]
    touched = np.argwhere(g != 0)
    assert len(touched) > 0
    picks = touched[rng.choice(len(touched), min(12, len(touched)), replace=False)]
    h = 1e-6
    for r, f in picks:
        keep = table[r, f]
        table[r, f] = keep + h
        model._refresh_compute_weights()
        up = loss_at(model, x, y)
        table[r, f] = keep - h
        model._refresh_compute_weights()
        down = loss_at(model, x, y)
        table[r, f] = keep
        model._refresh_compute_weights()
        fd = (up - down) / (2 * h)
        assert abs(fd - g[r, f]) <= 1e-6 * max(1.0, abs(fd)), (r, f, fd, g[r, f])


def test_composite_grid_and_sh_gradients_and_mlp_gradients():
    spec = grid_spec({"otype": "Composite", "nested": [
        {"otype": "SphericalHarmonics", "n_dims_to_encode": 3, "degree": 3},
        {"otype": "HashGrid", "n_dims_to_encode": 2, "n_levels": 3, "log2_hashmap_size": 6, "base_resolution": 4},
        {"otype": "TriangleWave", "n_frequencies": 3}]}, n_in=6, n_out=2)
    assert spec.n_encoded_dims == 9 + 6 + 3
    model, rng = fd_model(spec)
    x = rng.uniform(0, 1, (16, 6))
    y = rng.normal(size=(16, 2))
    _, grads = model._loss_and_grads(x, y)
    h = 1e-6
    for name, index in (("grid0", None), ("W0", (3, 10)), ("W0", (1, 16))):
        array = model._params[name]
        index = index or tuple(np.argwhere(grads[name] != 0)[0])
        keep = array[index]
        array[index] = keep + h
        model._refresh_compute_weights()
        up = loss_at(model, x, y)
        array[index] = keep - h
        model._refresh_compute_weights()
        down = loss_at(model, x, y)
        array[index] = keep
        model._refresh_compute_weights()
        assert abs((up - down) / (2 * h) - grads[name][index]) <= 1e-7 * max(1.0, abs(grads[name][index]))


# -- spherical harmonics and the triangle wave against their closed forms ----------------------------
def real_sh(l_max, d):
    """Real spherical harmonics by the associated Legendre recurrence (Condon–Shortley phase), in
    tcnn's order and signs: index l² + l + m, m < 0 from √2·Im(Y_l^|m|), m > 0 from √2·Re(Y_l^m)."""
    x, y, z = d[:, 0], d[:, 1], d[:, 2]
    theta, phi = np.arccos(np.clip(z, -1, 1)), np.arctan2(y, x)
    ct, st = np.cos(theta), np.sin(theta)
    p = {(0, 0): np.ones_like(ct)}
    for m in range(1, l_max):
        p[(m, m)] = -(2 * m - 1) * st * p[(m - 1, m - 1)]
    for m in range(l_max):
        for l in range(m + 1, l_max):
            p[(l, m)] = ((2 * l - 1) * ct * p[(l - 1, m)] - (l + m - 1) * p.get((l - 2, m), 0)) / (l - m)
    out = np.zeros((len(d), l_max * l_max))
    for l in range(l_max):
        for m in range(-l, l + 1):
            a = abs(m)
            k = math.sqrt((2 * l + 1) / (4 * math.pi) * math.factorial(l - a) / math.factorial(l + a))
            if m == 0:
                out[:, l * l + l] = k * p[(l, 0)]
            elif m > 0:
                out[:, l * l + l + m] = math.sqrt(2) * k * p[(l, a)] * np.cos(a * phi)
            else:
                out[:, l * l + l + m] = math.sqrt(2) * k * p[(l, a)] * np.sin(a * phi)
    return out


@pytest.mark.parametrize("degree", range(1, 9))
def test_spherical_harmonics_match_the_closed_forms(degree):
    rng = np.random.default_rng(degree)
    d = rng.normal(size=(200, 3))
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    enc = grid_spec({"otype": "SphericalHarmonics", "degree": degree}, n_in=3).encoding
    got = nm.encode(enc, (d + 1) / 2)  # tcnn maps [0, 1] to directions 2x − 1
    assert got.shape == (200, degree * degree)
    np.testing.assert_allclose(got, real_sh(degree, d), rtol=1e-9, atol=1e-10)
    got32 = nm.encode(enc, ((d + 1) / 2).astype(np.float32))
    assert got32.dtype == np.float32
    np.testing.assert_allclose(got32, got, atol=5e-5 * degree**2)


def test_triangle_wave_matches_its_closed_form():
    rng = np.random.default_rng(2)
    x = rng.uniform(-2, 2, (100, 3))
    enc = grid_spec({"otype": "TriangleWave", "n_frequencies": 6}, n_in=3).encoding
    got = nm.encode(enc, x)
    k = np.arange(6)
    v = x[:, :, None] * 2.0 ** (k - 1) + k / 4
    want = (2 / np.pi) * np.arcsin(np.cos(2 * np.pi * v))
    np.testing.assert_allclose(got, want.reshape(100, -1), atol=1e-9)


# -- parameters and the optimizer ---------------------------------------------------------------------
def test_grid_init_is_tcnns_and_leaves_the_layers_alone():
    spec = grid_spec({"otype": "HashGrid", "n_levels": 4, "log2_hashmap_size": 10})
    params = init_params(spec)
    g = params["grid0"]
    assert g.dtype == np.float32 and g.shape == spec.grid_shapes["grid0"]
    assert np.abs(g).max() <= 1e-4 and g.std() > 4e-5  # uniform in ±1e-4
    assert np.array_equal(g, init_params(spec)["grid0"])
    plain = MLPSpec.from_json({**spec.to_json(), "n_input_dims": 8, "encoding": {"otype": "Identity"}})
    assert plain.layer_dims == spec.layer_dims
    for name, value in init_params(plain).items():
        assert np.array_equal(params[name], value)  # the layers draw first, as without a grid


@pytest.mark.parametrize("numerics", ["fp32", "emulate", "float64"])
def test_adam_steps_grid_entries_as_tcnn_does(numerics):
    spec = grid_spec({"otype": "HashGrid", "n_levels": 3, "log2_hashmap_size": 12, "base_resolution": 8},
                     optimizer={"otype": "Adam", "learning_rate": 1e-2, "l2_reg": 0.5}, precision="fp16")
    model = CpuBackend(numerics).compile(spec)
    rng = np.random.default_rng(1)
    x1, y1 = rng.uniform(0, 0.3, (32, 2)), rng.normal(size=(32, 3))
    x2, y2 = rng.uniform(0.6, 1, (32, 2)), rng.normal(size=(32, 3))
    before = model.get_params()["grid0"]
    _, g1 = model.loss_and_grads(x1, y1)
    model.train_step(x1, y1)
    after = model.get_params()["grid0"]
    touched = g1["grid0"] != 0
    # untouched entries do not move although l2_reg is 0.5: tcnn's Adam skips zero gradients and
    # applies no l2_reg to encoding parameters; the first step moves a touched entry by lr·sign(g)
    assert np.array_equal(after[~touched], before[~touched])
    np.testing.assert_allclose(after[touched] - before[touched], -1e-2 * np.sign(g1["grid0"][touched]),
                               rtol=1e-3 if numerics != "float64" else 1e-6)  # float32 get_params
    model.train_step(x2, y2)
    steps = model.get_optimizer_state()["steps.grid0"]
    _, g2 = CpuBackend(numerics).compile(spec).loss_and_grads(x2, y2)
    assert steps.dtype == np.uint32 and steps.max() == 2
    assert np.array_equal(steps, touched.astype(np.uint32) + (g2["grid0"] != 0))
    # the state (per-entry steps included) restores into a fresh model that then steps identically
    twin = CpuBackend(numerics).compile(spec)
    twin.set_params(model.get_params())
    twin.set_optimizer_state(model.get_optimizer_state())
    model.train_step(x1, y1)
    twin.train_step(x1, y1)
    for name, value in model.get_params().items():  # float64 masters cross get/set_params as float32
        np.testing.assert_allclose(twin.get_params()[name], value, rtol=0 if numerics != "float64" else 1e-6)


def test_grid_params_round_trip_and_are_checked():
    spec = grid_spec({"otype": "TiledGrid", "n_levels": 2, "base_resolution": 4})
    model = CpuBackend().compile(spec)
    params = model.get_params()
    assert set(params) == {"W0", "b0", "W1", "b1", "grid0"}
    params["grid0"] = np.random.default_rng(0).normal(size=params["grid0"].shape).astype(np.float32)
    model.set_params(params)
    assert np.array_equal(model.get_params()["grid0"], params["grid0"])
    with pytest.raises(Exception, match="grid0 must have shape"):
        model.set_params({**params, "grid0": params["grid0"][:-1]})


# -- training ----------------------------------------------------------------------------------------
def test_hash_grid_model_fits_a_picture():
    spec = MLPSpec.from_json({"n_input_dims": 2, "n_output_dims": 3, "seed": 3, "precision": "fp32",
                              "encoding": {"otype": "HashGrid", "n_levels": 8, "n_features_per_level": 2,
                                           "log2_hashmap_size": 12, "base_resolution": 8, "per_level_scale": 1.5},
                              "network": {"n_neurons": 32, "n_hidden_layers": 2},
                              "optimizer": {"otype": "Adam", "learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.99,
                                            "epsilon": 1e-15}})
    image = demo_image(32)
    u, v = np.meshgrid((np.arange(32) + 0.5) / 32, (np.arange(32) + 0.5) / 32, indexing="xy")
    x = np.stack([u.ravel(), v.ravel()], 1).astype(np.float32)
    y = image.reshape(-1, 3)
    model = CpuBackend("fp32").compile(spec)
    losses = model.train_step(x, y, steps=150)
    assert losses[-1] < losses[0] / 30, (losses[0], losses[-1])  # measured: ~1/200
