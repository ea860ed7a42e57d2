"""The cuda backend's host<->device transport on a CUDA GPU (skipped without one): the pipelined
page-locked ``forward_to_host``, page-locked (registered) host buffers, and CUDA IPC regions
opened by the daemon's real opener, each against the float64 cpu oracle on fresh random data."""

from __future__ import annotations

import base64
import mmap
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from oracle import rel_err
import pytest

from test_cuda import FWD_TOL, _cuda_backend, inputs, make_pair
from mmad.backends.cache import KernelCache
from mmad.errors import InvalidInput, NonFiniteInput
from mmad.spec import bench_spec

pytestmark = pytest.mark.gpu

# below the pipeline's threshold, one chunk plus a tail, several chunks, many chunks
ROWS = [1000, 9_000, 65_537, 1 << 20]


@pytest.fixture(scope="module")
def backend():
    return _cuda_backend()


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(8) as executor:
        yield executor


@pytest.fixture(scope="module")
def pair(backend):
    rng = np.random.default_rng()
    model, oracle = make_pair(backend, KernelCache(), bench_spec("M"), rng, variant="mma")
    yield model, oracle
    model.close()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("in_dtype", "out_dtype"), [(np.float16, np.float16), (np.float32, np.float32),
                                                     (np.float16, np.float32), (np.float32, np.float16)])
@pytest.mark.parametrize("with_pool", [True, False])
def test_forward_to_host_matches_oracle(pair, pool, rows, in_dtype, out_dtype, with_pool):
    model, oracle = pair
    x = inputs(np.random.default_rng(), rows, model.spec).astype(in_dtype)
    out = np.full((rows, model.spec.n_output_dims), np.nan, out_dtype)
    model.forward_to_host(x, out, pool if with_pool else None)
    err = rel_err(out.astype(np.float64), oracle.forward(x.astype(np.float32)))
    assert err <= FWD_TOL, f"{rows} rows {np.dtype(in_dtype)} -> {np.dtype(out_dtype)}: {err:.2e}"
    # twice in a row: the staging buffers are reused, and hold the previous request's rows
    y = inputs(np.random.default_rng(), rows, model.spec).astype(in_dtype)
    model.forward_to_host(y, out, pool if with_pool else None)
    assert rel_err(out.astype(np.float64), oracle.forward(y.astype(np.float32))) <= FWD_TOL


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_dtype", [np.float16, np.float32])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_finite_finds_nan_and_inf_in_any_chunk(pair, pool, rows, in_dtype, bad):
    """check_finite: the pipelined path counts NaN/Inf on the device per chunk, the small one on
    the host; a value in the last row (the tail chunk) is found as one in the first, and clean
    rows pass with the oracle's outputs."""
    model, oracle = pair
    x = inputs(np.random.default_rng(), rows, model.spec).astype(in_dtype)
    out = np.empty((rows, model.spec.n_output_dims), np.float16)
    model.forward_to_host(x, out, pool, check_finite=True)
    assert rel_err(out.astype(np.float64), oracle.forward(x.astype(np.float32))) <= FWD_TOL
    for row in (0, rows // 2, rows - 1):
        y = x.copy()
        y[row, model.spec.n_input_dims - 1] = bad
        with pytest.raises(NonFiniteInput):
            model.forward_to_host(y, out, pool, check_finite=True)
        model.forward_to_host(y, out, pool)  # unchecked: NaN rows are computed, as asked
    # the largest finite fp16 is finite: the test is on the exponent, not the magnitude
    x[rows - 1, 0] = np.finfo(in_dtype).max
    model.forward_to_host(x, out, pool, check_finite=True)


@pytest.mark.parametrize("variant", ["cublaslt", "wgmma"])
def test_other_variants_pipeline_too(backend, pool, variant):
    rows_by_variant = {r.variant: r for r in backend.probe()}
    if not rows_by_variant[variant].available:
        pytest.skip(f"the cuda {variant} variant is unavailable here: {rows_by_variant[variant].reason}")
    model, oracle = make_pair(backend, KernelCache(), bench_spec("M"), np.random.default_rng(), variant=variant)
    with model:
        for rows in (65_537, 200_000):  # chunk shapes differ between the two: plans are rebuilt once
            x = inputs(np.random.default_rng(), rows, model.spec).astype(np.float16)
            out = np.full((rows, model.spec.n_output_dims), np.nan, np.float16)
            model.forward_to_host(x, out, pool)
            err = rel_err(out.astype(np.float64), oracle.forward(x.astype(np.float32)))
            assert err <= FWD_TOL, f"{variant}, {rows} rows: {err:.2e}"


def test_page_locked_buffers_are_copied_directly(pair, pool):
    import cupy as cp

    from mmad.backends.cuda.toolchain import is_page_locked

    model, oracle = pair
    rows, n_in, n_out = 65_537, model.spec.n_input_dims, model.spec.n_output_dims
    x_mem = cp.cuda.alloc_pinned_memory(rows * n_in * 2)
    out_mem = cp.cuda.alloc_pinned_memory(rows * n_out * 2)
    x = np.frombuffer(x_mem, np.float16, rows * n_in).reshape(rows, n_in)
    out = np.frombuffer(out_mem, np.float16, rows * n_out).reshape(rows, n_out)
    x[...] = inputs(np.random.default_rng(), rows, model.spec)
    out[...] = np.nan
    assert is_page_locked(cp, x) and is_page_locked(cp, out)
    assert not is_page_locked(cp, np.ones((rows, n_in), np.float16))
    model.forward_to_host(x, out, pool)
    assert rel_err(out.astype(np.float64), oracle.forward(x.astype(np.float32))) <= FWD_TOL


def test_the_backend_pins_shared_memory_regions(backend):
    """The daemon page-locks system regions through this hook (mmad/engine/shm.py)."""
    import cupy as cp

    from mmad.backends.cuda.toolchain import is_page_locked

    mapping = mmap.mmap(-1, 1 << 20)
    unpin = backend.pin_host_memory(mapping)
    assert unpin is not None, "CudaBackend.pin_host_memory is missing (it returns host_register(cp, buffer))"
    assert is_page_locked(cp, np.frombuffer(mapping, np.uint8))
    unpin()
    mapping.close()


def test_registered_mapping_is_page_locked_until_unregistered(pair, pool):
    import cupy as cp

    from mmad.backends.cuda.toolchain import host_register, is_page_locked

    model, oracle = pair
    rows, n_in, n_out = 30_000, model.spec.n_input_dims, model.spec.n_output_dims
    mapping = mmap.mmap(-1, rows * (n_in + n_out) * 2)
    unpin = host_register(cp, mapping)
    x = np.frombuffer(mapping, np.float16, rows * n_in).reshape(rows, n_in)
    out = np.frombuffer(mapping, np.float16, rows * n_out, rows * n_in * 2).reshape(rows, n_out)
    x[...] = inputs(np.random.default_rng(), rows, model.spec)
    assert is_page_locked(cp, x) and is_page_locked(cp, out)
    model.forward_to_host(x, out, pool)
    assert rel_err(out.astype(np.float64), oracle.forward(x.astype(np.float32))) <= FWD_TOL
    del x, out
    unpin()
    assert not is_page_locked(cp, np.frombuffer(mapping, np.uint8))
    mapping.close()


_IPC_CHILD = """
import base64, sys
import cupy as cp, numpy as np
rows, cols, extra = (int(a) for a in sys.argv[1:4])
x = cp.asarray(np.random.default_rng().standard_normal((rows, cols)).astype(np.float16))
buf = cp.zeros(x.nbytes + extra, dtype=cp.uint8)
buf[:x.nbytes] = x.view(cp.uint8).ravel()
cp.cuda.Device().synchronize()
print(base64.b64encode(cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr)).decode(), flush=True)
sys.stdout.buffer.write(cp.asnumpy(x).tobytes()); sys.stdout.flush()
sys.stdin.readline()  # the allocation stays until the parent is done
"""


def test_cuda_ipc_region_opened_by_the_daemons_opener(pair):
    """Another process's allocation, opened through its IPC handle: the input read and the output
    written on the device; byte sizes past the allocation and other GPUs refused."""
    import cupy as cp

    from mmad.backends.cuda.ipc import open_ipc_region

    model, oracle = pair
    rows, n_in, n_out = 4096, model.spec.n_input_dims, model.spec.n_output_dims
    out_bytes = rows * n_out * 2
    child = subprocess.Popen([sys.executable, "-c", _IPC_CHILD, str(rows), str(n_in), str(out_bytes)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        handle = base64.b64decode(child.stdout.readline())
        # the raw rows: BufferedReader.read(n) reads a pipe until n bytes (np.load's fromfile
        # takes one short read of a pipe as the whole array)
        x = np.frombuffer(child.stdout.read(rows * n_in * 2), dtype=np.float16).reshape(rows, n_in)
        size = rows * n_in * 2 + out_bytes
        with pytest.raises(InvalidInput, match="larger than the device allocation"):
            open_ipc_region("big", handle, 0, size + 4096 * 1024)
        with pytest.raises(InvalidInput, match="is not a GPU of this daemon"):
            open_ipc_region("far", handle, cp.cuda.runtime.getDeviceCount(), size)
        region = open_ipc_region("r", handle, 0, size)
        dx = region.array("input", 0, np.dtype(np.float16), (rows, n_in))
        assert isinstance(dx, cp.ndarray)
        np.testing.assert_array_equal(cp.asnumpy(dx), x)
        target = region.array("output", rows * n_in * 2, np.dtype(np.float16), (rows, n_out))
        target[...] = model.forward(dx, out_dtype=np.float16)
        cp.cuda.Device().synchronize()
        assert rel_err(cp.asnumpy(target).astype(np.float64), oracle.forward(x.astype(np.float32))) <= FWD_TOL
        del dx, target, region
    finally:
        child.stdin.write(b"\n")
        child.stdin.close()
        child.wait(30)


@pytest.mark.parametrize(("in_dtype", "out_dtype"), [(np.float16, np.float16), (np.float32, np.float32),
                                                     (np.float16, np.float32), (np.float32, np.float16)])
def test_forward_into_writes_a_device_array(pair, in_dtype, out_dtype):
    """``forward_into`` (the forward between two CUDA regions): the kernel writes a contiguous
    array of its output dtype itself, any other target gets the result copied in; both equal
    ``forward`` and the oracle."""
    import cupy as cp

    model, oracle = pair
    rows = 65_537
    x = np.random.default_rng().uniform(-1, 1, (rows, model.spec.n_input_dims)).astype(in_dtype)
    dx = cp.asarray(x)
    ref = oracle.forward(x.astype(np.float32))
    out = cp.full((rows, model.spec.n_output_dims), np.nan, dtype=out_dtype)
    model.forward_into(dx, out)
    wide = cp.full((rows, 2 * model.spec.n_output_dims), np.nan, dtype=out_dtype)
    model.forward_into(dx, wide[:, ::2])  # not contiguous: copied in
    assert rel_err(cp.asnumpy(out).astype(np.float64), ref) <= FWD_TOL
    assert rel_err(cp.asnumpy(wide[:, ::2]).astype(np.float64), ref) <= FWD_TOL
    assert bool(cp.isnan(wide[:, 1::2]).all())  # nothing written beside it
    np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(model.forward(dx, out_dtype=out_dtype)))


@pytest.mark.parametrize("variant", ["mma", "mma-f16acc"])
@pytest.mark.parametrize("name", ["S", "M", "L", "W"])
def test_forward_group_runs_the_requests_in_one_launch_and_flags_nonfinite_inputs(backend, name, variant):
    """``forward_group`` (the daemon's group of forwards between CUDA regions): on mma (and
    mma-f16acc, whose fp16 group kernel accumulates in fp16), every pair
    of fp16 in and out runs in one launch and every pair of fp32 in and out in another, each
    output bit-identical to the pair's own ``forward`` and within the oracle's tolerance, and
    the NaN/Inf word of exactly the pairs whose input holds them is set (an fp32 value beyond
    fp16's range is finite); other pairings and misaligned arrays run one at a time. W (256 wide)
    has no group kernel: every pair one at a time, the same results."""
    import cupy as cp

    rng = np.random.default_rng()
    model, oracle = make_pair(backend, KernelCache(), bench_spec(name), rng, variant=variant)
    n_in, n_out = model.spec.n_input_dims, model.spec.n_output_dims
    cases = [(1, np.float16, np.float16, None), (7, np.float32, np.float32, None),
             (1000, np.float16, np.float16, "nan"), (65_537, np.float16, np.float16, None),
             (300, np.float32, np.float32, "inf"), (129, np.float32, np.float32, "big"),
             (0, np.float16, np.float16, None), (500, np.float16, np.float16, "-inf"),
             (77, np.float16, np.float32, "nan"), (64, np.float16, np.float16, "misaligned")]
    pairs, hosts, expected = [], [], []
    for rows, in_dtype, out_dtype, special in cases:
        x = inputs(rng, rows, model.spec).astype(in_dtype)
        if special in ("nan", "inf", "-inf", "big") and rows:
            x[rng.integers(rows), rng.integers(n_in)] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf,
                                                         "big": 1e6}[special]
        if special == "misaligned":  # 8 bytes past a 16-byte boundary: the kernel's vector loads cannot read it
            flat = cp.zeros(rows * n_in + 4, dtype=in_dtype)
            dx = flat[4:].reshape(rows, n_in)
            dx[...] = cp.asarray(x)
        else:
            dx = cp.asarray(x)
        pairs.append((dx, cp.full((rows, n_out), np.nan, dtype=out_dtype)))
        hosts.append(x)
        expected.append(special in ("nan", "inf", "-inf"))
    words = cp.zeros(len(pairs), dtype=cp.uint32)
    launched = []
    launch = model._launch

    def counting_launch(kernel, *args, **kwargs):
        launched.append(kernel)
        launch(kernel, *args, **kwargs)

    model._launch = counting_launch
    try:
        model.forward_group(pairs, words)
    finally:
        del model._launch
    cp.cuda.Device().synchronize()
    assert [bool(w) for w in cp.asnumpy(words)] == expected
    if name == "W":
        assert "mlp_forward_group" not in launched and "mlp_forward_half_group" not in launched
    else:
        assert launched.count("mlp_forward_half_group") == 1 and launched.count("mlp_forward_group") == 1
        # the two fallbacks: fp16 in, fp32 out (plus its finiteness check), and the misaligned input
        assert launched.count("mlp_forward") + launched.count("mlp_forward_half") == 2
    for (dx, out), x, flagged in zip(pairs, hosts, expected):
        if flagged or not len(x):
            continue
        got = cp.asnumpy(out)
        np.testing.assert_array_equal(got, cp.asnumpy(model.forward(dx, out_dtype=out.dtype)))
        if np.isfinite(x.astype(np.float16)).all():
            assert rel_err(got.astype(np.float64), oracle.forward(x.astype(np.float32))) <= FWD_TOL
    # without the words: nothing checked, the same outputs
    again = [(dx, cp.full_like(out, np.nan)) for dx, out in pairs]
    model.forward_group(again, None)
    for (_, first), (_, second), flagged in zip(pairs, again, expected):
        if not flagged:
            np.testing.assert_array_equal(cp.asnumpy(first), cp.asnumpy(second))
    model.close()


def test_region_group_slot_waits_for_the_default_stream_and_keeps_its_staging(pair):
    """The primary's region forwards (mmad/engine/region_forwards.py) launch each group on its
    slot's stream. That stream is a blocking one: what it runs waits for work queued before on
    the device's default stream, where training writes the weights (a kernel that spins ~10 ms
    there, then fills an array, is seen filled by a copy queued after it on the slot's stream).
    A slot keeps the staging arrays of a group for the next group of the same shapes, and each
    group's outputs are its own inputs' forward."""
    import cupy as cp

    from mmad.backends.cuda.region_group import CudaGroupSlot
    from mmad.engine.region_forwards import GROUP_MAX

    model, oracle = pair
    slot = CudaGroupSlot(cp, 0, GROUP_MAX)
    spin = cp.RawKernel(r'''
    extern "C" __global__ void spin_then_fill(float* a, int n, long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
        for (int i = threadIdx.x; i < n; i += blockDim.x) a[i] = 1.0f;
    }''', "spin_then_fill")
    with cp.cuda.Device(0):
        filled, seen = cp.zeros(4096, cp.float32), cp.full(4096, -1.0, cp.float32)
        cp.cuda.Stream.null.synchronize()
        spin((1,), (256,), (filled, np.int32(filled.size), np.int64(20_000_000)))  # the default stream
        with slot.stream:
            seen[...] = filled
        slot.stream.synchronize()
        assert float(seen.min()) == 1.0 and float(seen.max()) == 1.0

    rng = np.random.default_rng()
    n_out = model.spec.n_output_dims
    staged_before = None
    for rows in (3000, 3000, 1000):  # the same shapes twice (kept), then others (new arrays)
        xs = [inputs(rng, rows, model.spec).astype(np.float16) for _ in range(2)]
        outs = [np.full((rows, n_out), np.nan, np.float16) for _ in xs]
        with cp.cuda.Device(0), slot.stream:
            slot.start()
            staged = [(slot.upload(k, x), slot.output(k, out.shape, out.dtype))
                      for k, (x, out) in enumerate(zip(xs, outs))]
            model.forward_group(staged, slot.words[:len(staged)])
            for (_, device_out), out in zip(staged, outs):
                slot.download(device_out, out)
            slot.finish(len(staged))
        flags = slot.wait()[:len(staged)]
        assert not flags.any()
        for x, out in zip(xs, outs):
            err = rel_err(out.astype(np.float64), oracle.forward(x.astype(np.float32)))
            assert err <= FWD_TOL, f"{rows} rows: {err:.2e}"
        if staged_before is not None:
            same = all(now is then for pairs in zip(staged, staged_before) for now, then in zip(*pairs))
            assert same == (rows == 3000), f"{rows} rows: staging kept {same}"
        staged_before = staged
