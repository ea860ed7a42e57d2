"""Training from a held dataset: each epoch's order (numerics.epoch_rows, and the CUDA kernels'
copy of it), the position bookkeeping, and the contract's train_epochs on the cpu backend
against train_step on the same batches."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from mmad.backends.contract import EpochPosition
from mmad.backends.cpu import CpuBackend
from mmad.backends.numerics import batches_per_epoch, epoch_rows
from mmad.errors import InvalidInput
from mmad.shaders import read_source
from mmad.spec import bench_spec


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 1000, 4097, 65_537])
def test_every_row_once_per_epoch(rows: int) -> None:
    for epoch in range(3):
        order = epoch_rows(12345, epoch, rows, 0, rows)
        assert np.array_equal(np.sort(order), np.arange(rows))


def test_orders_differ_between_epochs_and_seeds_and_look_shuffled() -> None:
    rows = 10_000
    a, b, c = epoch_rows(1, 0, rows, 0, rows), epoch_rows(1, 1, rows, 0, rows), epoch_rows(2, 0, rows, 0, rows)
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(a, epoch_rows(1, 0, rows, 0, rows))  # a seed repeats its order
    # a shuffle: consecutive positions are not neighbouring rows, and rows stay put only by chance
    assert np.mean(np.abs(np.diff(a)) <= 2) < 0.01
    assert np.sum(a == np.arange(rows)) < 10
    # positions in a window are the same rows whichever window asks for them
    assert np.array_equal(epoch_rows(1, 0, rows, 300, 500), a[300:800])


def test_position_advances_like_one_step_at_a_time() -> None:
    rng = np.random.default_rng()
    for _ in range(50):
        rows = int(rng.integers(1, 500))
        batch = int(rng.integers(1, rows + 1))
        one, many = EpochPosition(7), EpochPosition(7)
        steps = int(rng.integers(1, 40))
        for _ in range(steps):
            one.advance(rows, batch)
        many.advance(rows, batch, steps)
        assert (one.epoch, one.cursor) == (many.epoch, many.cursor)
        assert one.cursor + batch <= rows  # a batch never straddles two epochs
        assert one.epoch == steps // batches_per_epoch(rows, batch)


def test_cuda_kernels_copy_the_epoch_order(tmp_path) -> None:
    """mix32 and epoch_row of mlp_mma.cu, built for the host with g++, give numerics' rows."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed here: the CUDA copy of the epoch order is checked where it is")
    source = read_source("cuda/mlp_mma.cu")
    functions = re.search(r"__device__ __forceinline__ u32 mix32.*?\n}\n.*?epoch_row\(.*?\n}\n", source, re.S)
    assert functions, "mix32 / epoch_row not found in mlp_mma.cu"
    harness = tmp_path / "order.cpp"
    harness.write_text(
        "#include <cstdio>\n#include <cstdlib>\n#define __device__\n#define __forceinline__ inline\n"
        "typedef unsigned int u32; typedef long long i64;\n" + functions.group(0) +
        "int main(int argc, char** argv) {\n"
        "  u32 seed = strtoul(argv[1], 0, 10), epoch = strtoul(argv[2], 0, 10);\n"
        "  i64 rows = atoll(argv[3]); int h = 1; while ((1LL << (2 * h)) < rows) ++h;\n"
        "  for (i64 p = 0; p < rows; ++p) printf(\"%lld\\n\", epoch_row(seed, epoch, rows, h, p));\n}\n")
    binary = tmp_path / "order"
    subprocess.run([compiler, "-O1", "-Wno-unknown-pragmas", "-o", str(binary), str(harness)], check=True)
    rng = np.random.default_rng()
    for rows in (1, 3, 100, 4097, 70_001):
        seed, epoch = int(rng.integers(0, 2**32)), int(rng.integers(0, 1000))
        out = subprocess.run([str(binary), str(seed), str(epoch), str(rows)], check=True, capture_output=True, text=True)
        assert np.array_equal(np.array(out.stdout.split(), dtype=np.int64), epoch_rows(seed, epoch, rows, 0, rows))


def _dataset(model, rows: int, rng, dtype=np.float32):
    x = rng.uniform(-1, 1, size=(rows, model.spec.n_input_dims)).astype(dtype)
    y = rng.uniform(-1, 1, size=(rows, model.spec.n_output_dims)).astype(dtype)
    half = rows // 2
    return x, y, model.put_dataset([(x[:half], y[:half]), (x[half:], y[half:])], rows, x.dtype, y.dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_cpu_train_epochs_equals_train_step_on_the_same_batches(dtype) -> None:
    rng = np.random.default_rng()
    spec = bench_spec("S")
    model, reference = CpuBackend().compile(spec), CpuBackend().compile(spec)
    rows, batch, steps = 300, 64, 11  # 4 batches an epoch: the run crosses two epoch ends
    x, y, data = _dataset(model, rows, rng, dtype)
    assert data.rows == rows and not data.on_device and data.x.dtype == dtype
    position = EpochPosition(int(rng.integers(0, 2**32)))
    losses = np.concatenate([model.train_epochs(data, batch, 5, position),
                             model.train_epochs(data, batch, steps - 5, position)])
    expected, seen = [], np.zeros(rows, dtype=np.int64)
    walk = EpochPosition(position.seed)
    for _ in range(steps):
        idx = epoch_rows(walk.seed, walk.epoch, rows, walk.cursor, batch)
        seen[idx] += 1
        expected.append(reference.train_step(x[idx], y[idx], 1)[0])
        walk.advance(rows, batch)
    assert (position.epoch, position.cursor) == (walk.epoch, walk.cursor) == (2, 3 * batch)
    assert np.array_equal(losses, np.array(expected, dtype=np.float32))
    for name, value in model.get_params().items():
        assert np.array_equal(value, reference.get_params()[name]), name
    # two whole epochs and three batches: no row more than three times, every row at least twice
    # except those an epoch's remainder left out (rows % batch per epoch)
    assert seen.max() <= 3 and seen.sum() == steps * batch
    assert np.sum(seen < 2) <= 2 * (rows % batch)


def test_train_epochs_refuses_a_batch_larger_than_the_dataset() -> None:
    rng = np.random.default_rng()
    model = CpuBackend().compile(bench_spec("S"))
    _, _, data = _dataset(model, 10, rng)
    with pytest.raises(InvalidInput, match="batch_size 11"):
        model.train_epochs(data, 11, 1, EpochPosition(0))
    with pytest.raises(InvalidInput, match="chunks hold 10 rows, not the 12"):
        model.put_dataset([(np.zeros((10, model.spec.n_input_dims), np.float32),
                            np.zeros((10, model.spec.n_output_dims), np.float32))], 12, np.float32, np.float32)
