"""vulkan: datasets held in device buffers and train_epochs drawing each batch on the device.

CI runs these on Mesa lavapipe (simt; coopmat skips there). ``gather_batch.comp`` computes the
epoch order itself (GLSL copy of ``numerics.epoch_rows``): checked against NumPy row by row
through the pipeline alone, then end to end: ``train_epochs`` on a held dataset against
``train_step`` on the same batches gathered on the host. Both run the same training dispatches
on the same fp32 batch buffers (the gather only copies: fp16 → fp32 is exact), so losses,
parameters and optimizer state must agree bit for bit.
"""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

from mmad.backends.cache import KernelCache
from mmad.backends.contract import Dataset, EpochPosition, init_params
from mmad.backends.numerics import batches_per_epoch, epoch_half_bits, epoch_rows
from mmad.errors import InvalidInput
from mmad.spec import bench_spec

vulkan = pytest.importorskip("mmad.backends.vulkan", reason="the vulkan Python package is not installed")
from mmad.backends.vulkan import runtime as vr  # noqa: E402
import test_vulkan  # noqa: E402

backend, variant = test_vulkan.backend, test_vulkan.variant  # the vulkan tests' device and variant fixtures

pytestmark = pytest.mark.vulkan

ENCODED = {"otype": "Frequency", "n_frequencies": 4}




@pytest.fixture(autouse=True)
def _collect():
    gc.collect()
    yield
    gc.collect()


def _data(rng, spec, rows, dtype):
    x = rng.uniform(-1, 1, size=(rows, spec.n_input_dims)).astype(dtype)
    y = rng.uniform(-1, 1, size=(rows, spec.n_output_dims)).astype(dtype)
    return x, y


def _chunks(x, y, sizes):
    at = 0
    for n in sizes:
        yield x[at:at + n], y[at:at + n]
        at += n


def _gathered_rows(model, seed, epoch, rows, batch, start_batch, step_offset):
    """The dataset rows that gather_batch.comp alone copies into a batch: the dataset's single
    input column holds distinct random values, looked up afterwards."""
    rng = np.random.default_rng()
    values = rng.permutation(np.arange(1, rows + 1, dtype=np.float32)) * np.float32(rng.uniform(0.5, 1.0))
    assert len(np.unique(values)) == rows
    rows_pad = math.ceil(batch / vulkan.ROW_ALIGN) * vulkan.ROW_ALIGN
    in_pad, out_pad = 16, 16
    dev = model.device
    bufs = [dev.buffer(rows * 4), dev.buffer(rows * 4), dev.buffer(rows_pad * in_pad * 4),
            dev.buffer(rows_pad * out_pad * 4), dev.buffer(16, host_visible=True)]
    program = None
    try:
        bufs[0].write(values)
        bufs[1].write(-values)
        base = 1000
        bufs[4].write(np.array([base + step_offset, base, epoch & 0xFFFFFFFF, start_batch], np.uint32))
        grid = model._grid(rows_pad)
        push = np.array([rows, epoch_half_bits(rows), batch, batches_per_epoch(rows, batch), seed & 0xFFFFFFFF,
                         1, 0, in_pad, 1, 0, out_pad, grid[0]], np.uint32).tobytes()
        program = vr.Program(dev, [vr.Dispatch(model._pipelines["gather"], bufs, push, grid)])
        program.run()
        bx = np.frombuffer(bufs[2].read(rows_pad * in_pad * 4), np.float32).reshape(rows_pad, in_pad)
        by = np.frombuffer(bufs[3].read(rows_pad * out_pad * 4), np.float32).reshape(rows_pad, out_pad)
    finally:
        if program is not None:
            program.destroy()
        for b in bufs:
            b.free()
    # padding columns and rows are zeros, as _stage_batch writes them
    assert not bx[:, 1:].any() and not by[:, 1:].any()
    assert not bx[batch:].any() and not by[batch:].any()
    assert np.array_equal(by[:batch, 0], -bx[:batch, 0])
    index = {float(v): i for i, v in enumerate(values)}
    return np.array([index[float(v)] for v in bx[:batch, 0]], dtype=np.int64)


@pytest.mark.parametrize(("seed", "epoch", "rows", "batch"), [
    (0, 0, 1, 1),
    (7, 0, 1000, 300),           # 4**5 = 1024 > 1000: a little cycle walking
    (123456789, 5, 1025, 512),   # just over a power of four: much cycle walking
    (2**32 - 1, 3, 4096, 1000),  # an exact power of four
    (99, 2**32 + 17, 70_001, 2048),  # the epoch as the device holds it (32 bits)
])
def test_glsl_epoch_order_equals_numpy(backend, seed, epoch, rows, batch) -> None:
    model = backend.compile(bench_spec("S"), variant="simt", cache=KernelCache())
    try:
        per_epoch = batches_per_epoch(rows, batch)
        # the position as train_epochs derives it on the device: start batch + step of the submission
        for start_batch, step_offset in [(0, 0), (per_epoch - 1, 0), (0, per_epoch), (per_epoch - 1, 2)]:
            done = start_batch + step_offset
            e, cursor = epoch + done // per_epoch, (done % per_epoch) * batch
            got = _gathered_rows(model, seed, epoch, rows, batch, start_batch, step_offset)
            assert np.array_equal(got, epoch_rows(seed, e, rows, cursor, batch)), (start_batch, step_offset)
    finally:
        model.close()


@pytest.mark.parametrize(("name", "encoding", "dtype"), [
    ("S", None, np.float32),
    ("S", None, np.float16),
    ("M", None, np.float32),
    ("M", None, np.float16),
    ("S", ENCODED, np.float32),
    ("S", ENCODED, np.float16),  # encoded on the host into a float32 dataset
])
def test_train_epochs_equals_train_step_on_the_same_batches(backend, variant, name, encoding, dtype) -> None:
    rng = np.random.default_rng()
    spec = bench_spec(name, encoding=encoding) if encoding else bench_spec(name)
    rows, batch = 1000, 300  # 3 batches an epoch, 100 rows left over: 10 steps cross 3 epoch ends
    device = backend.compile(spec, variant=variant, cache=KernelCache())
    host = backend.compile(spec, variant=variant, cache=KernelCache())
    try:
        for m in (device, host):
            m.set_params(init_params(spec))
        x, y = _data(rng, spec, rows, dtype)
        data = device.put_dataset(_chunks(x, y, [333, 0, 500, 167]), rows, dtype, dtype)
        assert data.on_device and data.rows == rows
        assert data.x.dtype == (np.float32 if encoding else dtype) and data.y.dtype == dtype
        assert data.nbytes >= device.dataset_bytes(rows, dtype, dtype)
        some = rng.integers(0, rows, 17)
        want_x = device.encode(x[some].astype(np.float32)) if encoding else x[some]
        assert np.array_equal(device.take_rows(data.x, some), want_x.astype(data.x.dtype))
        assert np.array_equal(device.take_rows(data.y, some), y[some])

        seed = int(rng.integers(0, 2**32))
        position = EpochPosition(seed)
        got = np.concatenate([device.train_epochs(data, batch, 4, position),
                              device.train_epochs(data, batch, 6, position)])
        expected = EpochPosition(seed)
        want = []
        for _ in range(10):
            r = epoch_rows(expected.seed, expected.epoch, rows, expected.cursor, batch)
            want.append(host.train_step(x[r], y[r], 1)[0])
            expected.advance(rows, batch)
        assert (position.epoch, position.cursor) == (expected.epoch, expected.cursor) == (3, 300)
        assert np.all(np.isfinite(got))
        assert np.array_equal(got, np.array(want, np.float32))
        assert device.step_count == host.step_count == 10
        p_dev, p_host = device.get_params(), host.get_params()
        for key in p_dev:
            assert np.array_equal(p_dev[key], p_host[key]), key
        s_dev, s_host = device.get_optimizer_state(), host.get_optimizer_state()
        assert all(np.array_equal(s_dev[k], s_host[k]) for k in s_dev)
    finally:
        device.close()
        host.close()


def test_train_epochs_runs_past_one_submission(backend) -> None:
    """More steps than the control block's history (HIST_CAP): the host writes the position
    again for the second submission; a run starting mid-epoch."""
    rng = np.random.default_rng()
    spec = bench_spec("S")
    rows, batch = 700, 128
    device = backend.compile(spec, variant="simt", cache=KernelCache())
    host = backend.compile(spec, variant="simt", cache=KernelCache())
    try:
        x, y = _data(rng, spec, rows, np.float32)
        data = device.put_dataset([(x, y)], rows, np.float32, np.float32)
        position = EpochPosition(11, epoch=2, cursor=3 * batch)
        steps = vulkan.HIST_CAP + 5
        got = device.train_epochs(data, batch, steps, position)
        expected, want = EpochPosition(11, epoch=2, cursor=3 * batch), []
        for _ in range(steps):
            r = epoch_rows(expected.seed, expected.epoch, rows, expected.cursor, batch)
            want.append(host.train_step(x[r], y[r], 1)[0])
            expected.advance(rows, batch)
        assert (position.epoch, position.cursor) == (expected.epoch, expected.cursor)
        assert np.array_equal(got, np.array(want, np.float32)) and got[-1] < got[0]
        p_dev, p_host = device.get_params(), host.get_params()
        assert all(np.array_equal(p_dev[k], p_host[k]) for k in p_dev)
    finally:
        device.close()
        host.close()


def test_dataset_memory_is_freed_when_dropped_or_closed(backend) -> None:
    rng = np.random.default_rng()
    spec = bench_spec("S")
    model = backend.compile(spec, variant="simt", cache=KernelCache())
    try:
        rows = 1000
        x, y = _data(rng, spec, rows, np.float16)
        before = model.device_bytes()
        data = model.put_dataset(_chunks(x, y, [600, 400]), rows, np.float16, np.float16)
        nbytes = data.nbytes
        assert model.device_bytes() - before == nbytes >= model.dataset_bytes(rows, np.float16, np.float16) > 0
        model.train_epochs(data, 256, 5, EpochPosition(3))
        loaded = model.device_bytes()  # + the batch buffers the training program uses
        del data
        gc.collect()
        assert model.device_bytes() == loaded - nbytes
        # the program recorded with the dataset's buffers went with them; a new dataset trains
        data = model.put_dataset([(x, y)], rows, np.float16, np.float16)
        assert np.all(np.isfinite(model.train_epochs(data, 256, 2, EpochPosition(3))))
        assert model.device_bytes() == loaded
        # the model closes with the dataset alive: everything freed, dropping it later is harmless
        model.close()
        assert model.device_bytes() == 0
        del data
        gc.collect()
    finally:
        model.close()


def test_put_dataset_checks_its_chunks(backend) -> None:
    rng = np.random.default_rng()
    spec = bench_spec("S")
    model = backend.compile(spec, variant="simt", cache=KernelCache())
    try:
        x, y = _data(rng, spec, 500, np.float32)
        before = model.device_bytes()
        with pytest.raises(InvalidInput, match="hold 400 rows, not the 500 announced"):
            model.put_dataset(_chunks(x, y, [300, 100]), 500, np.float32, np.float32)
        with pytest.raises(InvalidInput, match="more than the 400 rows announced"):
            model.put_dataset(_chunks(x, y, [300, 200]), 400, np.float32, np.float32)
        with pytest.raises(InvalidInput, match="target has 99 rows"):
            model.put_dataset([(x[:100], y[:99])], 100, np.float32, np.float32)
        with pytest.raises(InvalidInput, match="input must have shape"):
            model.put_dataset([(x[:, :3], y)], 500, np.float32, np.float32)
        with pytest.raises(InvalidInput, match="float16 or float32"):
            model.put_dataset([(x, y)], 500, np.int32, np.float32)
        with pytest.raises(InvalidInput, match="1 to"):
            model.put_dataset([], 0, np.float32, np.float32)
        gc.collect()
        assert model.device_bytes() == before  # nothing left behind by the failures
    finally:
        model.close()


def test_train_epochs_refuses_datasets_held_elsewhere(backend) -> None:
    rng = np.random.default_rng()
    spec = bench_spec("S")
    model = backend.compile(spec, variant="simt", cache=KernelCache())
    other = backend.compile(spec, variant="simt", cache=KernelCache())
    try:
        x, y = _data(rng, spec, 400, np.float32)
        host = Dataset(x, y, 400, x.nbytes + y.nbytes, on_device=False)
        with pytest.raises(InvalidInput, match="not held on this model's vulkan device"):
            model.train_epochs(host, 100, 1, EpochPosition(0))
        theirs = other.put_dataset([(x, y)], 400, np.float32, np.float32)
        with pytest.raises(InvalidInput, match="not held on this model's vulkan device"):
            model.train_epochs(theirs, 100, 1, EpochPosition(0))
        with pytest.raises(InvalidInput, match="batch_size 401"):
            other.train_epochs(theirs, 401, 1, EpochPosition(0))
        with pytest.raises(InvalidInput, match="not the start of a batch"):
            other.train_epochs(theirs, 100, 1, EpochPosition(0, cursor=50))
        assert model.step_count == other.step_count == 0
        free = model.free_device_bytes()
        assert free is None or (isinstance(free, int) and free >= 0)
    finally:
        model.close()
        other.close()
