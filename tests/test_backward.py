"""Backward from an outside gradient (the contract's forward_train / backward) on the cpu backend:
parameter and input gradients against central finite differences in float64, for every encoding
and activation, on fresh random data; the emulate and fp32 modes against the float64 oracle; and
the context's checks."""

from __future__ import annotations

import numpy as np
import pytest

from mmad.backends.contract import param_shapes
from mmad.backends.cpu import CpuBackend
from mmad.errors import InvalidInput
from mmad.spec import ACTIVATIONS, MLPSpec
from oracle import case_rng, rel_err

EPS = 1e-6
GRID = {"n_levels": 3, "n_features_per_level": 2, "log2_hashmap_size": 8, "base_resolution": 3, "per_level_scale": 2.0}
ENCODINGS = {
    "Identity": (3, {"otype": "Identity", "scale": 0.7, "offset": 0.2}),
    "Frequency": (2, {"otype": "Frequency", "n_frequencies": 3}),
    "OneBlob": (2, {"otype": "OneBlob", "n_bins": 8}),
    "SphericalHarmonics": (3, {"otype": "SphericalHarmonics", "degree": 4}),
    "TriangleWave": (2, {"otype": "TriangleWave", "n_frequencies": 3}),
    "HashGrid": (3, {"otype": "HashGrid", **GRID}),
    "DenseGrid-Smoothstep": (2, {"otype": "DenseGrid", **GRID, "interpolation": "Smoothstep"}),
    "TiledGrid-Nearest": (2, {"otype": "TiledGrid", **GRID, "interpolation": "Nearest"}),
    "Composite": (6, {"otype": "Composite", "nested": [
        {"otype": "HashGrid", "n_dims_to_encode": 3, **GRID},
        {"otype": "SphericalHarmonics", "n_dims_to_encode": 3, "degree": 3}]}),
}


def make_spec(encoding: str, activation: str = "Tanh", output_activation: str = "None", precision: str = "fp32",
              n_out: int = 3) -> MLPSpec:
    n_in, enc = ENCODINGS[encoding]
    return MLPSpec.from_json({
        "n_input_dims": n_in, "n_output_dims": n_out, "encoding": enc, "precision": precision,
        "network": {"otype": "FullyFusedMLP", "n_neurons": 16, "n_hidden_layers": 2, "activation": activation,
                    "output_activation": output_activation}})


def random_params(spec: MLPSpec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Weights, biases and grid tables all nonzero (biases too), large enough to matter."""
    params = {}
    for name, shape in param_shapes(spec).items():
        scale = 0.5 if name.startswith("grid") else 1.0 / np.sqrt(shape[-1]) if name.startswith("W") else 0.3
        params[name] = rng.uniform(-scale, scale, size=shape)
    return params


def oracle(spec: MLPSpec, params: dict[str, np.ndarray], mode: str = "float64"):
    model = CpuBackend(mode).compile(spec)
    model.set_params(params)
    return model


def loss_of(model, x: np.ndarray, g: np.ndarray) -> float:
    """L = Σ y · g: its d L / d y is g, the outside gradient."""
    y, _ = model.forward_train(x, out_dtype=np.float64)
    return float((y * g).sum())


def inputs(spec: MLPSpec, rng: np.random.Generator, rows: int) -> np.ndarray:
    # away from 0 and 1, where OneBlob's wrap-around and a Dense grid's edge sit
    return rng.uniform(0.05, 0.95, size=(rows, spec.n_input_dims))


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_gradients_match_finite_differences_for_every_encoding(encoding):
    rng = case_rng("backward-fd", encoding)
    spec = make_spec(encoding)
    params = random_params(spec, rng)
    x = inputs(spec, rng, 6)
    g = rng.normal(size=(6, spec.n_output_dims))
    model = oracle(spec, params)
    y, ctx = model.forward_train(x, out_dtype=np.float64)
    dx, grads = model.backward(ctx, g, want_input_grad=True)
    assert set(grads) == set(param_shapes(spec))
    check_parameter_directions(spec, params, x, g, grads, rng)
    check_input_entries(spec, params, x, g, dx)


def check_parameter_directions(spec, params, x, g, grads, rng) -> None:
    """For each parameter, d L along a random direction v (every entry of it) by central
    differences equals Σ grad · v."""
    for name, value in params.items():
        v = rng.normal(size=value.shape)
        plus = oracle(spec, {**params, name: value + EPS * v})
        minus = oracle(spec, {**params, name: value - EPS * v})
        fd = (loss_of(plus, x, g) - loss_of(minus, x, g)) / (2 * EPS)
        analytic = float((grads[name] * v).sum())
        assert abs(analytic - fd) <= 1e-6 * max(1.0, abs(fd)), (name, analytic, fd)


def check_input_entries(spec, params, x, g, dx) -> None:
    """d L / d x entry by entry by central differences."""
    model = oracle(spec, params)
    fd = np.empty_like(x)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += EPS
        xm[idx] -= EPS
        fd[idx] = (loss_of(model, xp, g) - loss_of(model, xm, g)) / (2 * EPS)
    assert dx.shape == x.shape
    if not np.abs(fd).max() > 1e-3:  # only a Nearest grid has no input gradient (tcnn's: 0)
        assert spec.encoding.interpolation == "Nearest"
        assert np.abs(dx).max() == 0
        return
    assert rel_err(dx, fd) < 1e-6, (dx, fd)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradients_match_finite_differences_for_every_activation(activation):
    rng = case_rng("backward-act", activation)
    # the same activation inside and at the output: both derivatives are in the chain
    spec = make_spec("Frequency", activation=activation, output_activation=activation)
    params = random_params(spec, rng)
    x = inputs(spec, rng, 5)
    g = rng.normal(size=(5, spec.n_output_dims))
    model = oracle(spec, params)
    _, ctx = model.forward_train(x, out_dtype=np.float64)
    dx, grads = model.backward(ctx, g, want_input_grad=True)
    check_parameter_directions(spec, params, x, g, grads, rng)
    check_input_entries(spec, params, x, g, dx)


def test_backward_of_a_loss_equals_loss_and_grads():
    """The gradient of the L2 loss handed in from outside gives what loss_and_grads gives."""
    rng = case_rng("backward-l2")
    spec = make_spec("HashGrid", activation="ReLU")
    params = random_params(spec, rng)
    x, y = inputs(spec, rng, 300), rng.normal(size=(300, 3))
    model = oracle(spec, params)
    pred, ctx = model.forward_train(x, out_dtype=np.float64)
    dx, grads = model.backward(ctx, 2 * (pred - y) / y.size)
    assert dx is None
    _, ref = model.loss_and_grads(x, y)
    for name in ref:
        assert rel_err(grads[name], ref[name]) < 1e-5, name


# emulate is checked through Tanh: under ReLU a pre-activation within fp16 rounding of zero flips
# its gradient on and off, and over 150 seeds those few rows took the error from a median of
# 6e-4 to 9e-2; with Tanh the worst of 100 seeds was 2.5e-3.
@pytest.mark.parametrize("mode,activation,tolerance", [("fp32", "ReLU", 1e-5), ("emulate", "Tanh", 5e-3)])
def test_every_mode_follows_the_float64_oracle(mode, activation, tolerance):
    """fp32 within float32 rounding of the oracle, emulate (fp16 at the kernels' rounding points,
    the loss scale applied) within fp16's."""
    rng = case_rng("backward-modes", mode)
    spec = make_spec("Composite", activation=activation, precision="fp16" if mode == "emulate" else "fp32")
    params = random_params(spec, rng)
    x = inputs(spec, rng, 512)
    g = rng.normal(size=(512, 3)).astype(np.float32)
    ref_model = oracle(spec, params)
    _, ref_ctx = ref_model.forward_train(x)
    ref_dx, ref = ref_model.backward(ref_ctx, g, want_input_grad=True)
    model = oracle(spec, params, mode)
    _, ctx = model.forward_train(x.astype(np.float32))
    dx, grads = model.backward(ctx, g, want_input_grad=True)
    assert dx.dtype == np.float32
    for name in ref:
        assert grads[name].dtype == np.float32
        assert rel_err(grads[name], ref[name]) < tolerance, name
    assert rel_err(dx, ref_dx) < tolerance


def test_backward_refuses_a_stale_or_foreign_context_and_a_wrong_gradient():
    rng = case_rng("backward-context")
    spec = make_spec("Identity")
    model = oracle(spec, random_params(spec, rng))
    other = oracle(spec, random_params(spec, rng))
    x = inputs(spec, rng, 4)
    _, ctx = model.forward_train(x)
    g = np.ones((4, 3))
    with pytest.raises(InvalidInput, match="context forward_train of this model"):
        other.backward(ctx, g)
    with pytest.raises(InvalidInput, match=r"shape \[4, 3\]"):
        model.backward(ctx, np.ones((5, 3)))
    model.train_step(x, np.zeros((4, 3)))
    with pytest.raises(InvalidInput, match="parameters changed after forward_train"):
        model.backward(ctx, g)
    _, ctx = model.forward_train(x)
    model.set_params(model.get_params())
    with pytest.raises(InvalidInput, match="parameters changed after forward_train"):
        model.backward(ctx, g)
