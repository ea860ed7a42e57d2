"""Training on the cuda device without a host round trip per step (skipped without a GPU):
train_step's captured CUDA graph against the same steps launched one by one, and train_epochs
(the batch gathered on the device in the epoch's order) against train_step on the same batches
gathered on the host. Both pairs run the same kernels in the same order, so they must agree
bit for bit; the kernels' numerics against the float64 oracle are tests/test_cuda.py's."""

from __future__ import annotations

import numpy as np
import pytest

from mmad.backends.cache import KernelCache
from mmad.backends.contract import EpochPosition, init_params
from mmad.backends.cuda.knobs import CUDA_GRAPHS_ENV
from mmad.backends.numerics import epoch_rows
from mmad.spec import bench_spec
from test_cuda import _cuda_backend

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    return _cuda_backend()


VARIANTS = ["mma", "wgmma"]  # wgmma: its own training kernels (mlp_wgmma_train.cu)


def _pair(backend, spec, monkeypatch, graphs=(True, True), variant="mma"):
    row = {r.variant: r for r in backend.probe()}[variant]
    if not row.available:
        pytest.skip(f"the cuda {variant} variant is unavailable here: {row.reason}")
    models = []
    for on in graphs:
        monkeypatch.setenv(CUDA_GRAPHS_ENV, "1" if on else "0")
        model = backend.compile(spec, variant=variant, cache=KernelCache())
        model.set_params(init_params(spec))
        models.append(model)
    return models


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["S", "M", "L"])
@pytest.mark.parametrize("rows", [1000, 1 << 14])
def test_graph_replay_equals_launching_each_step(backend, monkeypatch, name, rows, variant) -> None:
    rng = np.random.default_rng()
    spec = bench_spec(name)
    replayed, launched = _pair(backend, spec, monkeypatch, graphs=(True, False), variant=variant)
    x = rng.uniform(-1, 1, size=(rows, spec.n_input_dims)).astype(np.float32)
    y = rng.uniform(-1, 1, size=(rows, spec.n_output_dims)).astype(np.float32)
    dx, dy = replayed.upload(x), replayed.upload(y)
    a = np.concatenate([replayed.train_step(dx, dy, 20), replayed.train_step(dx, dy, 7)])
    b = np.concatenate([launched.train_step(dx, dy, 20), launched.train_step(dx, dy, 7)])
    assert np.all(np.isfinite(a)) and a[-1] < a[0]
    assert np.array_equal(a, b)
    assert replayed.step_count == launched.step_count == 27
    for key, value in replayed.get_params().items():
        assert np.array_equal(value, launched.get_params()[key]), key
    state_a, state_b = replayed.get_optimizer_state(), launched.get_optimizer_state()
    assert all(np.array_equal(state_a[k], state_b[k]) for k in state_a)


@pytest.mark.parametrize(("name", "dtype", "rows", "batch", "steps"), [
    ("S", np.float32, 1000, 300, 10),       # 3 batches an epoch: the run crosses epoch ends
    ("L", np.float32, 20_000, 4096, 7),     # the unfused training kernels reading the dataset in place
    ("M", np.float16, 70_001, 1 << 14, 9),  # fp16: gathered into fp32 batch buffers
    ("M", np.float32, 4097, 4097, 3),       # the batch is the whole dataset
])
@pytest.mark.parametrize("variant", VARIANTS)
def test_train_epochs_equals_train_step_on_the_same_batches(backend, monkeypatch, name, dtype, rows, batch,
                                                             steps, variant) -> None:
    rng = np.random.default_rng()
    spec = bench_spec(name)
    device, host = _pair(backend, spec, monkeypatch, variant=variant)
    x = rng.uniform(-1, 1, size=(rows, spec.n_input_dims)).astype(dtype)
    y = rng.uniform(-1, 1, size=(rows, spec.n_output_dims)).astype(dtype)
    data = device.put_dataset([(x[:rows // 3], y[:rows // 3]), (x[rows // 3:], y[rows // 3:])], rows, dtype, dtype)
    assert data.on_device and data.x.dtype == dtype and data.rows == rows
    position = EpochPosition(int(rng.integers(0, 2**32)))
    first = steps // 2
    losses = np.concatenate([device.train_epochs(data, batch, first, position),
                             device.train_epochs(data, batch, steps - first, position)])
    walk, expected = EpochPosition(position.seed), []
    for _ in range(steps):
        idx = epoch_rows(walk.seed, walk.epoch, rows, walk.cursor, batch)
        expected.append(host.train_step(x[idx].astype(np.float32), y[idx].astype(np.float32), 1)[0])
        walk.advance(rows, batch)
    assert (position.epoch, position.cursor) == (walk.epoch, walk.cursor)
    assert np.array_equal(losses, np.array(expected, dtype=np.float32))
    for key, value in device.get_params().items():
        assert np.array_equal(value, host.get_params()[key]), key


def test_train_epochs_with_an_input_encoding(backend, monkeypatch) -> None:
    """An encoded model's dataset is encoded once on the way to the device."""
    rng = np.random.default_rng()
    spec = bench_spec("S", encoding={"otype": "Frequency", "n_frequencies": 4})
    device, host = _pair(backend, spec, monkeypatch)
    rows, batch, steps = 5000, 1024, 6
    x = rng.uniform(0, 1, size=(rows, spec.n_input_dims)).astype(np.float32)
    y = rng.uniform(-1, 1, size=(rows, spec.n_output_dims)).astype(np.float32)
    data = device.put_dataset([(x, y)], rows, np.float32, np.float32)
    assert data.x.shape == (rows, spec.n_encoded_dims)
    position = EpochPosition(99)
    losses = device.train_epochs(data, batch, steps, position)
    walk, expected = EpochPosition(99), []
    for _ in range(steps):
        idx = epoch_rows(walk.seed, walk.epoch, rows, walk.cursor, batch)
        expected.append(host.train_step(x[idx], y[idx], 1)[0])
        walk.advance(rows, batch)
    assert np.array_equal(losses, np.array(expected, dtype=np.float32))


def test_wgmma_and_cublaslt_train_from_device_datasets(backend, monkeypatch) -> None:
    """The other cuda variants keep datasets on the device too (cublaslt gathers per step)."""
    rng = np.random.default_rng()
    spec = bench_spec("M")
    model = backend.compile(spec, variant="cublaslt", cache=KernelCache())
    rows = 3000
    x = rng.uniform(-1, 1, size=(rows, spec.n_input_dims)).astype(np.float32)
    y = rng.uniform(-1, 1, size=(rows, spec.n_output_dims)).astype(np.float32)
    data = model.put_dataset([(x, y)], rows, np.float32, np.float32)
    assert data.on_device
    losses = model.train_epochs(data, 512, 12, EpochPosition(5))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
