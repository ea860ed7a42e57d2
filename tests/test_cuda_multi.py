"""Several CUDA devices (skipped with the reason unless two are present): models compiled on
device 1 compute what device 0's do, and NCCL data-parallel training over two replicas follows
one device trained on the same global batches, with bitwise identical replicas afterwards.
tests/test_placement.py covers placement, replicas and the data-parallel bookkeeping without
a GPU (the cpu backend's virtual devices)."""

from __future__ import annotations

import numpy as np
import pytest

from mmad.backends.cpu import CpuModel
from mmad.backends.numerics import epoch_rows
from mmad.backends.parallel import shard_bounds, shard_positions
from mmad.errors import InvalidInput
from mmad.spec import bench_spec
from oracle import rel_err
from test_cuda import _cuda_backend

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    backend = _cuda_backend()
    count = len(backend.devices())
    if count < 2:
        pytest.skip(f"these tests need two CUDA devices; this host has {count}")
    return backend


@pytest.mark.parametrize("variant", ["mma", "cublaslt"])
def test_a_model_on_device_1_computes_what_the_oracle_does(backend, variant):
    rows = {r.variant: r for r in backend.probe()}
    if not rows[variant].available:
        pytest.skip(f"cuda:{variant} is unavailable here: {rows[variant].reason}")
    spec = bench_spec("M")
    rng = np.random.default_rng()
    model = backend.compile(spec, variant=variant, device=1)
    assert model.device_index == 1
    params = {k: rng.normal(0, 0.2, v.shape).astype(np.float32) for k, v in model.get_params().items()}
    model.set_params(params)
    x = rng.uniform(-1, 1, (3000, spec.n_input_dims)).astype(np.float32)
    oracle = CpuModel(spec, "float64")
    oracle.set_params(params)
    assert rel_err(model.forward(x), oracle.forward(x)) < 2e-2
    dx = model.upload(x)
    assert dx.device.id == 1  # uploads land on the model's device whatever the thread's current one
    out = np.full((3000, spec.n_output_dims), np.nan, np.float16)
    model.forward_to_host(x.astype(np.float16), out)
    assert rel_err(out.astype(np.float32), oracle.forward(x)) < 2e-2
    y = rng.uniform(-1, 1, (3000, spec.n_output_dims)).astype(np.float32)
    losses = model.train_step(x, y, 30)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    model.close()


def test_device_index_out_of_range_is_a_clear_error(backend):
    with pytest.raises(InvalidInput, match="device 9 does not exist: the cuda backend has devices 0 to"):
        backend.compile(bench_spec("S"), variant="mma", device=9)


@pytest.mark.parametrize(("name", "dtype", "part", "steps"), [
    ("M", np.float16, 1 << 14, 40),   # fp16 dataset: the batch gathered into fp32 buffers
    ("S", np.float32, 4000, 25),      # fp32 read in place through row numbers; odd part size
    ("L", np.float32, 2048, 15),      # the unfused training kernel (weight-gradient kernels)
])
def test_nccl_data_parallel_follows_one_device_on_the_same_global_batches(backend, name, dtype, part, steps):
    spec = bench_spec(name)
    rng = np.random.default_rng()
    rows = 6 * part + 3
    x = rng.uniform(-1, 1, (rows, spec.n_input_dims)).astype(dtype)
    y = rng.uniform(-1, 1, (rows, spec.n_output_dims)).astype(dtype)
    seed = int(rng.integers(2**32))
    bounds = shard_bounds(rows, 2)
    replicas = [backend.compile(spec, variant="mma", device=d) for d in (0, 1)]
    single = backend.compile(spec, variant="mma", device=0)
    trainer = backend.data_parallel(replicas)
    try:
        shards = [r.put_dataset([(x[a:b], y[a:b])], b - a, x.dtype, y.dtype) for r, (a, b) in zip(replicas, bounds)]
        assert [s.x.device.id for s in shards] == [0, 1]
        positions = shard_positions(seed, 2)
        losses = np.concatenate([trainer.train_epochs(shards, [part, part + 1], steps - 5, positions),
                                 trainer.train_epochs(shards, [part, part + 1], 5, positions)])
        reference, ref_positions = [], shard_positions(seed, 2)
        for _ in range(steps):
            take = []
            for (a, b), n, position in zip(bounds, (part, part + 1), ref_positions):
                take.append(a + epoch_rows(position.seed, position.epoch, b - a, position.cursor, n))
                position.advance(b - a, n)
            take = np.concatenate(take)
            reference.append(single.train_step(x[take].astype(np.float32), y[take].astype(np.float32))[0])
        assert [(p.epoch, p.cursor) for p in positions] == [(p.epoch, p.cursor) for p in ref_positions]
        # the same sums in another order: fp32 rounding, amplified a little by fp16 activations
        np.testing.assert_allclose(losses, reference, rtol=2e-3)
        assert losses[-1] < losses[0]
        params = [r.get_params() for r in replicas]
        for key, value in params[0].items():
            assert np.array_equal(value, params[1][key]), key  # the replicas never drift apart
            assert rel_err(value, single.get_params()[key]) < 1e-2, key
        states = [r.get_optimizer_state() for r in replicas]
        assert all(np.array_equal(states[0][k], states[1][k]) for k in states[0])
        assert replicas[0].step_count == replicas[1].step_count == steps
    finally:
        trainer.close()
        for model in (*replicas, single):
            model.close()
