"""The cuda backend's wgmma training (mlp_wgmma_train.cu: forward, loss and backward through the
resident weights read transposed; weight gradients as wgmma over the batch): loss and gradients
against the float64 oracle and 200-step loss curves, as tests/test_cuda.py checks the mma
kernels; skipped, with the reason, where the probe does not offer wgmma (an sm_90 GPU, nvcc).
Its layout arithmetic is checked on the CPU in tests/test_cuda_wgmma.py."""

from __future__ import annotations

import numpy as np
import pytest
from oracle import case_rng, rel_err

from mmad.backends.cuda.wgmma import WgmmaPlan
from mmad.errors import SpecError
from mmad.spec import LOSSES, bench_spec
from test_cuda import FWD_TOL, GRAD_TOL_EMULATE, LOSS_TOL, MODEL_CASES, check_grads, inputs, make_pair, random_params
from test_cuda_wgmma import ODD_SPECS, cache, wgmma_backend  # noqa: F401 - fixtures

pytestmark = pytest.mark.gpu

# W's weights (512 KiB) do not fit shared memory: the wgmma variant does not take it
CASES = [(n, a) for n, a in MODEL_CASES if n != "W"]


@pytest.fixture(scope="module")
def backend(wgmma_backend):
    return wgmma_backend


_models: dict = {}


def wgmma_pair(backend, cache, spec, rng):
    key = spec.content_hash()
    if key not in _models:
        _models[key] = make_pair(backend, cache, spec, rng, variant="wgmma")
    model, oracle = _models[key]
    params = random_params(spec, rng)
    model.set_params(params)
    oracle.set_params(params)
    return model, oracle


@pytest.mark.parametrize("batch", [1, 7, 1000, 65_537])
@pytest.mark.parametrize(("name", "activation"), CASES)
def test_gradients_match_oracle(backend, cache, name, activation, batch):
    rng = case_rng(name, activation, batch, "wg")
    spec = bench_spec(name, activation=activation)
    model, oracle = wgmma_pair(backend, cache, spec, rng)
    assert model.variant == "wgmma" and model.wgmma_training
    x = inputs(rng, batch, spec)
    y = rng.standard_normal((batch, spec.n_output_dims), dtype=np.float32)
    check_grads(model, oracle, x, y, f"wgmma {name}/{activation}/batch {batch}")


@pytest.mark.parametrize("name", ["S", "M", "L"])
def test_gradients_at_2_20_rows(backend, cache, name):
    """A full persistent grid, many tiles a warpgroup and many chunks of the weight gradients:
    the loss against float64, the gradients against the mma variant's on the same parameters (an
    independent kernel, itself checked against float64 at 65,537 rows; the fp16 emulation of 2^20
    rows would take minutes)."""
    rng = case_rng(name, "2^20", "wg")
    spec = bench_spec(name)
    model, oracle = wgmma_pair(backend, cache, spec, rng)
    mma_model = backend.compile(spec, variant="mma", cache=cache)
    try:
        mma_model.set_params(model.get_params())
        x = inputs(rng, 1 << 20, spec)
        y = rng.standard_normal((1 << 20, spec.n_output_dims), dtype=np.float32)
        loss, grads = model.loss_and_grads(x, y)
        ref_loss = float(np.mean((oracle.forward(x).astype(np.float64) - y) ** 2))  # bench_spec's loss: L2
        assert spec.loss == "L2" and abs(loss - ref_loss) <= LOSS_TOL * ref_loss, (loss, ref_loss)
        mma_loss, mma_grads = mma_model.loss_and_grads(x, y)
        assert abs(loss - mma_loss) <= LOSS_TOL * mma_loss
        for key, value in grads.items():
            assert rel_err(value, mma_grads[key]) <= GRAD_TOL_EMULATE, key
    finally:
        mma_model.close()


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss(backend, cache, loss):
    rng = case_rng(loss, "wg")
    spec = bench_spec("S", loss=loss, output_activation="None")
    model, oracle = wgmma_pair(backend, cache, spec, rng)
    x = rng.standard_normal((777, spec.n_input_dims), dtype=np.float32)
    y = rng.standard_normal((777, spec.n_output_dims), dtype=np.float32)
    check_grads(model, oracle, x, y, f"wgmma loss {loss}")


@pytest.mark.parametrize("name", list(ODD_SPECS))
@pytest.mark.parametrize("activation", ["ReLU", "SiLU"])
def test_odd_shapes(backend, cache, name, activation):
    """Input, width and output padding (the training image's output layer padded to 16 rows;
    SiLU stores its derivative)."""
    rng = case_rng(name, activation, "wg")
    spec = bench_spec("M", activation=activation).replace(**ODD_SPECS[name])
    model, oracle = wgmma_pair(backend, cache, spec, rng)
    x = rng.uniform(-1, 1, (1001, spec.n_input_dims)).astype(np.float32)
    y = rng.standard_normal((1001, spec.n_output_dims), dtype=np.float32)
    check_grads(model, oracle, x, y, f"wgmma {name}/{activation}")


@pytest.mark.parametrize(("name", "activation", "optimizer"),
                         [(n, a, "Adam") for n, a in CASES[:6]] + [("M", "Tanh", "SGD")])
def test_200_steps_follow_the_oracle(backend, cache, name, activation, optimizer):
    rng = case_rng(name, activation, optimizer, "wg")
    opt = ({"otype": "Adam", "learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-15}
           if optimizer == "Adam" else {"otype": "SGD", "learning_rate": 1e-2, "momentum": 0.9})
    spec = bench_spec(name, activation=activation, optimizer=opt)
    model, oracle = make_pair(backend, cache, spec, rng, variant="wgmma")
    x = inputs(rng, 512, spec)
    proj = rng.standard_normal((spec.n_input_dims, spec.n_output_dims)) / np.sqrt(spec.n_input_dims)
    y = np.tanh(x @ proj).astype(np.float32)
    losses = model.train_step(x, y, steps=200)
    ref = oracle.train_step(x, y, steps=200)
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert abs(losses[-1] - ref[-1]) <= 0.05 * ref[-1], f"final loss {losses[-1]} vs oracle {ref[-1]}"
    # the forward served after training reads the trained parameters
    oracle.set_params(model.get_params())
    assert rel_err(model.forward(x), oracle.forward(x)) <= FWD_TOL


def test_w_is_refused_with_the_reason(backend, cache):
    with pytest.raises(SpecError, match="shared memory"):
        backend.compile(bench_spec("W"), variant="wgmma", cache=cache)
    assert not WgmmaPlan(bench_spec("W"), training=True).trains
    model = backend.compile(bench_spec("W"), variant="wgmma+mma", cache=cache)
    assert model.variant == "wgmma+mma" and not model.wgmma_training
    model.close()
