"""CPU checks of the cuda backend's fragment assumptions against backends/layouts.py (no GPU).

mlp_mma.cu (1) packs weights as images of mma.m16n8k16 B fragments (``b_image_index``), and
(2) turns the accumulators of two adjacent n8 tiles into the next layer's A fragment register
for register. Both are checked here against the layouts module, which is itself tested against
the PTX ISA. Also: the module imports and probes cleanly where CuPy is absent, and (where nvcc
is installed) the generated kernel source compiles for sm_90 with no local-memory spills.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess

import numpy as np
import pytest

from mmad.backends import layouts as L
from mmad.backends.cuda import CudaBackend
from mmad.backends.cuda.cublaslt import EW_KERNELS, elementwise_source
from mmad.install import missing_piece, read_driver
from mmad.backends.cuda.mma import (
    FUSED_KERNELS, GROUP_KERNELS, PLAIN_FORWARD_KERNELS, SERVE_COMMON_KERNELS, TRAIN_KERNELS, MmaPlan, b_image_index,
)
from mmad.errors import SpecError
from mmad.spec import bench_spec


def test_b_image_index_matches_the_mma_b_fragment() -> None:
    layout = L.mma_m16n8k16_b()  # (register = b0..b3, lane) -> (row = k, col = n)
    for lane in range(32):
        for reg in range(4):
            where = layout.apply(register=reg, lane=lane)
            assert int(b_image_index(16, where["row"], where["col"])) == lane * 4 + reg


def test_b_image_index_is_a_bijection_over_a_padded_operand() -> None:
    k_dim, n_dim = 48, 40
    k, n = np.meshgrid(np.arange(k_dim), np.arange(n_dim), indexing="ij")
    idx = b_image_index(k_dim, k.ravel(), n.ravel())
    assert sorted(idx.tolist()) == list(range(k_dim * n_dim))
    # each (n-tile, k-chunk) block is one contiguous 128-half run that lane l reads at 4 l
    block = idx.reshape(k_dim, n_dim)[16:32, 8:16]
    start = ((1 * (k_dim // 16)) + 1) * 128
    assert block.min() == start and block.max() == start + 127


def test_two_accumulator_tiles_are_the_next_a_fragment() -> None:
    # the accumulators of n-tiles 2j and 2j+1 as one 16x16 tile: the third register bit is +8 columns
    c_pair = L.LinearLayout({"register": [(0, 1), (8, 0), (0, 8)],
                             "lane": L.mma_m16n8k16_c().bases["lane"]},
                            [("row", 16), ("col", 16)])
    for reg in range(4):  # the pair layout agrees with the single-tile C layout on its first tile
        for lane in range(32):
            assert c_pair.apply(register=reg, lane=lane) == L.mma_m16n8k16_c().apply(register=reg, lane=lane)
    # the kernel sets A reg i (halves 2i, 2i+1) from accumulator elements 2i, 2i+1: the identity
    assert L.register_permutation(c_pair, L.mma_m16n8k16_a()) == list(range(8))


def test_probe_without_cupy_reports_why() -> None:
    rows = CudaBackend().probe()
    assert [r.variant for r in rows] == ["wgmma", "wgmma+mma", "mma", "mma-f16acc", "cublaslt", "mma-f16acc+cublaslt", "wgmma+cublaslt"]
    if importlib.util.find_spec("cupy") is None:
        # the reason names the first missing piece: the driver (or GPU) where there is none, else CuPy
        expected = missing_piece(read_driver()) or "CuPy is not installed"
        for row in rows:
            assert not row.available
            assert expected in row.reason
    for row in rows:
        assert row.available or row.reason


def nvcc_local_memory(nvcc: str, plan: MmaPlan, stem) -> dict[str, int]:
    """Each kernel's stack frame + spill stores in bytes, from nvcc's -Xptxas -v for sm_90 over the
    plan's two sources (the serving and the training module); each must build and hold exactly
    the kernels its module loads."""
    local = {}
    for part, source, kernels in (("serve", plan.serve_source, plan.serve_kernels),
                                  ("train", plan.train_source, plan.train_kernels)):
        src = stem.with_name(f"{stem.name}-{part}.cu")
        src.write_text(source)
        done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", str(src),
                               "-o", str(src.with_suffix(".cubin"))], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        report = re.findall(r"Compiling entry function '(\w+)'.*?\n\s*(\d+) bytes stack frame, (\d+) bytes spill "
                            r"stores", done.stderr, flags=re.S)
        assert {kernel for kernel, _, _ in report} == set(kernels), part
        local.update({kernel: int(stack) + int(spill) for kernel, stack, spill in report})
    return local


@pytest.mark.parametrize(("name", "overrides", "spill_free"), [
    # S: mlp_train_fused is bounded to 128 registers for two blocks an SM and spills a little
    # (measured faster than one spill-free block: mma.py's FUSED_TWO_BLOCKS_MAX_ACC)
    ("S", {}, ("mlp_forward", "mlp_forward_half", "mlp_train_fwd_bwd", "mlp_wgrad", "mlp_optimize")),
    ("M", {"activation": "LeakyReLU"}, ("mlp_forward", "mlp_forward_half", "mlp_train_fwd_bwd", "mlp_train_fused")),
    ("M", {"activation": "SiLU", "loss": "RelativeL2Luminance"}, ("mlp_forward", "mlp_forward_half", "mlp_train_fwd_bwd")),
    ("L", {"optimizer": {"otype": "SGD", "learning_rate": 0.01, "momentum": 0.9}},
     ("mlp_forward", "mlp_forward_half", "mlp_train_fwd_bwd")),
    # width 256: the forward fits in 254 registers; training spills a little (reported, allowed)
    ("W", {}, ("mlp_forward", "mlp_forward_half", "mlp_wgrad")),
])
def test_generated_source_builds_with_nvcc_without_spills(tmp_path, name, overrides, spill_free) -> None:
    """The exact sources the backend hands NVRTC (the serving module's and the training module's),
    built by nvcc for sm_90: each compiles, holds exactly the kernels its module loads, and uses
    no local memory."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here: the generated CUDA source is only checked where it is")
    plan = MmaPlan(bench_spec(name, **overrides))
    spills = nvcc_local_memory(nvcc, plan, tmp_path / name)
    fused = set(FUSED_KERNELS) if plan.fused_wgrad else set()
    group = set(GROUP_KERNELS) if plan.group_forward else set()
    assert set(spills) == set(PLAIN_FORWARD_KERNELS + SERVE_COMMON_KERNELS + TRAIN_KERNELS) | fused | group
    # the *_rows kernels (a held dataset read in place) must spill no more than their plain twins,
    # nor the group forwards (several requests in one launch) than the plain forwards
    for kernel, twin in [("mlp_train_fwd_bwd", "mlp_train_fwd_bwd_rows"), ("mlp_train_fused", "mlp_train_fused_rows"),
                         ("mlp_forward", "mlp_forward_group"), ("mlp_forward_half", "mlp_forward_half_group")]:
        if twin in spills:
            assert spills[twin] <= spills[kernel], spills
    for kernel in spill_free + ("mlp_gather_batch", "mlp_batch_rows", "mlp_finish_step"):
        assert spills[kernel] == 0, f"{kernel} uses local memory: {spills}"


@pytest.mark.parametrize(("name", "overrides"), [
    ("S", {}),
    ("M", {"activation": "Tanh", "loss": "L1"}),
    ("M", {"loss": "RelativeL2Luminance", "n_output_dims": 3, "output_activation": "Sigmoid"}),
    ("W", {"activation": "SiLU", "optimizer": {"otype": "SGD"}}),
])
def test_cublaslt_elementwise_source_builds_with_nvcc_without_spills(tmp_path, name, overrides) -> None:
    """The cublaslt variant's element-wise kernels (the source NVRTC gets) built by nvcc for sm_90:
    every kernel the model loads is there and none uses local memory."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here: the generated CUDA source is only checked where it is")
    src = tmp_path / "ew.cu"
    src.write_text(elementwise_source(bench_spec(name, **overrides)))
    done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", str(src),
                           "-o", str(tmp_path / "ew.cubin")], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = re.findall(r"Compiling entry function '(\w+)'.*?\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores",
                        done.stderr, flags=re.S)
    assert {kernel for kernel, _, _ in report} == set(EW_KERNELS)
    assert all(int(stack) + int(spill) == 0 for _, stack, spill in report), report


@pytest.mark.parametrize("name", ["S", "M", "L", "W"])
def test_fp16_accumulating_forwards_build_with_nvcc_without_spills(tmp_path, name) -> None:
    """The mma-f16acc variant's source (FWD_ACC16: the fp16-out forwards accumulate in fp16, with
    their own rows per warp) built by nvcc for sm_90: its fp16-out forwards use no local memory and
    fewer registers per 16-row tile than the fp32-accumulating ones."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed here: the generated CUDA source is only checked where it is")
    regs, tiles = {}, {}
    for acc16 in (False, True):
        plan = MmaPlan(bench_spec(name), forward_acc16=acc16)
        tiles[acc16] = plan.mt_half
        assert ("#define FWD_ACC16 1" in plan.serve_source) is acc16
        src = tmp_path / f"{name}{int(acc16)}.cu"
        src.write_text(plan.serve_source)
        done = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", str(src),
                               "-o", str(tmp_path / f"{name}.cubin")], capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        report = re.findall(r"Compiling entry function '(\w+)'.*?\n\s*(\d+) bytes stack frame, (\d+) bytes spill "
                            r"stores.*?Used (\d+) registers", done.stderr, flags=re.S)
        half = [k for k in ("mlp_forward_half", "mlp_forward_half_group") if k in {r[0] for r in report}]
        assert half and (name == "W") == (half == ["mlp_forward_half"])  # no group forward at width 256
        for kernel, stack, spill, used in report:
            if kernel in half:
                assert int(stack) + int(spill) == 0 or not acc16, f"{kernel} uses local memory"
                regs[kernel, acc16] = int(used)
    for kernel in half:
        assert regs[kernel, True] / tiles[True] < regs[kernel, False] / tiles[False], (regs, tiles)


@pytest.mark.parametrize(("name", "overrides", "fused", "blocks"), [
    ("S", {}, True, 2),  # 32 accumulators a thread, 88 KiB: two blocks an SM
    ("M", {}, True, 1),  # 80 accumulators, 180 KiB
    ("M", {"activation": "LeakyReLU"}, True, 1),
    ("M", {"activation": "Tanh"}, False, 1),  # its derivative needs the pre-activation: not kept on chip
    ("L", {}, False, 1),  # 128 wide: the weight-gradient accumulators would not fit in registers
    ("W", {}, False, 1),
])
def test_fused_weight_gradients_where_they_fit(name, overrides, fused, blocks, monkeypatch) -> None:
    """mlp_train_fused (weight gradients accumulated in the training kernel) is planned exactly
    where its stash, delta stage and accumulators fit, bounded for two blocks an SM where both fit;
    MMAD_CUDA_FUSED_WGRAD=0 turns it off."""
    from mmad.backends.cuda import knobs, mma

    plan = MmaPlan(bench_spec(name, **overrides))
    assert plan.fused_wgrad is fused
    assert ("#define FUSED_WGRAD 1" in plan.train_source) is fused
    assert plan.fused_min_blocks == blocks and f"#define FUSED_MIN_BLOCKS {blocks}\n" in plan.train_source
    assert set(FUSED_KERNELS) <= set(plan.train_kernels) if fused else not set(FUSED_KERNELS) & set(plan.train_kernels)
    if fused:
        assert plan.smem_fused <= mma.FUSED_SMEM_LIMIT
        monkeypatch.setenv(knobs.FUSED_WGRAD_ENV, "0")
        assert MmaPlan(bench_spec(name, **overrides)).fused_wgrad is False
        monkeypatch.setenv(knobs.FUSED_WGRAD_ENV, "yes")
        with pytest.raises(SpecError, match=knobs.FUSED_WGRAD_ENV):
            MmaPlan(bench_spec(name, **overrides))
