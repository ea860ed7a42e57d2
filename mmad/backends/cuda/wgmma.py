"""The ``wgmma`` and ``wgmma+mma`` variants: Hopper warpgroup MMA (sm_90a) forwards; training on
wgmma (``wgmma``) or on the mma variant's kernels (``wgmma+mma``).

``mmad/shaders/cuda/mlp_wgmma.cu``: one warpgroup per 64-row tile, the weights resident in
shared memory in the swizzled K-major image the descriptors read (packed on the device through
maps built here with ``layouts.wgmma_smem_operand``; later layers take A from registers). Two
forwards: ``wgmma_forward`` (fp32 in and out) and ``wgmma_forward_half`` (fp16 in and out, its
input tiles put by cp.async straight where layer 0 reads them). ``mlp_wgmma_train.cu``: the
training step on the same fp32 masters (forward, loss and backward in one kernel, the backward's
B operand each layer's resident forward image read through an MN-major descriptor; weight
gradients as wgmma with both operands MN-major, reduced per chunk in a fixed order by the mma
variant's optimizer kernel), in a module of its own. Built with nvcc for sm_90a (NVRTC crashed compiling wgmma on
the H100). The probe requires compute capability 9.0, an nvcc build and a child process that
runs a wgmma (``MMAD_CUDA_WGMMA=0`` turns the variant off).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from typing import Any

import numpy as np

from mmad.backends import layouts as L
from mmad.backends.cache import KernelCache
from mmad.backends.contract import Dataset, EpochPosition
from mmad.backends.cuda.knobs import CudaKnobs
from mmad.backends.cuda.mma import DERIVATIVE_FROM_OUTPUT, CudaMmaModel, describe, f32_literal
from mmad.backends.cuda.toolchain import (
    LoadedModule, cached_cubin, device_errors, find_nvcc, nvcc_compile, nvcc_version,
)
from mmad.errors import CompileError, LaunchError, SpecError
from mmad.shaders import read_source
from mmad.spec import ACTIVATION_CODES, LOSS_CODES, MLPSpec, kernel_code_defines

WGMMA_OFF = "wgmma is turned off (MMAD_CUDA_WGMMA=0)"
WGMMA_NVCC_OPTIONS = ("-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-std=c++17")
WGMMA_KERNELS = ("wgmma_forward", "wgmma_forward_half", "wgmma_pack")
WGMMA_TILE_ROWS = 64  # one warpgroup's m64 tile
WGMMA_THREADS = 128  # one warpgroup
WGMMA_SMEM_LIMIT = 227 * 1024  # sm_90's opt-in shared memory per block
WGMMA_SMEM_PER_SM = 228 * 1024  # sm_90's shared memory per SM (each block also takes 1 KiB for the system)
WGMMA_REGS_PER_SM = 65536
WGMMA_ALIGN = 1024  # 128-byte swizzle atoms repeat every 1024 bytes: every section starts on one
WGRAD_STAGE_ROWS = 64  # batch rows per stage of the weight-gradient kernels (mlp_wgmma_train.cu)
WGRAD_STAGES = 3  # stages in their ring: two in flight while one computes
WGMMA_TRAIN_KERNELS = ("wgmma_train_fwd_bwd", "wgmma_train_fwd_bwd_rows", "wgmma_wgrad_in", "wgmma_wgrad_hid",
                       "wgmma_pack")


# one m64n8k16 with A from registers (all 1.0) and B (8 x 16, all 1.0) from a 32-byte-swizzled
# shared tile: every accumulator element is 16, so each thread's four sum to 64
_WGMMA_PROBE_KERNEL = r"""
extern "C" __global__ void wgmma_probe(float* out) {
    __shared__ __align__(1024) unsigned short b[8 * 16];
    b[threadIdx.x] = 0x3C00;  // 1.0 in fp16
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    const unsigned one = 0x3C003C00u;
    const unsigned long long desc = kmajor_desc((unsigned)__cvta_generic_to_shared(b), 0, 8, 32);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
    asm volatile("{.reg .pred p; setp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;}"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                 : "r"(one), "r"(one), "r"(one), "r"(one), "l"(desc), "r"(0));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    asm volatile("" : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3) :: "memory");
    out[threadIdx.x] = d0 + d1 + d2 + d3;
}
"""

_WGMMA_PROBE_RUN = """
import sys, cupy
module = cupy.RawModule(path=sys.argv[1])
kernel = module.get_function("wgmma_probe")
out = cupy.zeros(128, dtype=cupy.float32)
kernel((1,), (128,), (out,))
cupy.cuda.Device().synchronize()
values = out.get()
if not (values == 64).all():
    sys.exit(f"wrong wgmma result: {values[:8].tolist()} (expected 64 each)")
"""


def nvcc_runs_wgmma() -> tuple[bool, str]:
    """Build a wgmma kernel with nvcc, then run it in a child process (a crash stays there)."""
    source = read_source("cuda/wgmma_layout.cuh") + _WGMMA_PROBE_KERNEL
    try:
        cubin = nvcc_compile(source, WGMMA_NVCC_OPTIONS, "the wgmma probe kernel")
    except CompileError as exc:
        return False, exc.log.strip()[-300:]
    fd, path = tempfile.mkstemp(suffix=".cubin", prefix="mmad-wgmma-probe-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        done = subprocess.run([sys.executable, "-c", _WGMMA_PROBE_RUN, path], capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"the wgmma run check did not finish: {exc}"
    finally:
        os.unlink(path)
    if done.returncode == 0:
        return True, ""
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return False, f"the wgmma run check failed (exit {done.returncode}): {' '.join(tail)[:300]}"



def next_pow2(n: int, least: int) -> int:
    return max(least, 1 << (int(n) - 1).bit_length())


def kmajor_swizzle(k: int) -> int:
    """Swizzle bytes of a K-major fp16 tile with K columns: the widest atom K fills (K >= 16)."""
    return min(128, 2 * k)


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def _align(n: int, to: int = WGMMA_ALIGN) -> int:
    return (n + to - 1) // to * to


class WgmmaPlan:
    """Geometry, shared-memory plan, weight-image maps and source of one spec's wgmma forward
    kernel (needs no GPU, no CuPy).

    Widths are padded to powers of two (input K >= 16, hidden N = K >= 16, output N >= 8): the
    layouts module's wgmma operand layouts are defined for those. Each layer's weights form a
    K-major tile of N rows (fan_out) x K cols (fan_in) with the widest swizzle K fills; the
    images sit back to back, each on a 1024-byte boundary.
    """

    def __init__(self, spec: MLPSpec, smem_limit: int = WGMMA_SMEM_LIMIT, warpgroups: int | None = None,
                 stages: int | None = None, half_warpgroups: int | None = None, half_stages: int | None = None,
                 training: bool = False):
        if spec.precision != "fp16":
            raise SpecError("precision", f"the cuda wgmma variant computes in fp16; got {spec.precision!r}")
        if warpgroups not in (None, 1, 2):
            raise SpecError("warpgroups", f"the wgmma kernel runs 1 or 2 warpgroups per block; got {warpgroups!r}")
        if stages not in (None, 0, 1, 2):
            raise SpecError("stages", f"the wgmma kernel prefetches 0, 1 or 2 input tiles per warpgroup; got {stages!r}")
        self.spec = spec
        self.nin = spec.n_encoded_dims
        self.kin_p = next_pow2(self.nin, 16)
        self.wp = next_pow2(spec.n_neurons, 16)
        # the training module's output layer has at least 16 rows: the backward's k16 steps read
        # 16 rows of W_out (a forward needs 8)
        self.training = training
        self.nout_p = next_pow2(spec.n_output_dims, 16 if training else 8)
        self.n_hidden = spec.n_hidden_layers
        self.swz_in, self.swz_w = kmajor_swizzle(self.kin_p), kmajor_swizzle(self.wp)
        # (fan_in, fan_out, K, N, swizzle bytes, byte offset in the image) per layer
        self.layers = []
        offset = 0
        for i, (fan_in, fan_out) in enumerate(spec.layer_dims):
            k = self.kin_p if i == 0 else self.wp
            n = self.nout_p if i == self.n_hidden else self.wp
            self.layers.append((fan_in, fan_out, k, n, kmajor_swizzle(k), offset))
            offset = _align(offset + n * k * 2)
        self.w_total_bytes = offset
        self.b_offsets = [i * self.wp for i in range(self.n_hidden)] + [self.n_hidden * self.wp]
        self.b_total = self.n_hidden * self.wp + self.nout_p
        self._plan_shared_memory(smem_limit, warpgroups, stages)
        if training:
            self._plan_half(smem_limit, 0, 0)
            self._plan_training(smem_limit)
        else:
            self._plan_half(smem_limit, half_warpgroups, half_stages)
        self.source = self._source()

    def _plan_shared_memory(self, limit: int, warpgroups: int | None, stages: int | None) -> None:
        """The first that fits of: resident weights shared by two warpgroups (each with its own
        input tile, and two, one or no next tiles prefetched), by one warpgroup, then one layer's
        weights at a time (one warpgroup: the stage is refilled for every layer of every tile).

        Two prefetched tiles per warpgroup because the forward waits on memory latency (Nsight
        Compute on the H100: DRAM at 61-69% of its peak, no eligible warp in 64-68% of the
        cycles with one 64-row input tile in flight per warpgroup); only where two blocks still
        fit on an SM, since losing the second block costs more than the prefetch gains (M: -12%,
        S: +5%).
        """
        self.a_bytes = _align(WGMMA_TILE_ROWS * self.kin_p * 2)
        self.x_bytes = _align(WGMMA_TILE_ROWS * self.nin * 4)
        b_bytes = _align(self.b_total * 4)
        stage = max(_align(n * k * 2) for _, _, k, n, _, _ in self.layers)
        # (weights resident, warpgroups, prefetched input tiles per warpgroup); streamed weights
        # wait for all copies per layer, so a second prefetched tile would not stay in flight there
        choices = [(True, wgs, x) for wgs in (2, 1) for x in (2, 1, 0)]
        choices += [(False, 1, 1), (False, 1, 0)]
        tried = []
        for resident, wgs, x_stages in choices:
            if warpgroups is not None and wgs != warpgroups:
                continue
            if stages is not None and x_stages not in (0, stages):
                continue
            w_bytes = self.w_total_bytes if resident else stage
            total = w_bytes + wgs * self.a_bytes + b_bytes + wgs * x_stages * self.x_bytes + WGMMA_ALIGN
            tried.append(total)
            if x_stages == 2 and stages is None and 2 * (total + 1024) > WGMMA_SMEM_PER_SM:
                continue  # the second ring tile would cost a resident block
            if total <= limit:
                self.w_resident, self.warpgroups, self.input_staged = resident, wgs, x_stages > 0
                self.x_stages = max(x_stages, 1)
                self.sm_a_off = w_bytes
                self.sm_b_off = w_bytes + wgs * self.a_bytes
                self.sm_x_off = self.sm_b_off + b_bytes
                self.smem_bytes = total
                return
        raise SpecError("network.n_neurons",
                        f"the cuda wgmma variant needs {min(tried)} bytes of shared memory for this model "
                        f"({warpgroups or 'any number of'} warpgroups); the limit is {limit}")

    def _plan_half(self, limit: int, warpgroups: int | None, stages: int | None) -> None:
        """The fp16-I/O kernel's plan: resident weights, biases, then per warpgroup a ring of
        input A tiles (cp.async puts each fp16 input tile where layer 0 reads it). Where the
        weights are not resident in the fp32 plan the fp16 kernel is not built (``half_io``
        False: fp16 forwards convert around the fp32 kernel).

        The default aims at 6 warpgroups an SM, then at 2 tiles a ring (one in flight while one
        computes), then at 2 warpgroups a block: the best of the 16 (warpgroups, ring) pairs
        measured on M at 2^20 rows, within 2-5 % of the best on S and L; MIN_BLOCKS_H asks ptxas for registers that let that many blocks
        stay resident.
        """
        self.half_io = self.w_resident and warpgroups != 0
        if not self.half_io:
            self.half_warpgroups = self.half_stages = self.half_min_blocks = 0
            self.smh_b_off = self.smh_ring_off = self.smem_half_bytes = 0
            return
        b_bytes = _align(self.b_total * 4)
        # registers a thread needs, about: the accumulators, the next layer's A registers, ~32 more
        regs = self.wp // 2 + self.wp // 4 + 32
        best = None
        for wgs in (warpgroups,) if warpgroups else (1, 2, 3, 4):
            for ring in (stages,) if stages else (1, 2, 3, 4):
                total = self.w_total_bytes + b_bytes + wgs * ring * self.a_bytes + WGMMA_ALIGN
                if total > limit or WGMMA_THREADS * wgs * regs > WGMMA_REGS_PER_SM:
                    continue
                blocks = min(WGMMA_SMEM_PER_SM // (total + 1024), 16 // wgs,
                             WGMMA_REGS_PER_SM // (WGMMA_THREADS * wgs * regs))
                key = (min(blocks * wgs, 6), min(ring, 2), -abs(wgs - 2))
                if best is None or key > best[0]:
                    best = (key, wgs, ring, blocks, total)
        if best is None:
            raise SpecError("network.n_neurons",
                            f"the cuda wgmma variant's fp16 forward does not fit {limit} bytes of shared memory "
                            f"with {warpgroups or 'any number of'} warpgroups and {stages or 'any number of'} "
                            f"input tiles a warpgroup")
        _, self.half_warpgroups, self.half_stages, blocks, self.smem_half_bytes = best
        self.half_min_blocks = max(1, min(blocks, 6 // self.half_warpgroups))
        self.smh_b_off = self.w_total_bytes
        self.smh_ring_off = self.w_total_bytes + b_bytes

    def _plan_training(self, limit: int) -> None:
        """The training kernel's plan: resident weights (the backward reads them transposed),
        biases and each warpgroup's input tile; one or two warpgroups a block, whichever keeps
        more (at most 4) resident on an SM, then 2: S and M 2 x 2 blocks, L 2 x 1 (its weights take
        160 KiB; 3 x 1 fits and measured slower, 263 against 277 M samples/s a step);
        ``trains`` False (with ``why_not``) where the weights do not fit shared memory. The
        weight-gradient kernels' N (fan_in padded to 64: their operands are 128-byte-swizzled
        64-column blocks) and ring depth."""
        b_bytes = _align(self.b_total * 4)
        self.trains, self.why_not = False, ""
        self.train_warpgroups = self.train_min_blocks = self.smt_b_off = self.smt_a_off = self.smem_train_bytes = 0
        # registers a thread needs, about: the accumulators, a layer's A registers, ~48 more
        regs = self.wp // 2 + self.wp // 4 + 48
        best = None
        for wgs in (1, 2):
            total = self.w_total_bytes + b_bytes + wgs * self.a_bytes + WGMMA_ALIGN
            if total > limit or WGMMA_THREADS * wgs * regs > WGMMA_REGS_PER_SM:
                continue
            blocks = min(WGMMA_SMEM_PER_SM // (total + 1024), WGMMA_REGS_PER_SM // (WGMMA_THREADS * wgs * regs),
                         16 // wgs)
            key = (min(blocks * wgs, 4), -abs(wgs - 2))
            if best is None or key > best[0]:
                best = (key, wgs, blocks, total)
        if best is None:
            self.why_not = (f"the cuda wgmma variant's training keeps every layer's weights in shared memory: "
                            f"{self.w_total_bytes + b_bytes + self.a_bytes + WGMMA_ALIGN} bytes for this model, "
                            f"the limit is {limit} (the wgmma+mma and wgmma+cublaslt variants train it with "
                            f"their kernels)")
        else:
            _, self.train_warpgroups, blocks, self.smem_train_bytes = best
            self.trains = True
            self.train_min_blocks = max(1, min(blocks, 4 // self.train_warpgroups))
            self.smt_b_off, self.smt_a_off = self.w_total_bytes, self.w_total_bytes + b_bytes
        self.mma_k_in, self.mma_nout_pad = _pad16(self.nin), _pad16(self.spec.n_output_dims)
        self.wgrad_kp = [_align(_pad16(fan_in), 64) for fan_in, _ in self.spec.layer_dims[:2]]
        self.wgrad_stages = WGRAD_STAGES

    def wgrad_smem_bytes(self, layer: int) -> int:
        """Dynamic shared memory of the weight-gradient kernel of ``layer``: the ring of stages
        (64 delta rows x 64 columns, 64 h rows x N) and the alignment slack."""
        kp = self.wgrad_kp[0 if layer == 0 else 1]
        return self.wgrad_stages * (WGRAD_STAGE_ROWS * 128 + kp * 128) + WGMMA_ALIGN

    def smem_layouts(self) -> list[L.LinearLayout]:
        """Each layer's weight image: offset (halves) -> (row = n, col = k)."""
        return [L.wgmma_smem_operand(n, k, "K", swz) for _, _, k, n, swz, _ in self.layers]

    def descriptors(self, i: int) -> list[L.WgmmaDescriptor]:
        """The B descriptors (one per k16 step) of layer i, relative to the layer's image."""
        _, _, k, n, swz, _ = self.layers[i]
        return [L.wgmma_smem_descriptor(n, k, "K", swz, col0=16 * s) for s in range(k // 16)]

    def weight_map(self, w_off: list[int], k_master: list[int]) -> np.ndarray:
        """Image half -> index into the fp32 master ``w_all`` (-1: zero padding).

        ``w_off[i]`` is layer i's start in ``w_all`` and ``k_master[i]`` its row length there.
        """
        image = np.full(self.w_total_bytes // 2, -1, dtype=np.int32)
        for i, ((fan_in, fan_out, k, n, _, offset), layout) in enumerate(zip(self.layers, self.smem_layouts())):
            source = np.full((n, k), -1, dtype=np.int32)
            rows, cols = np.meshgrid(np.arange(fan_out), np.arange(fan_in), indexing="ij")
            source[:fan_out, :fan_in] = w_off[i] + rows * k_master[i] + cols
            image[offset // 2: offset // 2 + n * k] = L.pack(source, layout)
        return image

    def bias_map(self, b_off: list[int]) -> np.ndarray:
        """Bias image float -> index into the fp32 master ``b_all`` (-1: zero padding)."""
        image = np.full(self.b_total, -1, dtype=np.int32)
        for i, (_, fan_out, _, _, _, _) in enumerate(self.layers):
            image[self.b_offsets[i]: self.b_offsets[i] + fan_out] = b_off[i] + np.arange(fan_out)
        return image

    def _wrappers(self) -> str:
        """The wgmma instructions the kernel issues, as inline-PTX functions (N/2 accumulators)."""

        def wrapper(name: str, n: int, a_from_registers: bool, transposed: bool = False) -> str:
            nd = n // 2
            outs = ", ".join(f'"+f"(d[{i}])' for i in range(nd))
            regs = ", ".join(f"%{i}" for i in range(nd))
            trans = int(transposed)  # MN-major operands from shared memory (B; A too where in shared memory)
            if a_from_registers:
                a_ops, b, p = f"{{%{nd}, %{nd + 1}, %{nd + 2}, %{nd + 3}}}", nd + 4, nd + 5
                ins = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)'
                sig, imm = "float* d, const u32* a, unsigned long long desc_b, int scale_d", f"1, 1, {trans}"
            else:
                a_ops, b, p = f"%{nd}", nd + 1, nd + 2
                ins = '"l"(desc_a), "l"(desc_b), "r"(scale_d)'
                sig = "float* d, unsigned long long desc_a, unsigned long long desc_b, int scale_d"
                imm = f"1, 1, {trans}, {trans}"
            return (f"__device__ __forceinline__ void {name}({sig}) {{\n"
                    f'    asm volatile("{{.reg .pred p; setp.ne.b32 p, %{p}, 0;\\n"\n'
                    f'                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{regs}}}, {a_ops}, %{b}, p, {imm};}}"\n'
                    f"                 : {outs}\n"
                    f"                 : {ins} : \"memory\");\n}}\n")

        text = (wrapper("wgmma_ss_n_hidden", self.wp, False) + wrapper("wgmma_rs_n_hidden", self.wp, True)
                + wrapper("wgmma_rs_n_out", self.nout_p, True))
        if self.training:
            # the backward (W read transposed) and the weight gradients (both operands MN-major)
            text += wrapper("wgmma_rs_n_hidden_t", self.wp, True, transposed=True)
            text += "template <int KP> __device__ void wgmma_tt_wgrad(float* d, unsigned long long a, unsigned long long b);\n"
            for kp in sorted(set(self.wgrad_kp)):
                text += wrapper(f"wgmma_tt_n{kp}", kp, False, transposed=True)
                text += (f"template <> __device__ __forceinline__ void wgmma_tt_wgrad<{kp}>(float* d, unsigned long long a, "
                         f"unsigned long long b) {{ wgmma_tt_n{kp}(d, a, b, 1); }}\n")
        return text

    def _source(self, loss: str | None = None) -> str:
        """The kernels' source; ``loss``: the LOSS macro instead of the spec's (``LOSS_GIVEN``:
        the training kernel takes d loss / d output as its target, for ``backward``)."""
        s = self.spec
        defines = {
            "NIN": self.nin, "KIN_P": self.kin_p, "SWZ_IN": self.swz_in, "WP": self.wp, "SWZ_W": self.swz_w,
            "NHID": self.n_hidden, "NOUT": s.n_output_dims, "NOUT_P": self.nout_p,
            "ACT": ACTIVATION_CODES[s.activation], "OUT_ACT": ACTIVATION_CODES[s.output_activation],
            "LOSS": loss or LOSS_CODES[s.loss], "HUBER_DELTA": f32_literal(s.huber_delta),
            "W_RESIDENT": int(self.w_resident), "INPUT_STAGED": int(self.input_staged), "WGS": self.warpgroups,
            "W_BYTES0": self.layers[0][2] * self.layers[0][3] * 2,
            "W_OFF1": self.layers[1][5] if self.n_hidden > 1 else 0,
            "W_HID_STRIDE": _align(self.wp * self.wp * 2),
            "W_OFF_OUT": self.layers[-1][5], "W_TOTAL_BYTES": self.w_total_bytes, "B_TOTAL": self.b_total,
            "SM_A_OFF": self.sm_a_off, "A_BYTES": self.a_bytes, "SM_B_OFF": self.sm_b_off,
            "SM_X_OFF": self.sm_x_off, "X_BYTES": self.x_bytes, "X_STAGES": self.x_stages,
            "MIN_BLOCKS": 1,
            "HALF_IO": int(self.half_io), "WGH": max(self.half_warpgroups, 1), "H_STAGES": max(self.half_stages, 1),
            "MIN_BLOCKS_H": max(self.half_min_blocks, 1), "SMH_B_OFF": self.smh_b_off,
            "SMH_RING_OFF": self.smh_ring_off,
        }
        if self.training:
            defines.update({
                "TRAIN_MODULE": 1, "KIN": self.mma_k_in, "WIDTH": s.n_neurons, "NOUT_PAD": self.mma_nout_pad,
                "STORE_DACT": int(s.activation not in DERIVATIVE_FROM_OUTPUT), "WGT": max(self.train_warpgroups, 1),
                "MIN_BLOCKS_T": max(self.train_min_blocks, 1), "SMT_B_OFF": self.smt_b_off, "SMT_A_OFF": self.smt_a_off,
                "WG_KP0": self.wgrad_kp[0], "WG_KPW": self.wgrad_kp[-1], "WG_STAGES": self.wgrad_stages,
            })
        head = kernel_code_defines() + "".join(f"#define {k} {v}\n" for k, v in defines.items())
        return (head + read_source("cuda/mlp_common.cuh") + read_source("cuda/wgmma_layout.cuh")
                + self._wrappers() + read_source("cuda/mlp_wgmma.cu")
                + (read_source("cuda/mlp_wgmma_train.cu") if self.training else ""))


class CudaWgmmaModel(CudaMmaModel):
    """The wgmma forward kernels on the mma model's fp32 parameters, and (``wgmma_training``,
    the ``wgmma`` variant) the wgmma training step; without it (``wgmma+mma``) training runs the
    mma variant's kernels.

    The fp16 weight images and fp32 bias images the kernels copy into shared memory are
    gathered on the device from the fp32 masters (``wgmma_pack``, through maps built on the
    host): the forward's whenever the parameters changed since the last forward, the training
    module's (its output layer padded to 16 rows) at the start of every step. A training step
    is ``wgmma_train_fwd_bwd`` (forward, loss, backward; each layer's h and delta to the mma
    variant's buffers), ``wgmma_wgrad_*`` per layer (partial sums per chunk of rows) and the mma
    variant's ``mlp_optimize`` (the chunks added in a fixed order, the optimizer step).
    """

    supports_ema = False  # its forward reads its own image of the masters, not of an EMA average

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None,
                 knobs: CudaKnobs | None = None, wgmma_training: bool = True):
        knobs = knobs or CudaKnobs.from_env()
        self.wg = WgmmaPlan(spec, smem_limit=info["smem_optin"], warpgroups=knobs.wgmma_warpgroups,
                            stages=knobs.wgmma_stages, half_warpgroups=knobs.wgmma_half_warpgroups,
                            half_stages=knobs.wgmma_half_stages)
        self.wgmma_training = wgmma_training
        if wgmma_training:
            self.wt = WgmmaPlan(spec, smem_limit=info["smem_optin"], training=True)
            if not self.wt.trains:
                raise SpecError("network.n_neurons", self.wt.why_not)
        self._wg_stale = True
        variant = "wgmma" if wgmma_training else "wgmma+mma"
        self.variant = variant  # first: the constructor's refusals name it
        super().__init__(spec, cp, info, cache, knobs)
        self.variant = variant  # CudaMmaModel's constructor names its own
        self._wg_module = self._build_wgmma(cache)
        if wgmma_training:
            self._wt_module = self._build_training(cache)
        try:
            k_master = [k for _, _, k, _ in self.layers]
            self.wg_wmap = cp.asarray(self.wg.weight_map(self.w_off, k_master))
            self.wg_bmap = cp.asarray(self.wg.bias_map(self.b_off))
            self.wg_wimage = cp.zeros(self.wg.w_total_bytes // 2, dtype=cp.uint16)
            self.wg_bimage = cp.zeros(self.wg.b_total, dtype=cp.float32)
            if wgmma_training:
                self.wt_wmap = cp.asarray(self.wt.weight_map(self.w_off, k_master))
                self.wt_bmap = cp.asarray(self.wt.bias_map(self.b_off))
                self.wt_wimage = cp.zeros(self.wt.w_total_bytes // 2, dtype=cp.uint16)
                self.wt_bimage = cp.zeros(self.wt.b_total, dtype=cp.float32)
        except device_errors(cp) as exc:
            raise LaunchError(f"allocating the wgmma weight images failed: {exc}") from exc

    def _build(self, cache: KernelCache | None) -> LoadedModule:
        """The mma variant's module, the same source as ``mma``'s and ``wgmma+mma``'s (compiled
        once for the three); the wgmma training writes every layer's h and delta to the mma
        workspace for its weight gradients, so it leaves the fused training kernels unused."""
        module = super()._build(cache)
        if self.wgmma_training:
            self.fused_wgrad = False
        return module

    def _nvcc_module(self, cache: KernelCache | None, source: str, names: tuple[str, ...], what: str) -> LoadedModule:
        """``source`` built by nvcc for sm_90a (or from the kernel cache) and loaded."""
        nvcc = find_nvcc()
        compiler = f"nvcc-{nvcc_version(nvcc)}" if nvcc else "nvcc-missing"
        cubin = cached_cubin(cache, lambda: nvcc_compile(source, WGMMA_NVCC_OPTIONS, what), backend="cuda-wgmma",
                             device="sm_90a", compiler=compiler, options=WGMMA_NVCC_OPTIONS, source=source)
        try:
            return LoadedModule(self.cp, cubin, names)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"loading the compiled {what} failed: {exc}") from exc

    def _build_wgmma(self, cache: KernelCache | None) -> LoadedModule:
        what = f"wgmma kernels for model {self.spec.content_hash()} ({describe(self.spec)})"
        names = WGMMA_KERNELS if self.wg.half_io else tuple(k for k in WGMMA_KERNELS if k != "wgmma_forward_half")
        module = self._nvcc_module(cache, self.wg.source, names, what)
        self.wg_grid = self._resident_grid(module.kernel("wgmma_forward"), self.wg.warpgroups, self.wg.smem_bytes, what)
        if self.wg.half_io:
            self.wg_grid_half = self._resident_grid(module.kernel("wgmma_forward_half"), self.wg.half_warpgroups,
                                                    self.wg.smem_half_bytes, what)
        return module

    def _build_training(self, cache: KernelCache | None, loss: str | None = None) -> LoadedModule:
        """The wgmma training module (``loss``: ``LOSS_GIVEN`` for ``backward``'s)."""
        what = f"wgmma training kernels for model {self.spec.content_hash()} ({describe(self.spec)})"
        source = self.wt.source if loss is None else self.wt._source(loss)
        module = self._nvcc_module(cache, source, WGMMA_TRAIN_KERNELS, what)
        for i, name in enumerate(("wgmma_wgrad_in", "wgmma_wgrad_hid")):
            smem = self.wt.wgrad_smem_bytes(i)
            try:
                if smem > 48 * 1024:
                    module.kernel(name).max_dynamic_shared_size_bytes = smem
            except device_errors(self.cp) as exc:
                raise LaunchError(f"loading the compiled {what} failed: {exc}") from exc
        self.wt_grid = self._resident_grid(module.kernel("wgmma_train_fwd_bwd"), self.wt.train_warpgroups,
                                           self.wt.smem_train_bytes, what)
        self._resident_grid(module.kernel("wgmma_train_fwd_bwd_rows"), self.wt.train_warpgroups,
                            self.wt.smem_train_bytes, what)
        return module

    def _resident_grid(self, kernel, warpgroups: int, smem: int, what: str) -> int:
        """The kernel allowed ``smem`` bytes of dynamic shared memory; the blocks of it that stay
        resident on every SM at once (registers, shared memory, threads)."""
        try:
            if smem > 48 * 1024:
                kernel.max_dynamic_shared_size_bytes = smem
        except device_errors(self.cp) as exc:
            raise LaunchError(f"loading the compiled {what} failed: {exc}") from exc
        threads = WGMMA_THREADS * warpgroups
        regs_per_block = math.ceil(max(int(kernel.num_regs), 1) * 32 / 256) * 256 * (threads // 32)
        per_sm = min(self.info["regs_per_sm"] // regs_per_block, self.info["smem_per_sm"] // (smem + 1024),
                     2048 // threads)
        return max(1, per_sm) * self.info["sm_count"]

    def _launch_wgmma(self, name: str, grid, block, args, smem: int = 0) -> None:
        self._launch_from(self._wg_module, name, grid, block, args, smem)

    def _refresh_images(self) -> None:
        if not self._wg_stale:
            return
        n, n_b = self.wg_wimage.size, self.wg_bimage.size
        self._launch_wgmma("wgmma_pack", (math.ceil(max(n, n_b) / 256),), (256,),
                           (self.w_all, self.wg_wmap, self.wg_wimage, np.int32(n), self.b_all, self.wg_bmap,
                            self.wg_bimage, np.int32(n_b)))
        self._wg_stale = False

    def forward(self, x: Any, out_dtype: Any = np.float32, into: Any = None) -> Any:
        """fp16 device inputs with fp16 outputs run ``wgmma_forward_half`` (fp16 read and
        written) where the plan has it; otherwise fp32 in and out in the kernel, ``out_dtype``
        float16 casting the result. ``into``: see ``CudaMmaModel.forward``."""
        half_out = self._half_out(out_dtype)
        dx, from_host = self._device_input(x, self.spec.n_input_dims, "input", encode=True,
                                           keep_half=half_out and self.wg.half_io)
        out = self._forward_encoded(dx, half_out, (), into)
        return self.download(out) if from_host and out is not into else out

    def _forward_encoded(self, dx: Any, half_out: bool, weights: tuple[Any, Any], into: Any = None) -> Any:
        """The wgmma forward of the encoded input ``dx``; its images are gathered from the fp32
        masters (the training weights: no EMA here), so ``weights`` is not read."""
        cp = self.cp
        rows = dx.shape[0]
        half_io = half_out and dx.dtype == cp.float16
        kernel_out = into if into is not None and (into.dtype == cp.float16) == half_io else None
        out = kernel_out if kernel_out is not None else cp.empty(
            (rows, self.spec.n_output_dims), dtype=cp.float16 if half_io else cp.float32)
        if rows:
            if dx.data.ptr % 16:  # cp.async moves 16-byte units: a view at an odd offset is copied
                dx = dx.copy()
            self._refresh_images()
            n_tiles = math.ceil(rows / WGMMA_TILE_ROWS)
            if half_io:
                wgs, grid, name, smem = self.wg.half_warpgroups, self.wg_grid_half, "wgmma_forward_half", \
                    self.wg.smem_half_bytes
            else:
                wgs, grid, name, smem = self.wg.warpgroups, self.wg_grid, "wgmma_forward", self.wg.smem_bytes
            blocks = min(grid, math.ceil(n_tiles / wgs))
            self._launch_wgmma(name, (blocks,), (WGMMA_THREADS * wgs,),
                               (dx, np.int64(rows), np.int64(n_tiles), out, self.wg_wimage, self.wg_bimage), smem)
        if half_out and not half_io:
            out = out.astype(cp.float16)
        if into is not None and out is not into:
            into[...] = out
            return into
        return out

    # -- training on wgmma (the wgmma variant) ----------------------------------------------------
    def _loss_slot_count(self) -> int:
        if not self.wgmma_training:
            return super()._loss_slot_count()
        return self.wt_grid * self.wt.train_warpgroups * 4  # a slot per warp of every resident block

    def _wgrad_chunks(self, rows_pad: int, k: int, n: int) -> tuple[int, int]:
        """wgmma_wgrad_*: a block per 64 rows of dW and chunk of batch rows (64-row stages),
        about two blocks an SM."""
        if not self.wgmma_training:
            return super()._wgrad_chunks(rows_pad, k, n)
        tiles = math.ceil(n / 64)
        n_chunks = max(1, min(rows_pad // WGRAD_STAGE_ROWS, math.ceil(2 * self.info["sm_count"] / tiles)))
        chunk_rows = math.ceil(rows_pad / n_chunks / WGRAD_STAGE_ROWS) * WGRAD_STAGE_ROWS
        return math.ceil(rows_pad / chunk_rows), chunk_rows

    def _forward_backward(self, dx, dy, rows: int, row_map: Any = None,
                          mean_over: int | None = None, given: bool = False) -> tuple[dict[str, Any], Any]:
        if not self.wgmma_training:
            return super()._forward_backward(dx, dy, rows, row_map, mean_over, given)
        rows_pad = self._rows_padded(rows)
        ws = self._workspace_for(rows_pad)
        if given:  # d loss / d output as the target: the LOSS_GIVEN module, built on the first backward
            if getattr(self, "_wt_given", None) is None:
                self._wt_given = self._build_training(self._cache, "LOSS_GIVEN")
            module, grad_scale = self._wt_given, np.float32(self.spec.loss_scale)
        else:
            module = self._wt_module
            grad_scale = np.float32(self.spec.loss_scale / ((mean_over or rows) * self.spec.n_output_dims))
        n, n_b = self.wt_wimage.size, self.wt_bimage.size
        self._launch_from(module, "wgmma_pack", (math.ceil(max(n, n_b) / 256),), (256,),
                          (self.w_all, self.wt_wmap, self.wt_wimage, np.int32(n), self.b_all, self.wt_bmap,
                           self.wt_bimage, np.int32(n_b)))
        n_tiles = rows_pad // WGMMA_TILE_ROWS
        wgs = self.wt.train_warpgroups
        blocks = max(1, min(self.wt_grid, math.ceil(n_tiles / wgs)))
        loss_slots = ws["loss"][: blocks * wgs * 4]
        h, d, dact = (ws[name].view(self.cp.uint16) for name in ("h", "d", "dact"))
        self._launch_from(module, "wgmma_train_fwd_bwd" if row_map is None else "wgmma_train_fwd_bwd_rows",
                          (blocks,), (WGMMA_THREADS * wgs,),
                          (dx, np.int64(rows), np.int64(n_tiles), self.wt_wimage, self.wt_bimage, dy, grad_scale,
                           h, d, dact, loss_slots) + (() if row_map is None else (row_map,)),
                          self.wt.smem_train_bytes)
        ws["rows_pad"] = rows_pad
        return ws, loss_slots

    def _layer_grads(self, ws: dict[str, Any], i: int) -> tuple[int, Any, Any]:
        if not self.wgmma_training:
            return super()._layer_grads(ws, i)
        rows_pad = ws["rows_pad"]
        _, _, k, n = self.layers[i]
        n_chunks, chunk_rows = ws["chunks"][i]
        h, d, pw, pb = self._wgrad_operands(ws, i)
        self._launch_from(self._wt_module, "wgmma_wgrad_in" if i == 0 else "wgmma_wgrad_hid",
                          (n_chunks, math.ceil(n / 64)), (WGMMA_THREADS,),
                          (d, np.int32(n), h, np.int32(k), np.int64(chunk_rows), np.int64(rows_pad), pw, pb),
                          self.wt.wgrad_smem_bytes(i))
        return n_chunks, pw, pb

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        super().set_params(params)
        self._wg_stale = True

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        self._wg_stale = True  # set first: a step that fails half way may have changed weights
        return super().train_step(x, y, steps)

    def train_epochs(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> np.ndarray:
        self._wg_stale = True
        return super().train_epochs(data, batch, steps, position)

    def parallel_start(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> Any:
        self._wg_stale = True  # the run's parallel_apply steps change the masters
        return super().parallel_start(data, batch, steps, position)

    def load_device_params(self, weights: list[Any], biases: list[Any]) -> None:
        self._wg_stale = True
        super().load_device_params(weights, biases)

    _IMAGES = ("wg_wmap", "wg_bmap", "wg_wimage", "wg_bimage", "wt_wmap", "wt_bmap", "wt_wimage", "wt_bimage")

    def device_bytes(self) -> int:
        return super().device_bytes() + int(sum(getattr(self, a).nbytes for a in self._IMAGES if hasattr(self, a)))

    def close(self) -> None:
        super().close()
        for name in self._IMAGES:
            if hasattr(self, name):
                delattr(self, name)


