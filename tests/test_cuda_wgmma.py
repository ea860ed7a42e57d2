"""The cuda backend's wgmma (sm_90a) forward: CPU checks of everything it relies on, and GPU
checks against the float64 oracle (skipped, with the reason, where no usable H100 is present).

CPU (run everywhere):
- the host's weight/bias images (``host_images`` below, the same gather the device's
  ``wgmma_pack`` does) hold, element by element, what ``layouts.wgmma_smem_operand`` says;
- the kernel's own shared-memory offset and descriptor functions (shaders/cuda/wgmma_layout.cuh,
  compiled here with the host C++ compiler) equal ``layouts`` for every geometry the kernels use;
- the accumulator indexing and the accumulator -> A-register conversion the kernel codes
  against equal ``layouts.wgmma_accumulator`` / ``register_permutation``;
- the generated source assembles with nvcc for sm_90a with no local memory (spills, stack).

GPU (an sm_90 device whose probe offers wgmma): forward of S/M/L/W with every activation at 1,
7, 1000, 65,537 and 2^20 rows, fp32 and fp16 I/O, against the float64 oracle (a random 4096-row
subset of 2^20), odd shapes, every fp16 ring plan bit for bit, forward after training steps,
cache hits.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
from oracle import case_rng, rel_err
import pytest

from mmad.backends import cuda
from mmad.backends.cuda import knobs, mma, toolchain, wgmma
from mmad.backends import layouts as L
from mmad.backends import numerics as nm
from mmad.backends.cache import KernelCache
from mmad.backends.contract import EpochPosition, init_params
from mmad.backends.cpu import CpuBackend
from mmad.backends.cuda.mma import MmaPlan, master_offsets
from mmad.backends.cuda.wgmma import WgmmaPlan
from mmad.errors import SpecError
from mmad.shaders import read_source
from mmad.spec import ACTIVATIONS, bench_spec

import layout_reference as ref  # tests/layout_reference.py: the PTX ISA's definitions

FWD_TOL = 3e-3
BATCHES = [1, 7, 1000, 65_537, 1 << 20]

# shapes beyond the benchmark models: padding of input, width and output to powers of two,
# a width-256 model small enough to keep its weights resident, one hidden layer
ODD_SPECS = {
    "w48-in5-out3": dict(n_neurons=48, n_input_dims=5, n_output_dims=3, n_hidden_layers=2),
    "w80-in17-out2": dict(n_neurons=80, n_input_dims=17, n_output_dims=2, n_hidden_layers=3),
    "w16-in3-out1": dict(n_neurons=16, n_input_dims=3, n_output_dims=1, n_hidden_layers=1),
    "w112-in100-out33": dict(n_neurons=112, n_input_dims=100, n_output_dims=33, n_hidden_layers=2),
    "w256-in3-out1-h1": dict(n_neurons=256, n_input_dims=3, n_output_dims=1, n_hidden_layers=1),
}



def host_images(plan: WgmmaPlan, params: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(fp16 weight image as uint16, fp32 bias image) exactly as ``wgmma_pack`` builds them on
    the device from the mma model's padded fp32 masters, through the plan's maps."""
    mma_layers = MmaPlan(plan.spec).layers
    w_off, b_off = master_offsets(mma_layers)
    w_all = np.zeros(sum(n * k for _, _, k, n in mma_layers), dtype=np.float32)
    b_all = np.zeros(sum(n for _, _, _, n in mma_layers), dtype=np.float32)
    for i, (fan_in, fan_out, k, n) in enumerate(mma_layers):
        w_all[w_off[i]: w_off[i] + n * k].reshape(n, k)[:fan_out, :fan_in] = params[f"W{i}"]
        b_all[b_off[i]: b_off[i] + fan_out] = params[f"b{i}"]
    wmap = plan.weight_map(w_off, [k for _, _, k, _ in mma_layers])
    bmap = plan.bias_map(b_off)
    image = np.where(wmap >= 0, w_all[np.maximum(wmap, 0)], 0).astype(np.float16).view(np.uint16)
    return image, np.where(bmap >= 0, b_all[np.maximum(bmap, 0)], 0).astype(np.float32)

def plan_cases() -> dict[str, WgmmaPlan]:
    plans = {name: WgmmaPlan(bench_spec(name)) for name in "SMLW"}
    plans.update({name: WgmmaPlan(bench_spec("M").replace(**kw)) for name, kw in ODD_SPECS.items()})
    return plans


def random_params(spec, rng):
    params = init_params(spec)
    for name in params:
        params[name] = rng.uniform(-1, 1, size=params[name].shape).astype(np.float32)
    return params


# -- CPU: host packing -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["S", "M", "L", "W", *ODD_SPECS])
def test_host_images_hold_what_wgmma_smem_operand_says(name):
    plan = plan_cases()[name]
    params = random_params(plan.spec, np.random.default_rng(len(name)))
    image, bias = host_images(plan, params)
    assert image.dtype == np.uint16 and image.size == plan.w_total_bytes // 2
    covered = np.zeros(image.size, dtype=bool)
    for i, (fan_in, fan_out, k, n, swz, offset) in enumerate(plan.layers):
        assert offset % 1024 == 0 and n & (n - 1) == 0 and k & (k - 1) == 0
        assert swz == min(128, 2 * k)
        padded = np.zeros((n, k), dtype=np.float16)
        padded[:fan_out, :fan_in] = params[f"W{i}"]
        layout = L.wgmma_smem_operand(n, k, "K", swz)
        coords = layout.coordinates()  # offset (halves) -> (row = n, col = k), every offset
        layer = image[offset // 2: offset // 2 + n * k]
        expected = padded[coords["row"], coords["col"]].view(np.uint16)
        mismatch = np.flatnonzero(layer != expected)
        assert mismatch.size == 0, (
            f"layer {i}: image half {mismatch[0]} holds 0x{layer[mismatch[0]]:04x}, layouts says "
            f"W[{coords['row'][mismatch[0]]}, {coords['col'][mismatch[0]]}] = 0x{expected[mismatch[0]]:04x}")
        assert np.array_equal(L.unpack(layer, layout).view(np.float16), padded)
        covered[offset // 2: offset // 2 + n * k] = True
        b_ref = np.zeros(n, dtype=np.float32)
        b_ref[:fan_out] = params[f"b{i}"]
        assert np.array_equal(bias[plan.b_offsets[i]: plan.b_offsets[i] + n], b_ref)
    assert not image[~covered].any(), "alignment gaps between layer images must be zero"
    assert np.isfinite(image.view(np.float16)).all()


def test_shared_memory_plan_of_the_benchmark_models():
    plans = plan_cases()
    # S, M: resident weights shared by two warpgroups, each prefetching its next input tile
    for name in "SM":
        assert (plans[name].w_resident, plans[name].warpgroups, plans[name].input_staged) == (True, 2, True)
        assert WgmmaPlan(bench_spec(name), stages=1).x_stages == 1
        assert WgmmaPlan(bench_spec(name), stages=2).x_stages == 2
    # two input tiles in flight per warpgroup where two blocks still fit on an SM: S, not M
    assert (plans["S"].x_stages, plans["M"].x_stages) == (2, 1)
    assert 2 * (plans["S"].smem_bytes + 1024) <= wgmma.WGMMA_SMEM_PER_SM
    # L: 160 KiB of weights leave room for two input tiles but not for two prefetch buffers
    assert (plans["L"].w_resident, plans["L"].warpgroups, plans["L"].input_staged) == (True, 2, False)
    one = WgmmaPlan(bench_spec("L"), warpgroups=1)
    assert (one.w_resident, one.warpgroups, one.input_staged) == (True, 1, True)
    # W: five 128 KiB layer images; one layer at a time, input read from global when converted
    assert (plans["W"].w_resident, plans["W"].warpgroups, plans["W"].input_staged) == (False, 1, False)
    with pytest.raises(SpecError):
        WgmmaPlan(bench_spec("W"), warpgroups=2)  # a streamed stage is refilled by one warpgroup
    for plan in [*plans.values(), one]:
        assert plan.smem_bytes <= wgmma.WGMMA_SMEM_LIMIT
        for off in (plan.sm_a_off, plan.a_bytes, plan.sm_b_off, plan.sm_x_off, plan.x_bytes):
            assert off % 1024 == 0
        assert plan.sm_b_off == plan.sm_a_off + plan.warpgroups * plan.a_bytes
        staging = plan.warpgroups * plan.x_stages * plan.x_bytes if plan.input_staged else 0
        assert plan.smem_bytes >= plan.sm_x_off + staging + 1024
    with pytest.raises(SpecError):
        WgmmaPlan(bench_spec("S", precision="fp32"))
    with pytest.raises(SpecError):
        WgmmaPlan(bench_spec("S"), warpgroups=3)


def test_half_io_plan_of_the_benchmark_models():
    """The fp16 kernel's (warpgroups a block, ring tiles): 2 x 2 for S and M (three blocks an SM),
    3 x 1 for L (one block: 160 KiB of weights), none for W (its weights stream); the sections
    fit, start on 1024-byte boundaries and do not overlap."""
    plans = plan_cases()
    got = {name: (plans[name].half_io, plans[name].half_warpgroups, plans[name].half_stages) for name in "SMLW"}
    assert got == {"S": (True, 2, 2), "M": (True, 2, 2), "L": (True, 3, 1), "W": (False, 0, 0)}
    assert [plans[name].half_min_blocks for name in "SML"] == [3, 3, 1]
    for name in "SML":
        plan = plans[name]
        assert plan.smem_half_bytes <= wgmma.WGMMA_SMEM_LIMIT
        assert plan.smh_b_off == plan.w_total_bytes and plan.smh_ring_off % 1024 == 0
        ring = plan.half_warpgroups * plan.half_stages * plan.a_bytes
        assert plan.smem_half_bytes == plan.smh_ring_off + ring + wgmma.WGMMA_ALIGN
    forced = WgmmaPlan(bench_spec("M"), half_warpgroups=4, half_stages=3)
    assert (forced.half_warpgroups, forced.half_stages) == (4, 3)
    with pytest.raises(SpecError, match="fp16 forward does not fit"):
        WgmmaPlan(bench_spec("L"), half_warpgroups=4, half_stages=4)


def test_training_plan_of_the_benchmark_models():
    """The training module: two warpgroups a block (two blocks an SM for S and M, one for L,
    whose 160 KiB of weights stay resident), the output layer padded to 16 rows (the backward's
    k16 steps), the weight-gradient kernels' N padded to 64; W refused with the reason (its
    weights stream: the wgmma+mma and wgmma+cublaslt variants train it)."""
    plans = {name: WgmmaPlan(bench_spec(name), training=True) for name in "SMLW"}
    got = {n: (p.trains, p.train_warpgroups, p.train_min_blocks) for n, p in plans.items()}
    assert got == {"S": (True, 2, 2), "M": (True, 2, 2), "L": (True, 2, 1), "W": (False, 0, 0)}
    assert "shared memory" in plans["W"].why_not and "wgmma+mma" in plans["W"].why_not
    assert [plans[n].wgrad_kp for n in "SML"] == [[64, 64], [64, 64], [128, 128]]
    for name in "SML":
        plan = plans[name]
        assert plan.smem_train_bytes <= wgmma.WGMMA_SMEM_LIMIT
        assert plan.smt_b_off == plan.w_total_bytes and plan.smt_a_off % 1024 == 0
        assert plan.smem_train_bytes == plan.smt_a_off + plan.train_warpgroups * plan.a_bytes + wgmma.WGMMA_ALIGN
        assert plan.wgrad_smem_bytes(1) == 3 * (64 * 128 + plan.wgrad_kp[1] * 128) + 1024
    odd = WgmmaPlan(bench_spec("M").replace(**ODD_SPECS["w16-in3-out1"]), training=True)
    assert (odd.nout_p, odd.layers[-1][3]) == (16, 16)  # one output, 16 rows of W_out
    assert WgmmaPlan(bench_spec("M").replace(**ODD_SPECS["w16-in3-out1"])).nout_p == 8  # the forward's
    defines = dict(re.findall(r"^#define (\w+) (\S+)$", odd.source, flags=re.M))
    # the mma variant's buffer geometry (mlp_mma.cu's h_off, d_off), which mlp_optimize reads
    assert (defines["KIN"], defines["WIDTH"], defines["NOUT_PAD"], defines["TRAIN_MODULE"]) == ("16", "16", "16", "1")


@pytest.mark.parametrize("name", ["S", "M", "L", "W", *ODD_SPECS])
def test_kernel_constants_agree_with_the_plan(name):
    """The offsets mlp_wgmma.cu computes from its #defines are where the host put each layer."""
    plan = plan_cases()[name]
    defines = dict(re.findall(r"^#define (\w+) (\S+)$", plan.source, flags=re.M))
    value = {k: int(v) for k, v in defines.items() if re.fullmatch(r"-?\d+", v)}
    (_, _, k0, n0, swz0, off0), *hidden, (_, _, k_o, n_o, swz_o, off_o) = plan.layers
    assert off0 == 0 and value["W_BYTES0"] == k0 * n0 * 2
    assert (value["KIN_P"], value["WP"], value["SWZ_IN"]) == (k0, n0, swz0)
    for l, (_, _, k, n, swz, off) in enumerate(hidden, start=1):  # hidden layer l of the kernel's loop
        assert value["W_OFF1"] + (l - 1) * value["W_HID_STRIDE"] == off
        assert (k, n, swz) == (value["WP"], value["WP"], value["SWZ_W"])
    assert (value["W_OFF_OUT"], k_o, n_o, swz_o) == (off_o, value["WP"], value["NOUT_P"], value["SWZ_W"])
    assert value["W_TOTAL_BYTES"] == plan.w_total_bytes
    assert [l * value["WP"] for l in range(value["NHID"] + 1)] == plan.b_offsets
    assert value["B_TOTAL"] == plan.b_total == plan.b_offsets[-1] + value["NOUT_P"]
    if not plan.w_resident:  # the stage holds the largest layer
        assert plan.sm_a_off >= max(k * n * 2 for _, _, k, n, _, _ in plan.layers)


# -- CPU: the kernel's layout functions, compiled on the host ----------------------------------
_HOST_PROGRAM = r"""
#include <cstdio>
int main() {
    unsigned rows, k, swz, base;
    while (std::scanf("%u %u %u %u", &rows, &k, &swz, &base) == 4) {
        for (unsigned ks = 0; ks < k / 16; ++ks) std::printf("%llu\n", kmajor_desc(base, ks, rows, swz));
        for (unsigned r = 0; r < rows; ++r)
            for (unsigned c = 0; c < k; ++c) std::printf("%u\n", kmajor_offset(r, c, rows, swz));
    }
    return 0;
}
"""


def _host_layout_program(tmp_path_factory, name: str, program: str):
    """wgmma_layout.cuh and ``program`` built with the host C++ compiler: the executable."""
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler: the kernel's layout functions are only checked where one is installed")
    tmp = tmp_path_factory.mktemp(name)
    src = tmp / "layout.cpp"
    src.write_text(read_source("cuda/wgmma_layout.cuh") + program)
    exe = tmp / "layout"
    done = subprocess.run([cxx, "-O1", "-std=c++17", str(src), "-o", str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return exe


@pytest.fixture(scope="module")
def layout_program(tmp_path_factory):
    return _host_layout_program(tmp_path_factory, "wgmma_layout", _HOST_PROGRAM)


def kernel_layout_values(program, geometries):
    """{(rows, K, swizzle, base): (descriptors per k16 step, byte offset of every (row, col))}
    as the kernel's kmajor_desc / kmajor_offset compute them."""
    text = "".join(f"{r} {k} {s} {b}\n" for r, k, s, b in geometries)
    done = subprocess.run([str(program)], input=text, capture_output=True, text=True, check=True)
    values = iter(int(v) for v in done.stdout.split())
    result = {}
    for rows, k, swz, base in geometries:
        descs = [next(values) for _ in range(k // 16)]
        offsets = np.array([next(values) for _ in range(rows * k)], dtype=np.int64).reshape(rows, k)
        result[(rows, k, swz, base)] = (descs, offsets)
    assert next(values, None) is None
    return result


def test_kernel_descriptors_and_offsets_equal_layouts(layout_program):
    # every (rows, K, swizzle) the plans use (weights and the 64-row input tile), at their offsets
    geometries = set()
    for plan in plan_cases().values():
        geometries.add((64, plan.kin_p, plan.swz_in, 0x400))
        for _, _, k, n, swz, offset in plan.layers:
            geometries.add((n, k, swz, offset + 0x400))
    geometries = sorted(geometries)
    values = kernel_layout_values(layout_program, geometries)
    for rows, k, swz, base in geometries:
        descs, offsets = values[(rows, k, swz, base)]
        for ks in range(k // 16):
            desc = L.wgmma_smem_descriptor(rows, k, "K", swz, col0=16 * ks)
            got = descs[ks]
            assert got == desc.encode(base), (rows, k, swz, base, ks, hex(got), hex(desc.encode(base)))
            # the fields the kernel sets, read back: LBO (unused when swizzled: 16 B), SBO, mode
            assert (got >> 16) & 0x3FFF == desc.lbo >> 4 == 1
            assert (got >> 32) & 0x3FFF == desc.sbo >> 4 == 8 * swz >> 4
            assert got >> 62 == desc.layout_type == {128: 1, 64: 2, 32: 3}[swz]
        inverse = L.wgmma_smem_operand(rows, k, "K", swz).inverse()  # (row, col) -> offset
        want = np.array([2 * inverse.apply(row=r, col=c)["offset"] for r in range(rows) for c in range(k)])
        assert np.array_equal(offsets.reshape(-1), want), (rows, k, swz)


_HOST_MN_PROGRAM = r"""
#include <cstdio>
int main() {
    unsigned what, rows, k, swz, base;  // what 0: a K-major tile read transposed; 1: an MN-rows tile
    while (std::scanf("%u %u %u %u %u", &what, &rows, &k, &swz, &base) == 5) {
        for (unsigned ks = 0; ks < rows / 16; ++ks)
            std::printf("%llu\n", what == 0 ? kmajor_as_mn_desc(base, ks, rows, swz) : mn_rows_desc(base, ks, rows));
        for (unsigned r = 0; r < rows; ++r)
            for (unsigned c = 0; c < k; ++c)
                std::printf("%u\n", what == 0 ? kmajor_offset(r, c, rows, swz) : mn_rows_offset(r, c, rows));
    }
    return 0;
}
"""


def _mn_major_reads(cxx_program, cases):
    """For each (what, rows, K, swizzle, base): the kernel's descriptors (one per 16 rows) and
    the byte offset it stores element (row, col) at, from the host-compiled header."""
    text = "".join(" ".join(map(str, c)) + "\n" for c in cases)
    done = subprocess.run([str(cxx_program)], input=text, capture_output=True, text=True, check=True)
    values = iter(int(v) for v in done.stdout.split())
    out = {}
    for case in cases:
        _, rows, k, _, _ = case
        descs = [next(values) for _ in range(rows // 16)]
        offsets = np.array([next(values) for _ in range(rows * k)], dtype=np.int64).reshape(rows, k)
        out[case] = (descs, offsets)
    return out


@pytest.fixture(scope="module")
def mn_layout_program(tmp_path_factory):
    return _host_layout_program(tmp_path_factory, "wgmma_mn_layout", _HOST_MN_PROGRAM)


def test_training_reads_its_operands_where_the_kernel_put_them(mn_layout_program):
    """Every MN-major operand of the wgmma training kernels, addressed as the PTX ISA defines
    (tests/layout_reference.py) from the kernel's own descriptors, is the element the kernel
    stored there: each layer's K-major forward image read transposed by the backward (W^T, the
    k16 steps along fan_out) for every training plan's layers, and the weight-gradient stages
    (delta^T: 64 columns; h: 64 to 256 columns) for every 16 of their 64 rows."""
    cases = set()
    for plan in plan_cases().values():
        tp = WgmmaPlan(plan.spec, training=True)
        if not tp.trains:  # W: its weights do not fit shared memory
            continue
        for _, _, k, n, swz, offset in tp.layers[1:]:  # layer 0's transpose is never read
            cases.add((0, n, k, swz, offset + 0x400))
        for kp in (64, *tp.wgrad_kp):
            cases.add((1, 64, kp, 128, 0x800))
    cases = sorted(cases)
    values = _mn_major_reads(mn_layout_program, cases)
    for case in cases:
        what, rows, k, swz, base = case
        descs, offsets = values[case]
        for ks, desc in enumerate(descs):
            start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
            assert desc >> 62 == {128: 1, 64: 2, 32: 3}[swz]
            for mn in range(k):
                for kk in range(16):
                    got = ref.wgmma_smem_byte_address("MN", swz, 2, k, start, lbo, sbo, mn, kk)
                    assert got == base + offsets[16 * ks + kk, mn], (case, ks, mn, kk)
        # the stores cover the tile once: no two elements share a byte pair
        assert len(np.unique(offsets)) == offsets.size and (offsets % 2 == 0).all()


def _read_operand(image: bytes, desc: int, mn_extent: int) -> np.ndarray:
    """The mn_extent x 16 fp16 operand one wgmma reads through ``desc``, addressed as the PTX
    ISA defines it (tests/layout_reference.py), from shared memory holding ``image`` at 0."""
    start, lbo, sbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4
    swz = {1: 128, 2: 64, 3: 32}[desc >> 62]
    halves = np.frombuffer(image, dtype=np.float16)
    out = np.empty((mn_extent, 16), dtype=np.float16)
    for mn in range(mn_extent):
        for k in range(16):
            out[mn, k] = halves[ref.wgmma_smem_byte_address("K", swz, 2, mn_extent, start, lbo, sbo, mn, k) // 2]
    return out


@pytest.mark.parametrize("name", ["S", "M", "w48-in5-out3", "w16-in3-out1"])
def test_emulated_kernel_data_path_matches_the_oracle(layout_program, name):
    """The forward the kernel computes, emulated on the CPU from what it would read: the input
    tile written at kmajor_offset (convert_input), every operand fetched through the kernel's
    own descriptors with the PTX ISA's addressing, the host's weight and bias images, fp16
    rounding of A at the points the kernel rounds. Catches wrong offsets, swizzles, transposes,
    padding or bias placement without a GPU (the GPU tests check the hardware)."""
    plan = plan_cases()[name]
    spec = plan.spec.replace(activation="Tanh")
    plan = WgmmaPlan(spec)
    rng = np.random.default_rng(7)
    params = random_params(spec, rng)
    for key in params:
        if key.startswith("W"):
            params[key] *= np.float32(1.0 / np.sqrt(params[key].shape[1]))
    image, bias = host_images(plan, params)
    image = image.tobytes()
    geometries = [(64, plan.kin_p, plan.swz_in, 0)] + [(n, k, swz, off) for _, _, k, n, swz, off in plan.layers]
    values = kernel_layout_values(layout_program, geometries)
    rows = 50  # one partial tile: rows 50..63 are zero-filled
    x = rng.standard_normal((rows, spec.n_input_dims)).astype(np.float32)
    # convert_input: 8 halves per 16-byte unit at kmajor_offset(r, k0)
    a_descs, a_offsets = values[geometries[0]]
    tile = np.zeros(64 * plan.kin_p, dtype=np.float16)
    padded = np.zeros((64, plan.kin_p), dtype=np.float16)
    padded[:rows, : plan.nin] = x
    for r in range(64):
        for k0 in range(0, plan.kin_p, 8):
            tile[a_offsets[r, k0] // 2: a_offsets[r, k0] // 2 + 8] = padded[r, k0:k0 + 8]
    a_tile = tile.tobytes()
    h = None
    for i, (_, _, k, n, swz, off) in enumerate(plan.layers):
        descs, _ = values[(n, k, swz, off)]
        acc = np.zeros((64, n), dtype=np.float64)
        for ks in range(k // 16):
            b = _read_operand(image, descs[ks], n).astype(np.float64)  # (n, 16): B is K-major
            a = (_read_operand(a_tile, a_descs[ks], 64) if i == 0 else h[:, 16 * ks: 16 * ks + 16]).astype(np.float64)
            acc += a @ b.T
        z = acc + bias[plan.b_offsets[i]: plan.b_offsets[i] + n]
        if i < plan.n_hidden:
            h = nm.activate(spec.activation, z).astype(np.float16)
        else:
            out = nm.activate(spec.output_activation, z)[:rows, : spec.n_output_dims]
    oracle = CpuBackend("float64").compile(spec)
    oracle.set_params(params)
    ref_out = oracle.forward(x)
    err = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert err <= FWD_TOL, f"{name}: emulated kernel data path rel. err {err:.2e}"


def test_plan_descriptors_are_the_layouts_descriptors():
    for plan in plan_cases().values():
        for i, (_, _, k, n, swz, _) in enumerate(plan.layers):
            descs = plan.descriptors(i)
            assert len(descs) == k // 16
            for ks, desc in enumerate(descs):
                assert desc == L.wgmma_smem_descriptor(n, k, "K", swz, col0=16 * ks)
                assert (desc.lbo, desc.sbo, desc.swizzle_bytes) == (16, 8 * swz, swz)


# -- CPU: the fragment indexing the kernel codes against -----------------------------------------
@pytest.mark.parametrize("n", [8, 16, 32, 64, 128, 256])
def test_kernel_accumulator_indexing_equals_layouts(n):
    acc = L.wgmma_accumulator(n)
    for warp in range(4):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for i in range(n // 2):  # mlp_wgmma.cu: row 16w + g + 8((i >> 1) & 1), col 2t + (i & 1) + 8(i >> 2)
                want = {"row": 16 * warp + g + 8 * ((i >> 1) & 1), "col": 2 * t + (i & 1) + 8 * (i >> 2)}
                assert acc.apply(register=i, lane=lane, warp=warp) == want


@pytest.mark.parametrize("n", [16, 32, 64, 128, 256])
def test_accumulator_to_a_registers_is_the_identity(n):
    # hidden_epilogue: A register j of k16 slice s = cvt.rn.f16x2.f32(d[8s+2j+1], d[8s+2j]),
    # i.e. A element r is accumulator element r (low half = even element)
    assert L.register_permutation(L.wgmma_accumulator(n), L.wgmma_a_registers()) == list(range(n // 2))


# -- CPU: nvcc assembles the generated source --------------------------------------------------------
def test_generated_sources_assemble_for_sm_90a_without_spills(tmp_path):
    nvcc = toolchain.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc is not installed here: the wgmma source is only assembled where it is")
    plans = {"S": WgmmaPlan(bench_spec("S")),
             "S-Sine": WgmmaPlan(bench_spec("S", activation="Sine")),
             "M": WgmmaPlan(bench_spec("M", activation="SiLU", output_activation="Sigmoid")),
             "M-4wg": WgmmaPlan(bench_spec("M"), half_warpgroups=4, half_stages=3),
             "L": WgmmaPlan(bench_spec("L")),
             "L-1wg": WgmmaPlan(bench_spec("L"), warpgroups=1),
             "W": WgmmaPlan(bench_spec("W", activation="Tanh")),
             "odd": WgmmaPlan(bench_spec("M").replace(**ODD_SPECS["w112-in100-out33"])),
             "w256": WgmmaPlan(bench_spec("M").replace(**ODD_SPECS["w256-in3-out1-h1"]))}
    assert not plans["W"].half_io and all(p.half_io for n, p in plans.items() if n != "W")
    # the training modules: a derivative stored (SiLU) and the luminance loss, odd paddings
    training = {"S": bench_spec("S"), "M-SiLU": bench_spec("M", activation="SiLU", loss="RelativeL2Luminance"),
                "L": bench_spec("L", activation="LeakyReLU"),
                "odd": bench_spec("M").replace(**ODD_SPECS["w112-in100-out33"]),
                "w256": bench_spec("M").replace(**ODD_SPECS["w256-in3-out1-h1"], activation="Tanh")}
    plans.update({f"train-{n}": WgmmaPlan(spec, training=True) for n, spec in training.items()})
    jobs = {}
    for name, plan in plans.items():  # in parallel: each is a separate nvcc process
        src = tmp_path / f"{name}.cu"
        src.write_text(plan.source)
        jobs[name] = subprocess.Popen([nvcc, *wgmma.WGMMA_NVCC_OPTIONS, "-Xptxas", "-v", str(src), "-o",
                                       str(tmp_path / f"{name}.cubin")], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
    for name, job in jobs.items():
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, f"{name}: {err[-3000:]}"
        assert "serialized" not in err, f"{name}: ptxas serialises wgmma: {err[-2000:]}"
        report = re.findall(r"Compiling entry function '(\w+)'.*?\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                            r"(\d+) bytes spill loads", err, flags=re.S)
        if plans[name].training:
            kernels = set(wgmma.WGMMA_TRAIN_KERNELS)
        else:
            kernels = {"wgmma_forward", "wgmma_pack"} | ({"wgmma_forward_half"} if plans[name].half_io else set())
        assert {k for k, *_ in report} == kernels, err
        for kernel, stack, stores, loads in report:
            assert (int(stores), int(loads)) == (0, 0), f"{name} {kernel} spills: {err}"
            # sinf's argument reduction for |x| > 105615 keeps a 28-byte table on the stack (the
            # slow path only); nothing else may use local memory
            allowed = 32 if name == "S-Sine" else 0
            assert int(stack) <= allowed, f"{name} {kernel} has a {stack}-byte stack frame: {err}"
        cubin = (tmp_path / f"{name}.cubin").read_bytes()
        assert cubin[:4] == b"\x7fELF"


def test_probe_kernel_assembles():
    if toolchain.find_nvcc() is None:
        pytest.skip("nvcc is not installed here: the probe kernel is only assembled where it is")
    source = read_source("cuda/wgmma_layout.cuh") + wgmma._WGMMA_PROBE_KERNEL
    assert toolchain.nvcc_compile(source, wgmma.WGMMA_NVCC_OPTIONS, "probe")[:4] == b"\x7fELF"


# -- GPU -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wgmma_backend():
    try:
        import cupy  # noqa: F401
    except ImportError:
        pytest.skip("CuPy is not installed: the cuda backend cannot run here")
    if os.environ.get(knobs.WGMMA_ENV) == "0":
        pytest.skip(f"{knobs.WGMMA_ENV}=0 turns the wgmma variant off")
    backend = cuda.CudaBackend()
    row = {r.variant: r for r in backend.probe()}["wgmma"]
    if not row.available:
        pytest.skip(f"the cuda wgmma variant is unavailable here: {row.reason}")
    return backend


@pytest.fixture(scope="module")
def cache():
    return KernelCache()


_models: dict = {}


def pair(backend, cache, spec, rng):
    """(wgmma model, float64 oracle) with the same fresh random parameters (biases non-zero)."""
    key = spec.content_hash()
    if key not in _models:
        _models[key] = (backend.compile(spec, variant="wgmma", cache=cache), CpuBackend("float64").compile(spec))
    model, oracle = _models[key]
    params = init_params(spec)
    for name in params:
        if name.startswith("b"):
            params[name] = rng.uniform(-0.2, 0.2, size=params[name].shape).astype(np.float32)
    model.set_params(params)
    oracle.set_params(params)
    return model, oracle


def inputs(rng, rows, spec):
    x = rng.standard_normal((rows, spec.n_input_dims), dtype=np.float32)
    return x * np.float32(0.5) if spec.activation == "Exponential" else x


# Exponential only on S (inputs halved): stacked exp overflows fp16 on deeper models, a limit of
# fp16 activations, not of the kernel (as in tests/test_cuda.py)
FORWARD_CASES = [(m, a) for m in "SMLW" for a in ACTIVATIONS if a != "Exponential" or m == "S"]


def forward_io(model, x: np.ndarray, io: str) -> tuple[np.ndarray, np.ndarray]:
    """(host output, the input the kernel saw as fp32): fp32 host rows, or fp16 device rows in
    and fp16 device rows out (``wgmma_forward_half`` where the plan has it)."""
    if io == "fp32":
        out = model.forward(x)
        assert out.dtype == np.float32
        return out, x
    import cupy

    x16 = x.astype(np.float16)
    out = model.forward(cupy.asarray(x16), out_dtype=np.float16)
    assert isinstance(out, cupy.ndarray) and out.dtype == cupy.float16
    return cupy.asnumpy(out).astype(np.float32), x16.astype(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("io", ["fp32", "fp16"])
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"rows{b}")
@pytest.mark.parametrize(("name", "activation"), FORWARD_CASES, ids=[f"{m}-{a}" for m, a in FORWARD_CASES])
def test_wgmma_forward_matches_oracle(wgmma_backend, cache, name, activation, batch, io):
    rng = case_rng(name, activation, batch, io, "wgmma")
    spec = bench_spec(name, activation=activation)
    model, oracle = pair(wgmma_backend, cache, spec, rng)
    assert model.variant == "wgmma"
    out, seen = forward_io(model, inputs(rng, batch, spec), io)
    assert out.shape == (batch, spec.n_output_dims)
    check = np.arange(batch) if batch <= 65_537 else np.sort(rng.choice(batch, 4096, replace=False))
    err = rel_err(out[check], oracle.forward(seen[check]))
    assert err <= FWD_TOL, f"wgmma {name}/{activation}/{batch} rows, {io} I/O: forward rel. err {err:.2e}"


def test_the_forward_cases_cover_every_model_and_activation():
    assert {m for m, _ in FORWARD_CASES} == set("SMLW")
    assert {a for _, a in FORWARD_CASES} == set(ACTIVATIONS)


@pytest.mark.gpu
@pytest.mark.parametrize("io", ["fp32", "fp16"])
@pytest.mark.parametrize("name", list(ODD_SPECS))
def test_wgmma_odd_shapes(wgmma_backend, cache, name, io):
    """Inputs of fewer than 8 halves a row or not a multiple of 8 (the fp16 kernel's element
    loads), odd output counts (its single-half stores), padded widths."""
    rng = case_rng(name, io, "odd")
    spec = bench_spec("M", activation="SiLU", output_activation="Sigmoid").replace(**ODD_SPECS[name])
    model, oracle = pair(wgmma_backend, cache, spec, rng)
    assert model.wg.half_io
    for batch in (1, 63, 64, 65, 1001):
        out, seen = forward_io(model, rng.uniform(-1, 1, (batch, spec.n_input_dims)).astype(np.float32), io)
        err = rel_err(out, oracle.forward(seen))
        assert err <= FWD_TOL, f"{name}, {batch} rows, {io} I/O: rel. err {err:.2e}"


@pytest.mark.gpu
def test_wgmma_half_rings_compute_the_same(wgmma_backend, cache, monkeypatch):
    """Every (warpgroups, ring tiles) plan of the fp16 kernel gives the same bits: many tiles a
    warpgroup, the ring wrapping, a ragged last tile."""
    import cupy

    rng = case_rng("rings")
    spec = bench_spec("M", activation="LeakyReLU")
    oracle = CpuBackend("float64").compile(spec)
    x16 = inputs(rng, 500_001, spec).astype(np.float16)
    dx = cupy.asarray(x16)
    check = np.concatenate([np.sort(rng.choice(500_001 - 100, 4096, replace=False)), np.arange(500_001 - 100, 500_001)])
    first = None
    for wgs, ring in ((1, 1), (2, 2), (3, 4), (4, 3)):
        monkeypatch.setenv(knobs.WGMMA_HALF_WARPGROUPS_ENV, str(wgs))
        monkeypatch.setenv(knobs.WGMMA_HALF_STAGES_ENV, str(ring))
        model = wgmma_backend.compile(spec, variant="wgmma", cache=cache)
        assert (model.wg.half_warpgroups, model.wg.half_stages) == (wgs, ring)
        if first is None:
            params = model.get_params()
            oracle.set_params(params)
        model.set_params(params)
        out = cupy.asnumpy(model.forward(dx, out_dtype=np.float16))
        if first is None:
            first = out
            err = rel_err(out[check].astype(np.float32), oracle.forward(x16[check].astype(np.float32)))
            assert err <= FWD_TOL, f"{wgs} warpgroups, {ring} ring tiles: rel. err {err:.2e}"
        else:
            np.testing.assert_array_equal(out, first, err_msg=f"{wgs} warpgroups, {ring} ring tiles")
        model.close()


@pytest.mark.gpu
def test_wgmma_half_forward_into_and_group(wgmma_backend, cache):
    """``forward_into`` an fp16 device array is the kernel's own output; a group of pairs (the
    mma group kernel on the same parameters) agrees with it within the forward tolerance."""
    import cupy

    rng = case_rng("into")
    spec = bench_spec("S", activation="Tanh")
    model, oracle = pair(wgmma_backend, cache, spec, rng)
    x16 = cupy.asarray(inputs(rng, 3000, spec).astype(np.float16))
    direct = model.forward(x16, out_dtype=np.float16)
    into = cupy.empty((3000, spec.n_output_dims), dtype=cupy.float16)
    model.forward_into(x16, into)
    np.testing.assert_array_equal(cupy.asnumpy(into), cupy.asnumpy(direct))
    grouped = cupy.empty_like(into)
    model.forward_group([(x16, grouped)])
    seen = cupy.asnumpy(x16).astype(np.float32)
    ref = oracle.forward(seen)
    for label, out in (("into", into), ("group", grouped)):
        err = rel_err(cupy.asnumpy(out).astype(np.float32), ref)
        assert err <= FWD_TOL, f"{label}: rel. err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("warpgroups", ["1", "2"])
@pytest.mark.parametrize("name", ["M", "L"])
def test_wgmma_forced_warpgroups(wgmma_backend, cache, monkeypatch, name, warpgroups):
    monkeypatch.setenv(knobs.WGMMA_WARPGROUPS_ENV, warpgroups)
    rng = np.random.default_rng(int(warpgroups))
    spec = bench_spec(name, activation="Softplus")
    model = wgmma_backend.compile(spec, variant="wgmma", cache=cache)
    assert model.wg.warpgroups == int(warpgroups)
    oracle = CpuBackend("float64").compile(spec)
    oracle.set_params(model.get_params())
    x = inputs(rng, 70_001, spec)
    err = rel_err(model.forward(x), oracle.forward(x))
    assert err <= FWD_TOL, f"{name} with {warpgroups} warpgroups: rel. err {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("stages", ["1", "2"])
@pytest.mark.parametrize("name", ["S", "M"])
def test_wgmma_input_stages(wgmma_backend, cache, monkeypatch, name, stages):
    """The ring of prefetched input tiles: many tiles per warpgroup and a ragged last tile."""
    monkeypatch.setenv(knobs.WGMMA_STAGES_ENV, stages)
    rng = np.random.default_rng(100 + int(stages))
    spec = bench_spec(name, activation="LeakyReLU")
    model = wgmma_backend.compile(spec, variant="wgmma", cache=cache)
    assert model.wg.x_stages == int(stages) and model.wg.input_staged
    oracle = CpuBackend("float64").compile(spec)
    oracle.set_params(model.get_params())
    x = inputs(rng, 500_001, spec)
    out = model.forward(x)
    check = np.concatenate([np.sort(rng.choice(500_001 - 100, 8192, replace=False)), np.arange(500_001 - 100, 500_001)])
    err = rel_err(out[check], oracle.forward(x[check]))
    assert err <= FWD_TOL, f"{name} with {stages} prefetched tiles: rel. err {err:.2e}"


@pytest.mark.gpu
def test_wgmma_forward_follows_training(wgmma_backend, cache):
    """Training runs the mma kernels on the same masters; the next forward repacks the image."""
    rng = np.random.default_rng(17)
    spec = bench_spec("M", activation="Tanh")
    model, oracle = pair(wgmma_backend, cache, spec, rng)
    x = inputs(rng, 4096, spec)
    y = np.tanh(x[:, : spec.n_output_dims]).astype(np.float32)
    before = model.forward(x)
    losses = model.train_step(x, y, steps=5)
    assert np.isfinite(losses).all()
    oracle.set_params(model.get_params())
    after = model.forward(x)
    assert not np.array_equal(before, after)
    assert rel_err(after, oracle.forward(x)) <= FWD_TOL


@pytest.mark.gpu
def test_wgmma_forward_follows_data_parallel_steps(wgmma_backend, cache):
    """A data-parallel run (one replica here: the all-reduce of one is the identity) changes the
    masters through ``parallel_apply``; the next forward serves them, bit for bit what a model
    given the same parameters computes."""
    import cupy

    rng = case_rng("parallel")
    spec = bench_spec("M", activation="ReLU")
    model = wgmma_backend.compile(spec, variant="wgmma", cache=cache)
    x = inputs(rng, 4096, spec)
    y = rng.standard_normal((4096, spec.n_output_dims), dtype=np.float32)
    x16 = cupy.asarray(x).astype(cupy.float16)
    before = cupy.asnumpy(model.forward(x16, out_dtype=np.float16))
    data = model.put_dataset([(x, y)], 4096, np.float32, np.float32)
    position = EpochPosition(int(rng.integers(0, 2**32)))
    model.parallel_start(data, 512, 3, position)
    for _ in range(3):
        model.parallel_gradients(512)
        model.parallel_apply()
    assert np.isfinite(model.parallel_finish(3, position)).all()
    after = cupy.asnumpy(model.forward(x16, out_dtype=np.float16))
    assert not np.array_equal(before, after)
    fresh = wgmma_backend.compile(spec, variant="wgmma", cache=cache)
    fresh.set_params(model.get_params())
    np.testing.assert_array_equal(after, cupy.asnumpy(fresh.forward(x16, out_dtype=np.float16)))
    fresh.close()
    model.close()


@pytest.mark.gpu
def test_wgmma_device_input_at_an_odd_offset(wgmma_backend, cache):
    import cupy

    rng = np.random.default_rng(4)
    spec = bench_spec("S")
    model, oracle = pair(wgmma_backend, cache, spec, rng)
    x = rng.standard_normal((301, spec.n_input_dims), dtype=np.float32)
    view = cupy.asarray(x).reshape(-1)[1:].reshape(-1)[: 300 * spec.n_input_dims].reshape(300, -1)
    out = model.forward(view)
    assert isinstance(out, cupy.ndarray)
    assert rel_err(model.download(out), oracle.forward(model.download(view))) <= FWD_TOL


@pytest.mark.gpu
def test_wgmma_probe_gate_and_default_choice(wgmma_backend, cache, monkeypatch):
    monkeypatch.setenv(knobs.DISPATCH_ENV, "fixed")  # the fixed rule; measuring: tests/test_cuda_dispatch.py
    # on by default: the fixed rule's choice for a model that fits
    assert wgmma_backend.compile(bench_spec("S"), cache=cache).variant == "wgmma"
    monkeypatch.setenv(knobs.WGMMA_ENV, "0")
    row = {r.variant: r for r in cuda.CudaBackend().probe()}["wgmma"]
    assert not row.available and row.reason == wgmma.WGMMA_OFF
    assert cuda.CudaBackend().compile(bench_spec("S"), cache=cache).variant == "mma"


@pytest.mark.gpu
def test_wgmma_cache_hit_runs_no_compiler(wgmma_backend, tmp_path, monkeypatch):
    cache = KernelCache(tmp_path)
    spec = bench_spec("S", activation="Softplus")
    wgmma_backend.compile(spec, variant="wgmma", cache=cache).wait_for_training_kernels()
    misses = cache.stats.misses

    def no_compiler(*args, **kwargs):
        raise AssertionError("a compiler was called on a cache hit")

    monkeypatch.setattr(wgmma, "nvcc_compile", no_compiler)
    monkeypatch.setattr(mma, "nvrtc_compile", no_compiler)
    model = wgmma_backend.compile(spec, variant="wgmma", cache=cache)
    model.wait_for_training_kernels()
    # the mma serving and training modules, the wgmma forwards, the wgmma training
    assert cache.stats.hits == misses == 4
    x = np.random.default_rng(1).standard_normal((10, spec.n_input_dims), dtype=np.float32)
    assert np.isfinite(model.forward(x)).all()


# -- CPU: the probe's gate, on a stand-in for CuPy and the device --------------------------------
def _fake_device(monkeypatch, cc):
    from types import SimpleNamespace

    runtime = SimpleNamespace(getDeviceCount=lambda: 1, driverGetVersion=lambda: 13000, runtimeGetVersion=lambda: 13020)
    fake_cp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime), __version__="stand-in")
    info = {"name": "stand-in GPU", "cc": cc, "sm_count": 132, "smem_per_sm": 228 * 1024,
            "smem_optin": 227 * 1024, "regs_per_sm": 65536}
    monkeypatch.setattr(cuda, "cupy_module", lambda: fake_cp)
    monkeypatch.setattr(cuda, "device_info", lambda cp: info)
    monkeypatch.setattr(cuda, "nvrtc_version", lambda: "13.0")
    monkeypatch.setattr(cuda, "cublaslt_availability", lambda: (False, "not here", ""))


@pytest.mark.parametrize(("cc", "env", "check", "available", "reason"), [
    ((9, 0), None, (True, ""), True, ""),
    ((9, 0), "0", None, False, wgmma.WGMMA_OFF),
    ((9, 0), "1", (True, ""), True, ""),
    ((9, 0), "1", (False, "nvcc exit 1: boom"), False, "the sm_90a wgmma check failed: nvcc exit 1: boom"),
    ((8, 9), "1", None, False, "wgmma needs compute capability 9.0 (sm_90a); this GPU is 8.9"),
])
def test_probe_gate(monkeypatch, cc, env, check, available, reason):
    _fake_device(monkeypatch, cc)
    if env is None:
        monkeypatch.delenv(knobs.WGMMA_ENV, raising=False)
    else:
        monkeypatch.setenv(knobs.WGMMA_ENV, env)
    calls = []

    def fake_check():
        calls.append(1)
        return check

    monkeypatch.setattr(cuda, "nvcc_runs_wgmma", fake_check)
    rows = {r.variant: r for r in cuda.CudaBackend().probe()}
    assert (rows["wgmma"].available, rows["wgmma"].reason) == (available, reason)
    assert len(calls) == (check is not None)  # the run check happens only behind the gate
    assert rows["mma"].available  # the mma row is untouched by the gate
    # the wgmma forwards with mma's training: offered exactly where wgmma is
    pair = rows["wgmma+mma"]
    assert (pair.available, pair.reason) == (available, reason)
    assert pair.details["training"] == "mma" and pair.details["forward"] == "wgmma"
    # trained by cublaslt (unavailable here), served by wgmma: its row names what is missing
    split = rows["wgmma+cublaslt"]
    assert not split.available and "cublaslt: not here" in split.reason
    assert ("wgmma: " in split.reason) == (not available)
    if available:
        assert {s.n for s in rows["wgmma"].mma_shapes} == {8, 16, 32, 64, 128, 256}
