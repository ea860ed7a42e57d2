"""The cpu backend (the oracle): gradients, numerics modes, training, state round trips."""

from __future__ import annotations

import numpy as np
import pytest

from mmad.backends import numerics as nm
from mmad.backends.contract import init_params
from mmad.backends.cpu import HOST_CHUNK_ROWS, CpuBackend, CpuModel
from mmad.errors import InvalidInput
from mmad.spec import ACTIVATIONS, LOSSES, MLPSpec, bench_spec


def small_spec(**network) -> MLPSpec:
    doc = {"n_input_dims": 3, "n_output_dims": 2,
           "network": {"otype": "FullyFusedMLP", "activation": "Tanh", "output_activation": "None",
                       "n_neurons": 16, "n_hidden_layers": 2},
           "encoding": {"otype": "Identity"}, "loss": {"otype": "L2"},
           "optimizer": {"otype": "Adam", "learning_rate": 1e-3}, "seed": 3}
    for key in ("encoding", "loss", "optimizer", "precision"):
        if key in network:
            doc[key] = network.pop(key)
    doc["network"].update(network)
    return MLPSpec.from_json(doc)


def fd_check(spec: MLPSpec, x: np.ndarray, y: np.ndarray, eps: float = 1e-6, n_probe: int = 40) -> float:
    """Largest relative error between analytic and central-difference gradients."""
    model = CpuModel(spec, "float64")
    _, grads = model._loss_and_grads(x, y)  # float64 gradients
    params = {k: v.astype(np.float64) for k, v in model._params.items()}
    pred0 = model._forward_chunk(x, keep=False)[0]

    def loss_at(p: dict) -> float:
        model._params = p
        model._refresh_compute_weights()
        pred = model._forward_chunk(x, keep=False)[0]
        values, _ = nm.loss_terms(spec.loss, pred, y, delta=spec.huber_delta, normaliser_from=pred0)
        return float(values.mean())

    rng = np.random.default_rng(11)
    worst = 0.0
    for name in params:
        flat_idx = rng.choice(params[name].size, size=min(n_probe, params[name].size), replace=False)
        for idx in flat_idx:
            plus = {k: v.copy() for k, v in params.items()}
            minus = {k: v.copy() for k, v in params.items()}
            plus[name].flat[idx] += eps
            minus[name].flat[idx] -= eps
            numeric = (loss_at(plus) - loss_at(minus)) / (2 * eps)
            analytic = grads[name].flat[idx]
            scale = max(abs(numeric), abs(analytic), 1e-7)
            worst = max(worst, abs(numeric - analytic) / scale)
    return worst


def data(spec: MLPSpec, rows: int, seed: int = 0, low: float = -1.0, high: float = 1.0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(low, high, (rows, spec.n_input_dims))
    y = rng.uniform(-1, 1, (rows, spec.n_output_dims))
    return x, y


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradients_every_activation(activation):
    spec = small_spec(activation=activation, output_activation=activation if activation != "Exponential" else "None")
    x, y = data(spec, 24)
    assert fd_check(spec, x, y) < 1e-5


@pytest.mark.parametrize("loss", LOSSES)
def test_gradients_every_loss(loss):
    spec = small_spec(loss={"otype": loss})
    x, y = data(spec, 24, seed=1)
    # MAPE/SMAPE/L1 are not differentiable at zero difference; random data never lands there
    assert fd_check(spec, x, y) < 1e-5


@pytest.mark.parametrize("encoding", [
    {"otype": "Frequency", "n_frequencies": 3},
    {"otype": "OneBlob", "n_bins": 8},
    {"otype": "Composite", "nested": [{"otype": "Frequency", "n_frequencies": 2, "n_dims_to_encode": 2},
                                      {"otype": "OneBlob", "n_bins": 4}]},
])
def test_gradients_every_encoding(encoding):
    spec = small_spec(encoding=encoding)
    x, y = data(spec, 24, seed=2, low=0.0, high=1.0)
    assert fd_check(spec, x, y) < 1e-5


def test_encodings_match_their_definitions():
    x = np.array([[0.28, 0.7]], dtype=np.float64)
    freq = nm.encode(small_spec(encoding={"otype": "Frequency", "n_frequencies": 2}).encoding, x)
    expected = [np.sin(np.pi * 0.28), np.cos(np.pi * 0.28), np.sin(2 * np.pi * 0.28), np.cos(2 * np.pi * 0.28)]
    np.testing.assert_allclose(freq[0, :4], expected, rtol=1e-12)
    blob = nm.encode(small_spec(encoding={"otype": "OneBlob", "n_bins": 16}).encoding, x)
    # each dim's bins hold the whole blob, peaked at the bin holding x (tests/test_encodings.py
    # checks every value against tiny-cuda-nn's kernel)
    assert blob.shape == (1, 32)
    assert abs(blob[0, :16].sum() - 1) < 1e-12 and blob[0, :16].argmax() == 4
    assert blob[0, 16:].argmax() == 11


@pytest.mark.parametrize("precision,tolerance", [("fp16", 3e-3), ("bf16", 2e-2), ("fp32", 1e-5)])
def test_emulated_precision_within_design_tolerance(precision, tolerance):
    spec = bench_spec("M", precision=precision)
    x = np.random.default_rng(5).standard_normal((2048, 64)).astype(np.float32)
    ref = CpuBackend("float64").compile(spec).forward(x)
    out = CpuBackend("emulate").compile(spec).forward(x)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert np.isfinite(err) and err <= tolerance
    if precision != "fp32":
        assert err > 1e-6, "rounding emulation must actually round"


def test_bf16_rounding_is_round_to_nearest_even():
    a = np.array([1.0, 1.00390625, 1.01171875, -3.3e-3, 65504.0], dtype=np.float32)
    r = nm.round_to("bf16", a)
    assert r[0] == 1.0 and r[1] == 1.0 and r[2] == 1.015625
    assert abs(r[3] - a[3]) / abs(a[3]) < 2 ** -8 and abs(r[4] - a[4]) / a[4] < 2 ** -8


def test_initialisation_is_deterministic_from_the_seed():
    spec = bench_spec("S")
    a, b = init_params(spec), init_params(spec)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    c = init_params(spec.replace(seed=7))
    assert not np.array_equal(a["W0"], c["W0"])
    np.testing.assert_array_equal(CpuBackend().compile(spec).get_params()["W1"], a["W1"])


def test_training_fits_a_2d_field():
    from mmad.demo import demo_field

    spec = MLPSpec.from_json({
        "n_input_dims": 2, "n_output_dims": 3,
        "network": {"activation": "ReLU", "n_neurons": 64, "n_hidden_layers": 3},
        "encoding": {"otype": "Frequency", "n_frequencies": 4},
        "optimizer": {"otype": "Adam", "learning_rate": 1e-2}, "seed": 5})
    model = CpuBackend("emulate").compile(spec)
    rng = np.random.default_rng(0)
    x_test = rng.random((4096, 2), dtype=np.float32)
    initial = float(np.mean((model.forward(x_test) - demo_field(x_test)) ** 2))
    for _ in range(300):
        x = rng.random((1024, 2), dtype=np.float32)
        model.train_step(x, demo_field(x))
    final = float(np.mean((model.forward(x_test) - demo_field(x_test)) ** 2))
    assert final < 2e-3 and final < initial / 20, (initial, final)


def test_sgd_with_momentum_reduces_the_loss():
    spec = small_spec(optimizer={"otype": "SGD", "learning_rate": 0.05, "momentum": 0.9})
    x, y = data(spec, 256, seed=4)
    losses = CpuBackend().compile(spec).train_step(x.astype(np.float32), (0.3 * y).astype(np.float32), steps=100)
    assert losses[-1] < 0.5 * losses[0]


def test_optimizer_state_round_trip_continues_identically():
    spec = bench_spec("S")
    x = np.random.default_rng(1).standard_normal((300, 32)).astype(np.float32)
    y = np.random.default_rng(2).standard_normal((300, 16)).astype(np.float32)
    straight = CpuBackend().compile(spec)
    straight.train_step(x, y, steps=6)
    first = CpuBackend().compile(spec)
    first.train_step(x, y, steps=3)
    resumed = CpuBackend().compile(spec)
    resumed.set_params(first.get_params())
    resumed.set_optimizer_state(first.get_optimizer_state())
    resumed.train_step(x, y, steps=3)
    for k, v in straight.get_params().items():
        np.testing.assert_array_equal(resumed.get_params()[k], v)


def test_bad_inputs_are_refused_clearly():
    model = CpuBackend().compile(bench_spec("S"))
    with pytest.raises(InvalidInput, match=r"shape \[rows, 32\]"):
        model.forward(np.ones((4, 31), dtype=np.float32))
    with pytest.raises(InvalidInput, match="float32 or float16"):
        model.forward(np.ones((4, 32), dtype=np.int32))
    with pytest.raises(InvalidInput, match="target has 3 rows"):
        model.train_step(np.ones((4, 32), np.float32), np.ones((3, 16), np.float32))
    params = model.get_params()
    params["W0"] = params["W0"][:, :-1]
    with pytest.raises(InvalidInput, match="W0 must have shape"):
        model.set_params(params)
    params = model.get_params()
    params["b1"][0] = np.nan
    with pytest.raises(InvalidInput, match="NaN"):
        model.set_params(params)


def test_any_row_count_including_one_and_chunk_boundaries():
    spec = bench_spec("S")
    model = CpuBackend().compile(spec)
    x = np.random.default_rng(9).standard_normal((8193, 32)).astype(np.float32)
    full = model.forward(x)
    np.testing.assert_allclose(model.forward(x[:1]), full[:1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.forward(x[8190:]), full[8190:], rtol=1e-5, atol=1e-6)


# -- forward_to_host: chunked, threaded, FP16 casts fused -------------------------------------
def test_half_to_float_matches_numpy_on_every_float16():
    from mmad.backends.cpu import half_to_float

    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = every[np.isfinite(every)]  # the fast path alone (no chunk with Inf/NaN)
    for src in (every, finite, finite[:7]):
        out = np.empty(src.shape, np.float32)
        half_to_float(src, out)
        assert np.array_equal(out.view(np.uint32), src.astype(np.float32).view(np.uint32))


def test_float_to_half_matches_numpy_rounding():
    """Bit-identical to NumPy's cast where rounding is decided: every float16 value, the midpoints
    between neighbours (ties to even) and one float32 ulp either side, subnormals, the largest
    values that still round to 65504, and random values over the finite FP16 range, all on the
    fast path (an array holding a value from 65520 up takes NumPy's cast); then overflow, Inf and
    NaN through NumPy's cast. (An exhaustive run over all 2^32 float32 bit patterns matched as
    well; too slow for the suite.)"""
    from mmad.backends.cpu import float_to_half

    def check(values):
        with np.errstate(over="ignore"):
            expected = values.astype(np.float16)
        out = np.empty(values.shape, np.float16)
        float_to_half(values, out, np.empty((2, values.size), np.uint32))
        assert np.array_equal(out.view(np.uint16), expected.view(np.uint16))

    halves = np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)  # +0 .. 65504
    mids = (halves[:-1] + halves[1:]) / 2  # exact in float32: 12 significant bits
    base = np.concatenate([halves, mids, [65504.0, 65519.99, 2.0 ** -25, 2.0 ** -26, 2.0 ** -149]]).astype(np.float32)
    bits = base.view(np.uint32)
    near = np.concatenate([bits, bits + 1, np.maximum(bits, 1) - 1]).view(np.float32)
    near = near[np.abs(near) < 65520]
    rng = np.random.default_rng(5)
    random_bits = rng.integers(0, 0x477FF000, size=200_000, dtype=np.uint32).view(np.float32)
    values = np.concatenate([near, random_bits])
    check(np.concatenate([values, -values]))
    check(np.array([1.0, 65520.0, -1e6, 0.5], np.float32))  # overflow to Inf
    check(np.array([1.0, np.nan, -np.inf], np.float32))  # NaN: NumPy's cast, payload and all


@pytest.mark.parametrize("rows", [1, 4096, 3 * 4096 + 123])
@pytest.mark.parametrize("wire", ["fp16", "fp32"])
def test_forward_to_host_equals_forward(rows, wire):
    """Chunked (with and without threads, rows not a multiple of the chunk), casts fused per chunk.

    The fused casts are bit-exact: FP16 output equals the same chunked forward's float32 output
    cast by NumPy. Against the unchunked ``forward`` the float32 results agree to float32
    rounding, not always bit for bit: BLAS picks its kernels by matrix shape, and for narrow
    layers (3 outputs) the chunk size changed the last bits."""
    from concurrent.futures import ThreadPoolExecutor

    model = CpuBackend().compile(bench_spec("M"))
    rng = np.random.default_rng(rows)
    model.set_params({k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in model.get_params().items()})
    dtype = np.float16 if wire == "fp16" else np.float32
    x = rng.uniform(-1, 1, (rows, 64)).astype(dtype)
    unchunked = model.forward(x.astype(np.float32))
    with ThreadPoolExecutor(2) as pool:
        for executor in (None, pool):
            out32 = np.full((rows, 64), np.nan, np.float32)
            model.forward_to_host(x, out32, executor)
            np.testing.assert_allclose(out32, unchunked, rtol=1e-6, atol=1e-6)
            out = np.full((rows, 64), np.nan, dtype)
            model.forward_to_host(x, out, executor)
            assert np.array_equal(out.view(np.uint8), out32.astype(dtype).view(np.uint8))


@pytest.mark.parametrize("numerics", ["fp32", "emulate", "float64"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_to_host_in_reused_buffers_equals_the_chunk_forward(activation, numerics):
    """forward_to_host keeps one set of buffers per thread and runs activations in place: every
    activation, output activations, an encoding and each numerics mode give the plain chunk
    forward's values, also when calls of other row counts reuse (and grow) the buffers."""
    from concurrent.futures import ThreadPoolExecutor

    spec = small_spec(activation=activation, output_activation="Sigmoid" if activation == "Tanh" else activation,
                      encoding={"otype": "Frequency", "n_frequencies": 3})
    model = CpuModel(spec, numerics)
    rng = np.random.default_rng(len(activation))
    with ThreadPoolExecutor(2) as pool:
        for rows in (5000, 3, 4096 * 2 + 1):
            x = rng.uniform(-1, 1, (rows, spec.n_input_dims)).astype(np.float32)
            # the same row blocks: BLAS may sum a row's products in another order for another
            # number of rows, and in emulate mode one ulp can move an fp16 rounding
            expected = np.concatenate([model._forward_chunk(x[s:s + HOST_CHUNK_ROWS], keep=False)[0]
                                       for s in range(0, rows, HOST_CHUNK_ROWS)]).astype(np.float32)
            out = np.full((rows, spec.n_output_dims), np.nan, np.float32)
            model.forward_to_host(x, out, pool)
            np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)


def test_activate_in_place_equals_activate():
    z = np.random.default_rng(2).normal(0, 2, (64, 16)).astype(np.float32)
    for name in ACTIVATIONS:
        work = z.copy()
        assert np.array_equal(nm.activate_in_place(name, work), nm.activate(name, z))
        assert np.array_equal(work, nm.activate(name, z))  # written over its argument


def test_forward_to_host_checks_its_buffers():
    model = CpuBackend().compile(bench_spec("M"))
    x = np.zeros((5, 64), np.float16)
    with pytest.raises(InvalidInput, match=r"shape \[5, 64\]"):
        model.forward_to_host(x, np.empty((4, 64), np.float32))
    with pytest.raises(InvalidInput, match="float16 or float32"):
        model.forward_to_host(x, np.empty((5, 64), np.float64))
    with pytest.raises(InvalidInput, match="shape"):
        model.forward_to_host(np.zeros((5, 63), np.float16), np.empty((5, 64), np.float32))
    readonly = np.empty((5, 64), np.float32)
    readonly.flags.writeable = False
    with pytest.raises(InvalidInput, match="writable"):
        model.forward_to_host(x, readonly)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_forward_to_host_check_finite(dtype):
    """check_finite refuses NaN and Inf wherever they are, passes the largest finite value, and
    leaves unchecked calls alone (the default of every backend but a GPU's device check)."""
    from mmad.errors import NonFiniteInput

    rng = np.random.default_rng()
    model = CpuBackend().compile(bench_spec("M"))
    x = rng.uniform(-1, 1, (3000, 64)).astype(dtype)
    out = np.empty((3000, 64), np.float32)
    model.forward_to_host(x, out, check_finite=True)
    assert np.allclose(out, model.forward(x.astype(np.float32)), rtol=1e-2, atol=1e-2)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[rng.integers(3000), rng.integers(64)] = bad
        with pytest.raises(NonFiniteInput, match="NaN or Inf"):
            model.forward_to_host(y, out, check_finite=True)
        model.forward_to_host(y, out)
    x[-1, -1] = np.finfo(dtype).max
    model.forward_to_host(x, out, check_finite=True)
