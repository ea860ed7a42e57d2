"""The ``mma`` variant: fused MLP kernels on mma.sync.m16n8k16 (fp16 in, fp32 accumulate).

``mmad/shaders/cuda/mlp_mma.cu``; compute capability 8.0 or newer, hidden widths 16-256 (the
default variant for every model). One kernel runs the whole forward pass with activations
chained in registers. A training step is one fused forward + loss + backward kernel; where the
weight gradients fit in registers (ReLU family, weights in shared memory: S and M),
``mlp_train_fused`` accumulates them inside it from a shared-memory stash of each layer's
input; otherwise per-layer activations and deltas go to memory once and a weight-gradient
kernel per layer runs mma over fixed row chunks (deterministic). A reduction + optimizer kernel
per layer sums the partials in a fixed order, updates the fp32 masters and refreshes the packed
fp16 weight images the kernels read.

Training steps take no host round trip: the learning rate of each step comes from a device
table and the step count that indexes it, the loss goes to a device array, and a step's
launches (with ``train_epochs``, the gather of the next batch of the epoch's order first) are
the same every step, so they are captured once as a CUDA graph and replayed. The host reads
the losses once per call.

Kernels are specialised per model (widths, depth, activations, loss, optimizer constants as
``#define``s), compiled by NVRTC and kept in the kernel cache.
"""

from __future__ import annotations

import contextlib
import math
import threading
from functools import partial
from typing import Any

import numpy as np

from mmad.backends.cache import KernelCache
from mmad.backends.contract import (
    Dataset, EpochPosition, check_epoch_run, check_params, init_params, optimizer_slots,
)
from mmad.backends.numerics import ema_factor_table, epoch_half_bits
from mmad.backends.cuda.knobs import CudaKnobs
from mmad.backends.cuda.toolchain import (
    CudaModel, LoadedModule, TableUploads, cached_cubin, device_errors, in_background, nvrtc_compile, nvrtc_version,
)
from mmad.errors import InvalidInput, LaunchError, SpecError
from mmad.shaders import read_source
from mmad.spec import ACTIVATION_CODES, LOSS_CODES, MLPSpec, kernel_code_defines

MMA_MAX_WIDTH = 256  # wider than 256 would not fit the fused kernels' registers
WARPS_PER_BLOCK = 4  # warps per block of the mma kernels (2-16 measured within 12%)
FUSED_WARPS, FUSED_ROWS = 8, 128  # mlp_train_fused: warps per block, rows per super-tile (FW, SUPER_ROWS)
FUSED_MAX_ACC = 96  # fp32 weight-gradient accumulators per thread the fused kernel may hold
# up to this many accumulators per thread, and where its shared memory fits twice, two fused blocks
# share an SM (at most 128 registers a thread): H100, 2^20 rows, S (32 accumulators) trains at
# 2,540-2,633 M samples/s with two against 2,281-2,357 with one, though ptxas then spills 36 bytes;
# M (80) spills ~800 bytes at 128 registers
FUSED_TWO_BLOCKS_MAX_ACC = 32
WGRAD_ROWS = 32  # rows per step of the weight-gradient kernel (its chunks are multiples)
SMEM_WEIGHTS_LIMIT = 100 * 1024  # weights go through shared memory when they fit twice per SM
FUSED_SMEM_LIMIT = 227 * 1024  # sm_80 / sm_90 opt-in limit per block
SMEM_PER_SM = 228 * 1024  # sm_80 / sm_90 shared memory per SM, of which each resident block reserves 1 KiB
NVRTC_OPTIONS = ("-std=c++17",)

# the serving module's kernels (mlp_mma.cu's SERVE_KERNELS): the forwards of a plain input, or of
# an input encoded on the device; the group forwards where they apply; the optimizer kernel (the
# parameters' repack into the fp16 images) and tiny-cuda-nn's parameter loader
PLAIN_FORWARD_KERNELS = ("mlp_forward", "mlp_forward_half")
PAIRS_KERNELS = ("mlp_forward_pairs", "mlp_forward_pairs_half")
GROUP_KERNELS = ("mlp_forward_group", "mlp_forward_half_group")  # plain inputs, widths <= GROUP_MAX_WIDTH
SERVE_COMMON_KERNELS = ("mlp_optimize", "mlp_load_tcnn")
# the training module's kernels (TRAIN_KERNELS), compiled on a thread of their own while the model serves
TRAIN_KERNELS = ("mlp_train_fwd_bwd", "mlp_train_fwd_bwd_rows", "mlp_wgrad", "mlp_gather_batch", "mlp_batch_rows",
                 "mlp_finish_step")
FUSED_KERNELS = ("mlp_train_fused", "mlp_train_fused_rows")  # where the fused plan applies
GROUP_MAX_WIDTH = 128  # the 256-wide forward holds 254 registers: a group's per-tile pointers would spill
CTL_STEP, CTL_CURSOR, CTL_EPOCH, CTL_SEED = range(4)  # the device control block (mlp_mma.cu)
GATHER_WARPS = 8  # warps per block of mlp_gather_batch (a warp per row)
FINISH_THREADS = 256  # mlp_finish_step's block
GRAPH_MIN_STEPS = 3  # fewer steps than this launch directly (capturing costs about what it saves)
KEPT_GRAPHS = 8  # captured steps kept per model (keyed by the buffers they read)
# activations whose derivative follows from the stored fp16 output (no extra buffer)
DERIVATIVE_FROM_OUTPUT = ("None", "ReLU", "LeakyReLU")


def f32_literal(v: float) -> str:
    """A float as the CUDA fp32 literal of its fp32 value."""
    return f"{float(np.float32(v))!r}f"


def optimizer_defines(spec: MLPSpec) -> dict[str, Any]:
    """The optimizer's constants as the kernels' ``#define``s (mma and element-wise kernels)."""
    opt = spec.optimizer
    return {"OPT_ADAM": int(opt.otype == "Adam"), "BETA1": f32_literal(opt.beta1), "BETA2": f32_literal(opt.beta2), "EPS": f32_literal(opt.epsilon),
            "L2REG": f32_literal(opt.l2_reg), "MOMENTUM": f32_literal(opt.momentum),
            "EMA": int(opt.ema is not None), "EMA_FULL": int(opt.ema is not None and opt.ema.full_precision)}


@contextlib.contextmanager
def stream_scope(cp, stream: Any):
    """CuPy's current stream for a block: ``stream`` (a ``cudaStream_t`` as an int, e.g. torch's
    current stream) where given, else whatever is current."""
    if stream is None:
        yield
        return
    with cp.cuda.ExternalStream(int(stream)):
        yield


def describe(spec: MLPSpec) -> str:
    return (f"{spec.n_encoded_dims}->{spec.n_neurons}x{spec.n_hidden_layers}->{spec.n_output_dims}, "
            f"{spec.activation}/{spec.output_activation}, {spec.loss}, {spec.optimizer.otype}")


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def b_image_index(k_dim: int, k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Where element (k, n) of a K x N B operand sits in its packed image (halves).

    Mirrors ``b_image_index`` in mlp_mma.cu: n-tile (8 columns) major, then k-chunk (16),
    then lane (g = n % 8, t = (k % 8) // 2 -> lane 4g + t), then the four halves b0 b1 b2 b3
    (b0 b1: k % 16 < 8, b2 b3: k % 16 >= 8; low/high half by k % 2).
    """
    k = np.asarray(k)
    n = np.asarray(n)
    kc, kk = k >> 4, k & 15
    hi, rr = kk >> 3, kk & 7
    lane = (n & 7) * 4 + (rr >> 1)
    return ((((n >> 3) * (k_dim >> 4) + kc) * 32 + lane) * 4 + hi * 2 + (rr & 1)).astype(np.int64)



def master_offsets(layers: list[tuple[int, int, int, int]]) -> tuple[list[int], list[int]]:
    """Where each layer's fp32 master W (n x k, row-major) and b (n) start in the mma model's
    flat ``w_all`` / ``b_all`` (layers as MmaPlan.layers: fan_in, fan_out, k, n)."""
    w_off, b_off, ow, ob = [], [], 0, 0
    for _, _, k, n in layers:
        w_off.append(ow)
        b_off.append(ob)
        ow += n * k
        ob += n
    return w_off, b_off


class MmaPlan:
    """Geometry and generated source of one spec's mma kernels (needs no GPU, no CuPy)."""

    # the input is an encoding made on the device (pair-major fp16, mlp_mma.cu's ENCODED_INPUT): the
    # training kernels read it and write d loss / d input (the encoding's backward reads it)
    encoded_input = False

    def __init__(self, spec: MLPSpec, knobs: CudaKnobs | None = None, forward_acc16: bool = False):
        knobs = knobs or CudaKnobs.from_env()
        if spec.precision != "fp16":
            raise SpecError("precision", f"the cuda mma variant computes in fp16; got {spec.precision!r}")
        if spec.n_neurons > MMA_MAX_WIDTH:
            raise SpecError("network.n_neurons",
                            f"the cuda mma variant supports widths up to {MMA_MAX_WIDTH}; got {spec.n_neurons}")
        self.spec = spec
        # the fp16-out forwards accumulate in fp16 (the mma-f16acc variant; mlp_mma.cu's FWD_ACC16)
        self.forward_acc16 = forward_acc16
        self.width = spec.n_neurons
        self.n_hidden = spec.n_hidden_layers
        self.k_in = pad16(spec.n_encoded_dims)
        self.n_out_pad = pad16(spec.n_output_dims)
        # (fan_in, fan_out, K padded, N padded) per layer
        self.layers = [(fi, fo, pad16(fi), pad16(fo)) for fi, fo in spec.layer_dims]
        self.n_layers = len(self.layers)
        self.wf_total = sum(k * n for _, _, k, n in self.layers)
        self.wb_total = sum(k * n for _, _, k, n in self.layers[1:])
        self.din_total = self.k_in * self.width if self.encoded_input else 0  # layer 0's backward image
        self.store_dact = spec.activation not in DERIVATIVE_FROM_OUTPUT
        self.smem_fwd = self.wf_total * 2
        self.smem_train = (self.wf_total + self.wb_total + self.din_total) * 2
        self.w_smem_fwd = self.smem_fwd <= SMEM_WEIGHTS_LIMIT
        self.w_smem_train = self.smem_train <= SMEM_WEIGHTS_LIMIT
        self.mt_fwd = 2 if self.width <= 64 else 1  # two 16-row tiles per warp share B loads
        # the fp16-out forwards' tiles: with fp16 accumulators (half the registers) more tiles share
        # each B load (H100, 2^20 rows: S 21,494 / 20,750 M samples/s at 4 / 2, L 1,802 / 1,633 at 2 / 1)
        self.mt_half = (4 if self.width <= 64 else 2 if self.width <= 128 else 1) if forward_acc16 else self.mt_fwd
        self.warps = WARPS_PER_BLOCK
        self.fused_wgrad, self.smem_fused, self.fused_min_blocks = self._fused_plan(knobs.fused_wgrad)
        # an encoded input's forwards come one request at a time (forward_group's fallback)
        self.group_forward = self.width <= GROUP_MAX_WIDTH and not self.encoded_input
        self.cuda_graphs = knobs.cuda_graphs
        self.serve_kernels = ((PAIRS_KERNELS if self.encoded_input else PLAIN_FORWARD_KERNELS)
                              + (GROUP_KERNELS if self.group_forward else ()) + SERVE_COMMON_KERNELS)
        self.train_kernels = TRAIN_KERNELS + (FUSED_KERNELS if self.fused_wgrad else ())
        self.serve_source = self._source(kernels="serve")
        self.train_source = self._source(kernels="train")

    def _fused_plan(self, wanted: bool) -> tuple[bool, int, int]:
        """Whether mlp_train_fused applies (weight gradients accumulated in the training kernel),
        its shared memory (the weights, a 128-row stash of every layer's input, a delta stage) and
        the blocks an SM its registers are bounded for (``FUSED_TWO_BLOCKS_MAX_ACC``). It needs the
        derivative from h (ReLU family), the weights in shared memory, and accumulators that fit in
        registers (each thread holds 1/256 of every dW)."""
        rows = FUSED_ROWS
        stash = sum(rows * (k + 8) for _, _, k, _ in self.layers)
        stage = rows * (max(self.width, self.n_out_pad) + 8)
        smem = (self.wf_total + self.wb_total + self.din_total + stash + stage) * 2
        units = [math.ceil((n // 16) * (k // 16) / FUSED_WARPS) for _, _, k, n in self.layers]
        acc = 8 * sum(units)  # two m16n8 fragments of 4 floats per 16 x 16 unit
        fits = not self.store_dact and self.w_smem_train and acc <= FUSED_MAX_ACC and smem <= FUSED_SMEM_LIMIT
        two_blocks = acc <= FUSED_TWO_BLOCKS_MAX_ACC and 2 * (smem + 1024) <= SMEM_PER_SM
        return wanted and fits, smem, 2 if two_blocks else 1

    def _source(self, loss: str | None = None, kernels: str = "train") -> str:
        """The source of the ``kernels`` set ("serve" or "train"); ``loss``: the LOSS macro instead
        of the spec's (``LOSS_GIVEN``: the training kernels take d loss / d output as their target,
        for ``backward``)."""
        s = self.spec
        defines = {
            "NIN": s.n_encoded_dims, "KIN": self.k_in, "WIDTH": self.width, "NHID": self.n_hidden,
            "NOUT": s.n_output_dims, "NOUT_PAD": self.n_out_pad,
            "ACT": ACTIVATION_CODES[s.activation], "OUT_ACT": ACTIVATION_CODES[s.output_activation],
            "LOSS": loss or LOSS_CODES[s.loss], "HUBER_DELTA": f32_literal(s.huber_delta),
            "MT_FWD": self.mt_fwd, "MT_HALF": self.mt_half, "MT_TRAIN": 1, "WARPS": self.warps,
            "W_SMEM_FWD": int(self.w_smem_fwd), "W_SMEM_TRAIN": int(self.w_smem_train),
            "STORE_DACT": int(self.store_dact), "FUSED_WGRAD": int(self.fused_wgrad),
            "FUSED_MIN_BLOCKS": self.fused_min_blocks,
            "GROUP_FORWARD": int(self.group_forward), "ENCODED_INPUT": int(self.encoded_input),
            "FWD_ACC16": int(self.forward_acc16),
            "SERVE_KERNELS": int(kernels == "serve"), "TRAIN_KERNELS": int(kernels == "train"),
            **optimizer_defines(s),
        }
        head = kernel_code_defines() + "".join(f"#define {k} {v}\n" for k, v in defines.items())
        return head + read_source("cuda/mlp_common.cuh") + read_source("cuda/mlp_mma.cu")


class CudaMmaModel(MmaPlan, CudaModel):
    """A model compiled to the fused mma.sync kernels; every buffer lives on the device. With
    ``forward_acc16`` it is the ``mma-f16acc`` variant: the same kernels, except that the fp16-out
    forwards accumulate in fp16 as tiny-cuda-nn's fully fused MLP does."""

    supports_ema = True

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None,
                 knobs: CudaKnobs | None = None, forward_acc16: bool = False):
        CudaModel.__init__(self, spec, cp, info)
        MmaPlan.__init__(self, spec, knobs, forward_acc16)
        self.variant = "mma-f16acc" if forward_acc16 else "mma"
        self._module = self._build(cache)
        self._allocate()
        self.set_params(init_params(spec))

    # -- build ------------------------------------------------------------------------------
    def _build(self, cache: KernelCache | None) -> LoadedModule:
        """The serving module, compiled and loaded now; the training module's compile started
        first, on a thread of its own (``_training_module`` waits for it): a model answers its
        forwards while its training kernels compile (a grid model's serving kernels take about a
        fifth of the time of the whole set)."""
        about = f"model {self.spec.content_hash()} ({describe(self.spec)})"
        self._cache = cache  # the backward's kernels are built on first use, from the same cache
        self._train_lock = threading.Lock()
        self._train_module: LoadedModule | None = None
        self._train_cubin = in_background(
            partial(self._cubin, self.train_source, f"the mma training kernels of {about}"),
            f"mmad-nvrtc-train-{self.spec.content_hash()[:8]}")
        what = f"the mma serving kernels of {about}"
        module = self._load(self._cubin(self.serve_source, what), self.serve_kernels, what)
        forwards = PAIRS_KERNELS if self.encoded_input else PLAIN_FORWARD_KERNELS
        try:
            if self.w_smem_fwd and self.smem_fwd > 48 * 1024:
                for name in forwards + (GROUP_KERNELS if self.group_forward else ()):
                    module.kernel(name).max_dynamic_shared_size_bytes = self.smem_fwd
        except device_errors(self.cp) as exc:
            raise LaunchError(f"loading {what} failed: {exc}") from exc
        smem = self.smem_fwd if self.w_smem_fwd else 0
        self.grid_fwd = self._resident_blocks(module.kernel(forwards[0]), smem)
        # the fp16-out forwards' persistent grid (fp16 accumulators hold fewer registers)
        self.grid_half = self._resident_blocks(module.kernel(forwards[1]), smem) if self.forward_acc16 else self.grid_fwd
        return module

    def _cubin(self, source: str, what: str) -> bytes:
        return cached_cubin(self._cache, lambda: nvrtc_compile(source, self.arch_digits, NVRTC_OPTIONS, what),
                            backend="cuda-mma", device=self.arch, compiler=f"nvrtc-{nvrtc_version()}",
                            options=NVRTC_OPTIONS, source=source)

    def _load(self, cubin: bytes, names: tuple[str, ...], what: str) -> LoadedModule:
        try:
            return LoadedModule(self.cp, cubin, names)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"loading the compiled {what} failed: {exc}") from exc

    def _training_module(self) -> LoadedModule:
        """The training kernels, loaded on first use once their background compile is done (a
        failed compile raises its CompileError here, to the training request)."""
        with self._train_lock:
            if self._train_module is not None:
                return self._train_module
            what = f"the mma training kernels of model {self.spec.content_hash()}"
            module = self._load(self._train_cubin.result(), self.train_kernels, what)
            train = module.kernel("mlp_train_fwd_bwd")
            try:
                if self.w_smem_train and self.smem_train > 48 * 1024:
                    train.max_dynamic_shared_size_bytes = self.smem_train
                    module.kernel("mlp_train_fwd_bwd_rows").max_dynamic_shared_size_bytes = self.smem_train
                if self.fused_wgrad and self.smem_fused > 48 * 1024:
                    for name in FUSED_KERNELS:
                        module.kernel(name).max_dynamic_shared_size_bytes = self.smem_fused
            except device_errors(self.cp) as exc:
                raise LaunchError(f"loading {what} failed: {exc}") from exc
            self._grid_train = self._resident_blocks(train, self.smem_train if self.w_smem_train else 0)
            self._grid_fused = (self._resident_blocks(module.kernel("mlp_train_fused"), self.smem_fused, FUSED_WARPS)
                                if self.fused_wgrad else 0)
            self._train_module = module
            return module

    def wait_for_training_kernels(self) -> None:
        """Returns once the training kernels are compiled and loaded (their compile's error raised
        here)."""
        self._training_module()

    @property
    def training_ready(self) -> bool:
        """Whether the training kernels are compiled (training then starts without waiting)."""
        return self._train_cubin.done()

    @property
    def grid_train(self) -> int:
        """Resident blocks of the training kernel (the persistent grid)."""
        self._training_module()
        return self._grid_train

    @property
    def grid_fused(self) -> int:
        """Resident blocks of mlp_train_fused (0 where the fused plan does not apply)."""
        self._training_module()
        return self._grid_fused

    def _given_module(self) -> LoadedModule:
        """The training kernels compiled with d loss / d output as their target (``LOSS_GIVEN``),
        built on the first ``backward`` and kept."""
        module = getattr(self, "_given", None)
        if module is not None:
            return module
        what = f"the backward kernels of model {self.spec.content_hash()} ({describe(self.spec)})"
        cubin = self._cubin(self._source("LOSS_GIVEN"), what)
        module = self._load(cubin, ("mlp_train_fwd_bwd",) + (("mlp_train_fused",) if self.fused_wgrad else ()), what)
        try:
            if self.w_smem_train and self.smem_train > 48 * 1024:
                module.kernel("mlp_train_fwd_bwd").max_dynamic_shared_size_bytes = self.smem_train
            if self.fused_wgrad and self.smem_fused > 48 * 1024:
                module.kernel("mlp_train_fused").max_dynamic_shared_size_bytes = self.smem_fused
        except device_errors(self.cp) as exc:
            raise LaunchError(f"loading {what} failed: {exc}") from exc
        self._given = module
        return module

    def _resident_blocks(self, kernel, smem: int, warps: int | None = None) -> int:
        """Blocks of one launch that fit on the GPU at once (the persistent grid)."""
        warps = warps or self.warps
        threads = warps * 32
        regs = max(int(kernel.num_regs), 1)
        regs_per_warp = math.ceil(regs * 32 / 256) * 256
        by_regs = self.info["regs_per_sm"] // (regs_per_warp * warps)
        by_smem = self.info["smem_per_sm"] // (smem + 1024) if smem else 64
        by_threads = 2048 // threads
        return max(1, min(by_regs, by_smem, by_threads, 32)) * self.info["sm_count"]

    # -- buffers ----------------------------------------------------------------------------
    def _allocate(self) -> None:
        cp = self.cp
        try:
            n_w = [n * k for _, _, k, n in self.layers]
            n_b = [n for _, _, _, n in self.layers]
            total_w, total_b = sum(n_w), sum(n_b)
            self.w_all = cp.zeros(total_w, dtype=cp.float32)
            self.b_all = cp.zeros(total_b, dtype=cp.float32)  # the kernels read biases here
            n_slots = len(optimizer_slots(self.spec))
            self.slot_w = [cp.zeros(total_w, dtype=cp.float32) for _ in range(n_slots)]
            self.slot_b = [cp.zeros(total_b, dtype=cp.float32) for _ in range(n_slots)]
            self.wimage = cp.zeros(self.wf_total + self.wb_total + self.din_total, dtype=cp.uint16)
            # with EMA, the forward image of the average (mlp_optimize writes it) and the average's
            # biases (its slot) are what inference reads; training reads wimage and b_all
            self.eimage = cp.zeros(self.wf_total, dtype=cp.uint16) if self.spec.optimizer.ema is not None else None
            self.dummy = cp.zeros(4, dtype=cp.float32)
            self.ctl = cp.zeros(4, dtype=cp.int32)
        except device_errors(cp) as exc:
            raise LaunchError(f"allocating the model's device buffers failed: {exc}") from exc
        self.w_off, self.b_off = master_offsets(self.layers)
        # the packed fp16 images: every layer's forward image (at its master offset: same sizes),
        # then the backward images of layers 1.., then layer 0's where the input's gradient is made
        self.wf_off = list(self.w_off)
        self.wb_off = ([self.wf_total + self.wb_total] if self.encoded_input else [-1]) + [
            self.wf_total + off - self.w_off[1] for off in self.w_off[1:]]
        self._workspace: dict[int, dict[str, Any]] = {}
        self._run: dict[str, Any] = {}  # per-run device tables: learning rates, losses, batch buffers
        self._graphs: dict[tuple, Any] = {}  # one captured step per key (CUDA graphs)
        self._tables: TableUploads | None = None  # forward_group's descriptors, made on first use

    def _workspace_for(self, rows_pad: int) -> dict[str, Any]:
        ws = self._workspace.get(rows_pad)
        if ws is not None:
            return ws
        self._workspace.clear()  # one batch size at a time: large buffers are not hoarded
        self._graphs.clear()  # captured steps read the workspace being freed
        cp = self.cp
        w, nh = self.width, self.n_hidden
        if self.fused_wgrad:
            # one partial sum per block of mlp_train_fused, every layer (mlp_optimize adds them)
            blocks = self.fused_blocks(rows_pad)
            chunks = [(blocks, 0)] * self.n_layers
            max_partial = blocks * sum(n * k + n for _, _, k, n in self.layers)
        else:
            chunks = [self._wgrad_chunks(rows_pad, k, n) for _, _, k, n in self.layers]
            max_partial = max(c * (n * k + n) for (c, _), (_, _, k, n) in zip(chunks, self.layers))
        stored_rows = 0 if self.fused_wgrad else rows_pad  # the fused kernel keeps h and deltas on chip
        try:
            ws = {
                "h": cp.empty(max(stored_rows * (self.k_in + nh * w) // 2, 2), dtype=cp.uint32),
                "d": cp.empty(max(stored_rows * (nh * w + self.n_out_pad) // 2, 2), dtype=cp.uint32),
                "dact": cp.empty(stored_rows * nh * w // 2 if self.store_dact else 2, dtype=cp.uint32),
                "partial": cp.empty(max_partial, dtype=cp.float32),
                # d loss / d input (fp16, loss-scaled) where the plan makes it
                "din": cp.empty(rows_pad * self.k_in if self.encoded_input else 2, dtype=cp.uint16),
                "loss": cp.zeros(self._loss_slot_count(), dtype=cp.float64),
                "chunks": chunks,
            }
        except device_errors(cp) as exc:
            raise LaunchError(f"allocating training buffers for {rows_pad} rows failed: {exc}") from exc
        self._workspace[rows_pad] = ws
        return ws

    def _wgrad_chunks(self, rows_pad: int, k: int, n: int) -> tuple[int, int]:
        """(chunks, rows a chunk) of a K x N layer's weight-gradient kernel (mlp_wgrad): about
        four blocks an SM over its 64 x 64 tiles."""
        tiles = math.ceil(n / 64) * math.ceil(k / 64)
        n_chunks = max(1, min(rows_pad // WGRAD_ROWS, math.ceil(4 * self.info["sm_count"] / tiles)))
        chunk_rows = math.ceil(rows_pad / n_chunks / WGRAD_ROWS) * WGRAD_ROWS
        return math.ceil(rows_pad / chunk_rows), chunk_rows

    def _loss_slot_count(self) -> int:
        """Per-warp loss sums the training kernels write at most (mlp_finish_step adds them)."""
        return max(self.grid_train * self.warps, self.grid_fused * FUSED_WARPS)

    def _launch(self, name: str, grid, block, args, smem: int = 0) -> None:
        module = self._module if name in self._module.kernels else self._training_module()
        self._launch_from(module, name, grid, block, args, smem)

    # -- compute --------------------------------------------------------------------------------
    def forward(self, x: Any, out_dtype: Any = np.float32, into: Any = None) -> Any:
        """See ``CompiledModel.forward``; ``out_dtype`` float16 gives fp16 outputs (rounded once
        from the fp32 result). fp16 device inputs with fp16 outputs run ``mlp_forward_half``,
        which reads and writes fp16 (the I/O of an fp16 pipeline, half the bytes). ``into``: a
        C-contiguous device array of the kernel's output dtype the kernel writes (``forward_into``)."""
        half_out = self._half_out(out_dtype)
        dx, from_host = self._device_input(x, self.spec.n_input_dims, "input", encode=True, keep_half=half_out)
        out = self._forward_encoded(dx, half_out, self._inference_weights(), into)
        return self.download(out) if from_host else out

    def _forward_encoded(self, dx: Any, half_out: bool, weights: tuple[Any, Any], into: Any = None) -> Any:
        """The forward kernel on the encoded input ``dx`` (a device array as _device_input makes it)."""
        cp = self.cp
        rows = dx.shape[0]
        half_io = half_out and dx.dtype == cp.float16
        out = into if into is not None else cp.empty((rows, self.spec.n_output_dims),
                                                     dtype=cp.float16 if half_io else cp.float32)
        if rows:
            rows_pad = self._rows_padded(rows)
            tiles = rows_pad // (16 * (self.mt_half if half_io else self.mt_fwd))
            grid = max(1, min(self.grid_half if half_io else self.grid_fwd, math.ceil(tiles / self.warps)))
            self._launch("mlp_forward_half" if half_io else "mlp_forward", (grid,), (self.warps * 32,),
                         (dx, np.int64(rows), np.int64(rows_pad), out, *weights),
                         self.smem_fwd if self.w_smem_fwd else 0)
        if half_out and not half_io:
            out = out.astype(cp.float16)
        return out

    def forward_into(self, x: Any, out: Any) -> None:
        """See ``CompiledModel.forward_into``: the kernel writes ``out`` itself when it is a
        C-contiguous device array of its output dtype (fp16 for fp16 device inputs and outputs,
        fp32 otherwise), else the result is copied in."""
        cp = self.cp
        shape = (x.shape[0], self.spec.n_output_dims)
        direct = (self.is_device_array(x) and self.is_device_array(out) and out.shape == shape
                  and out.flags.c_contiguous
                  and out.dtype == (cp.float16 if x.dtype == cp.float16 and out.dtype == cp.float16 else cp.float32))
        if direct:
            self.forward(x, out_dtype=out.dtype, into=out)
        else:
            super().forward_into(x, out)

    def forward_group(self, pairs: list[tuple[Any, Any]], nonfinite: Any = None) -> None:
        """See ``CompiledModel.forward_group``: the pairs that ``mlp_forward_half_group`` (fp16 in
        and out) or ``mlp_forward_group`` (fp32 in and out) can take run in one launch each, their
        finiteness checked as the kernel reads them; the others (another dtype pairing, an
        encoding to apply, a misaligned region) one at a time."""
        if not self.group_forward or not self.spec.encoding.passthrough:
            super().forward_group(pairs, nonfinite)
            return
        cp = self.cp
        by_kernel: dict[str, list[int]] = {"mlp_forward_half_group": [], "mlp_forward_group": []}
        others = []
        for i, (x, out) in enumerate(pairs):
            kernel = ("mlp_forward_half_group" if x.dtype == out.dtype == cp.float16
                      else "mlp_forward_group" if x.dtype == out.dtype == cp.float32 else None)
            if (kernel is not None and self.is_device_array(x) and self.is_device_array(out)
                    and x.flags.c_contiguous and out.flags.c_contiguous and x.data.ptr % 16 == 0
                    and out.data.ptr % 16 == 0 and x.shape == (x.shape[0], self.spec.n_input_dims)
                    and out.shape == (x.shape[0], self.spec.n_output_dims)):
                by_kernel[kernel].append(i)
            else:
                others.append(i)
        flag_base = nonfinite.data.ptr if nonfinite is not None else 0  # uint32 words
        for kernel, members in by_kernel.items():
            if not members:
                continue
            table = np.zeros((len(members), 5), dtype=np.int64)  # GroupForward in mlp_mma.cu
            half = kernel == "mlp_forward_half_group"
            rows_per_tile = 16 * (self.mt_half if half else self.mt_fwd)
            tiles = 0
            for row, i in enumerate(members):
                x, out = pairs[i]
                table[row] = (x.data.ptr, out.data.ptr, x.shape[0], tiles, flag_base + 4 * i if flag_base else 0)
                tiles += -(-x.shape[0] // rows_per_tile)
            if tiles == 0:
                continue
            try:
                if self._tables is None:
                    self._tables = TableUploads(cp)
                group = self._tables.upload(table)
            except device_errors(cp) as exc:
                raise LaunchError(f"copying a group of {len(members)} forwards to the device failed: {exc}") from exc
            grid = max(1, min(self.grid_half if half else self.grid_fwd, math.ceil(tiles / self.warps)))
            self._launch(kernel, (grid,), (self.warps * 32,),
                         (group, np.int32(len(members)), np.int64(tiles), *self._inference_weights()),
                         self.smem_fwd if self.w_smem_fwd else 0)
            self._tables.used()
        for i in others:
            super().forward_group([pairs[i]], None if nonfinite is None else nonfinite[i:i + 1])

    def _inference_weights(self) -> tuple[Any, Any]:
        """(fp16 weight image, fp32 biases) the forward reads: the EMA average's under tcnn's EMA
        wrapper (its slot is the last), else the training weights'."""
        if self.eimage is None:
            return self.wimage, self.b_all
        return self.eimage, self.slot_b[-1]

    def fused_blocks(self, rows_pad: int) -> int:
        """Blocks of mlp_train_fused for a batch: resident ones, at most one per 128-row super-tile."""
        return max(1, min(self.grid_fused, rows_pad // FUSED_ROWS))

    def _forward_backward(self, dx, dy, rows: int, row_map: Any = None,
                          mean_over: int | None = None, given: bool = False) -> tuple[dict[str, Any], Any]:
        """Forward + loss + backward in one kernel; the weight gradients inside it (fused plan) or
        in each layer's chunked kernel afterwards (``_layer_grads``). Returns the workspace and
        the kernel's per-warp loss sums. With ``row_map``, batch row r is row ``row_map[r]`` of
        ``dx`` and ``dy`` (a dataset read in place). The gradient is that of the mean loss over
        ``mean_over`` rows (default: these ``rows``; a data-parallel replica's part of a larger
        batch gives the whole batch's). ``given``: ``dy`` is d loss / d output itself (the
        ``LOSS_GIVEN`` kernels, scaled by the loss scale alone)."""
        rows_pad = self._rows_padded(rows)
        ws = self._workspace_for(rows_pad)
        if given:
            launch = lambda *a: self._launch_from(self._given_module(), *a)  # noqa: E731
            grad_scale = np.float32(self.spec.loss_scale)
        else:
            launch = self._launch
            grad_scale = np.float32(self.spec.loss_scale / ((mean_over or rows) * self.spec.n_output_dims))
        if self.fused_wgrad:
            grid = self.fused_blocks(rows_pad)
            loss_slots = ws["loss"][: grid * FUSED_WARPS]
            launch("mlp_train_fused" if row_map is None else "mlp_train_fused_rows", (grid,), (FUSED_WARPS * 32,),
                         (dx, np.int64(rows), np.int64(rows_pad), self.wimage, self.b_all, dy, grad_scale,
                          ws["partial"], loss_slots) + (() if row_map is None else (row_map,)) + (ws["din"],),
                         self.smem_fused)
        else:
            grid = max(1, min(self.grid_train, math.ceil(rows_pad // 16 / self.warps)))
            loss_slots = ws["loss"][: grid * self.warps]
            launch("mlp_train_fwd_bwd" if row_map is None else "mlp_train_fwd_bwd_rows", (grid,),
                         (self.warps * 32,),
                         (dx, np.int64(rows), np.int64(rows_pad), self.wimage, self.b_all, dy, grad_scale,
                          ws["h"], ws["d"], ws["dact"], loss_slots) + (() if row_map is None else (row_map,))
                         + (ws["din"],),
                         self.smem_train if self.w_smem_train else 0)
        ws["rows_pad"] = rows_pad
        return ws, loss_slots

    def _layer_grads(self, ws: dict[str, Any], i: int) -> tuple[int, Any, Any]:
        """Layer i's partial weight / bias sums: (chunks, partial W sums, partial b sums), from
        mlp_train_fused's buffer (layout: partial_off in mlp_mma.cu) or its own kernel."""
        rows_pad = ws["rows_pad"]
        _, _, k, n = self.layers[i]
        n_chunks, chunk_rows = ws["chunks"][i]
        if self.fused_wgrad:
            off = n_chunks * sum(nj * kj + nj for _, _, kj, nj in self.layers[:i])
            return (n_chunks, ws["partial"][off:off + n_chunks * n * k],
                    ws["partial"][off + n_chunks * n * k:off + n_chunks * (n * k + n)])
        h, d, pw, pb = self._wgrad_operands(ws, i)
        tiles = math.ceil(n / 64) * math.ceil(k / 64)
        self._launch("mlp_wgrad", (n_chunks, tiles), (128,),
                     (d, np.int32(n), h, np.int32(k), np.int64(chunk_rows), np.int64(rows_pad), pw, pb))
        return n_chunks, pw, pb

    def _wgrad_operands(self, ws: dict[str, Any], i: int) -> tuple[Any, Any, Any, Any]:
        """Layer i's stored inputs h and deltas (fp16, rows_pad rows; mlp_mma.cu's h_off / d_off)
        and its chunks' partial W and b sums in the workspace."""
        rows_pad = ws["rows_pad"]
        _, _, k, n = self.layers[i]
        n_chunks = ws["chunks"][i][0]
        h_off = 0 if i == 0 else rows_pad * (self.k_in + (i - 1) * self.width)
        d_off = rows_pad * i * self.width
        return (ws["h"].view(self.cp.uint16)[h_off:h_off + rows_pad * k],
                ws["d"].view(self.cp.uint16)[d_off:d_off + rows_pad * n],
                ws["partial"][: n_chunks * n * k], ws["partial"][n_chunks * n * k: n_chunks * (n * k + n)])

    def _optimize_layer(self, i: int, mode: int, n_chunks: int, pw, pb, grad_w=None, grad_b=None,
                        inv_scale: float | None = None) -> None:
        """mode 0: reduce + optimizer step at the rate ``_run["lr"][ctl[step]]``; 1: reduce into
        grad_w / grad_b; 2: refresh the fp16 images only; 3: refresh the EMA forward image from
        the average only. The partial sums are multiplied by ``inv_scale`` (default: undo the
        loss scale; 1 for gradients already unscaled). With EMA, modes 0 and 2 update the
        average (the last slot) at ``_run["ema"][ctl[step]]`` / to the parameters set."""
        fan_in, fan_out, k, n = self.layers[i]
        w = self.w_all[self.w_off[i]:self.w_off[i] + n * k]
        b = self.b_all[self.b_off[i]:self.b_off[i] + n]
        second = 1 if self.spec.optimizer.otype == "Adam" else 0  # Adam's v; SGD has one moment
        s1w = self.slot_w[0][self.w_off[i]:self.w_off[i] + n * k]
        s1b = self.slot_b[0][self.b_off[i]:self.b_off[i] + n]
        s2w = self.slot_w[second][self.w_off[i]:self.w_off[i] + n * k]
        s2b = self.slot_b[second][self.b_off[i]:self.b_off[i] + n]
        total = n * k + n
        d = self.dummy
        if self.eimage is None:
            ema = (d, d, d, d)
        else:
            ema = (self.slot_w[-1][self.w_off[i]:self.w_off[i] + n * k], self.slot_b[-1][self.b_off[i]:self.b_off[i] + n],
                   self.eimage, self._run.get("ema", d) if mode == 0 else d)
        self._launch("mlp_optimize", (math.ceil(total / 256),), (256,),
                     (np.int32(mode), w, b, s1w, s1b, s2w, s2b, d if pw is None else pw,
                      d if pb is None else pb, np.int32(n_chunks), np.int32(n), np.int32(k),
                      np.int32(fan_out), np.int32(fan_in), self.wimage, np.int32(self.wf_off[i]),
                      np.int32(self.wb_off[i]), self._run.get("lr", d) if mode == 0 else d, self.ctl,
                      np.float32(1.0 / self.spec.loss_scale if inv_scale is None else inv_scale),
                      d if grad_w is None else grad_w, d if grad_b is None else grad_b, *ema))

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        dx, dy, rows = self._prepare_batch(x, y)
        self._start_run(steps, EpochPosition(0))
        key = ("batch", rows, dx.data.ptr, dy.data.ptr)
        self._replay(key, steps, lambda: self._enqueue_step(dx, dy, rows, 0))
        return self._finish_run(steps, rows)

    def train_epochs(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> np.ndarray:
        """See ``CompiledModel.train_epochs``: each step draws its batch of the epoch's order on
        the device, so every step is the same replayed graph; the order's position lives in the
        device control block and is checked against ``position`` when the losses come back.
        An fp32 dataset is read in place: ``mlp_batch_rows`` writes the batch's row numbers and
        the training kernel reads the dataset through them. An fp16 one is gathered into fp32
        batch buffers first (``mlp_gather_batch``: the training kernels read fp32)."""
        check_epoch_run(data, batch, steps)
        draw, dx, dy, row_map = self._epoch_batches(data, batch)
        self._start_run(steps, position)

        def step() -> None:
            draw()
            self._enqueue_step(dx, dy, batch, data.rows, row_map)

        key = ("epochs", batch, data.rows, data.x.data.ptr, data.x.dtype.char, data.y.data.ptr, data.y.dtype.char)
        self._replay(key, steps, step)
        return self._finish_epochs(data, batch, steps, position)

    def _epoch_batches(self, data: Dataset, batch: int) -> tuple[Any, Any, Any, Any]:
        """(draw, x, y, row map): ``draw()`` enqueues the drawing of the next batch of the epoch
        order held in the control block; the training kernel then reads the batch from x and y,
        through the row map where the dataset (fp32) is read in place, else (fp16) from the fp32
        buffers ``mlp_gather_batch`` filled."""
        if not data.on_device:
            raise InvalidInput("this dataset is not on the cuda device (put_dataset keeps it there)")
        half_bits = epoch_half_bits(data.rows)
        x_half, y_half = int(data.x.dtype == self.cp.float16), int(data.y.dtype == self.cp.float16)
        in_place = not (x_half or y_half)
        bx, by = self._batch_buffers(batch, in_place)

        def read_in_place() -> None:
            self._launch("mlp_batch_rows", (min(math.ceil(batch / 256), self.info["sm_count"] * 8),), (256,),
                         (np.int64(data.rows), np.int32(half_bits), self.ctl, np.int32(batch), bx))

        def gather() -> None:
            warps = min(batch, self.info["sm_count"] * 16 * GATHER_WARPS)
            self._launch("mlp_gather_batch", (math.ceil(warps / GATHER_WARPS),), (GATHER_WARPS * 32,),
                         (data.x, np.int32(x_half), data.y, np.int32(y_half), np.int64(data.rows),
                          np.int32(half_bits), self.ctl, np.int32(batch), bx, by))

        return (read_in_place, data.x, data.y, bx) if in_place else (gather, bx, by, None)

    def _finish_epochs(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> np.ndarray:
        """The losses of a run of ``steps`` steps over ``data`` from ``position`` (advanced past them)."""
        expected = EpochPosition(position.seed, position.epoch, position.cursor)
        expected.advance(data.rows, batch, steps)
        losses = self._finish_run(steps, batch, expected)
        position.epoch, position.cursor = expected.epoch, expected.cursor
        return losses

    # -- data-parallel steps (driven by mmad.backends.cuda.parallel, this model's device current) --
    def parallel_start(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> Any:
        """Prepare a data-parallel run of ``steps`` steps on this replica's shard ``data``, ``batch``
        rows a step; returns the flat fp32 gradient buffer the all-reduce sums in place (every
        layer's weights, then every layer's biases, at the masters' offsets; padding stays 0)."""
        check_epoch_run(data, batch, steps)
        draw, dx, dy, row_map = self._epoch_batches(data, batch)
        self._start_run(steps, position)
        grads = self._run.get("grads")
        if grads is None:
            try:
                grads = self._run["grads"] = self.cp.zeros(self.w_all.size + self.b_all.size, dtype=self.cp.float32)
            except device_errors(self.cp) as exc:
                raise LaunchError(f"allocating the gradient buffer failed: {exc}") from exc
        self._parallel = (data, batch, draw, dx, dy, row_map, grads)
        return grads

    def _grad_views(self, grads: Any, i: int) -> tuple[Any, Any]:
        _, _, k, n = self.layers[i]
        total_w = self.w_all.size
        return (grads[self.w_off[i]:self.w_off[i] + n * k],
                grads[total_w + self.b_off[i]:total_w + self.b_off[i] + n])

    def parallel_gradients(self, batch_rows: int) -> None:
        """Enqueue one step's batch draw, forward, backward and the reduction of this replica's
        gradient of the mean loss over all ``batch_rows`` rows of the step into the buffer."""
        data, batch, draw, dx, dy, row_map, grads = self._parallel
        draw()
        ws, loss_slots = self._forward_backward(dx, dy, batch, row_map, mean_over=batch_rows)
        for i in reversed(range(self.n_layers)):
            n_chunks, pw, pb = self._layer_grads(ws, i)
            self._optimize_layer(i, 1, n_chunks, pw, pb, *self._grad_views(grads, i))
        self._parallel_loss = loss_slots

    def parallel_apply(self) -> None:
        """Enqueue the optimizer step on the summed gradient and the step's bookkeeping."""
        data, batch, _, _, _, _, grads = self._parallel
        for i in range(self.n_layers):
            gw, gb = self._grad_views(grads, i)
            self._optimize_layer(i, 0, 1, gw, gb, inv_scale=1.0)
        loss_slots = self._parallel_loss
        self._launch("mlp_finish_step", (1,), (FINISH_THREADS,),
                     (loss_slots, np.int32(loss_slots.size), self._run["losses"], self.ctl, np.int32(batch),
                      np.int64(data.rows)))

    def parallel_finish(self, steps: int, position: EpochPosition) -> np.ndarray:
        """This replica's losses of the run (mean over its rows), ``position`` advanced."""
        data, batch = self._parallel[:2]
        self._parallel = None
        return self._finish_epochs(data, batch, steps, position)

    def _enqueue_step(self, dx, dy, rows: int, dataset_rows: int, row_map: Any = None) -> None:
        """One optimizer step's launches; identical every step (the control block says which)."""
        ws, loss_slots = self._forward_backward(dx, dy, rows, row_map)
        for i in reversed(range(self.n_layers)):
            n_chunks, pw, pb = self._layer_grads(ws, i)
            self._optimize_layer(i, 0, n_chunks, pw, pb)
        self._launch("mlp_finish_step", (1,), (FINISH_THREADS,),
                     (loss_slots, np.int32(loss_slots.size), self._run["losses"], self.ctl, np.int32(rows),
                      np.int64(dataset_rows)))

    def _start_run(self, steps: int, position: EpochPosition) -> None:
        """The device tables of a run of ``steps`` steps: each step's learning rate, room for
        the losses, and the control block at step 0 of ``position``."""
        cp = self.cp
        run = self._run
        if run.get("capacity", 0) < steps:
            capacity = 1 << max(6, (steps - 1).bit_length())
            try:
                run["lr"] = cp.zeros(capacity, dtype=cp.float32)
                run["losses"] = cp.zeros(capacity, dtype=cp.float64)
                if self.eimage is not None:  # each step's EMA (keep, take), indexed like the rates
                    run["ema"] = cp.zeros((capacity, 2), dtype=cp.float32)
            except device_errors(cp) as exc:
                raise LaunchError(f"allocating the tables of {steps} training steps failed: {exc}") from exc
            run["capacity"] = capacity
            self._graphs.clear()  # captured steps read the tables being replaced
        ctl = np.array([0, position.cursor, position.epoch, 0], dtype=np.int32)
        ctl[CTL_SEED] = np.uint32(position.seed & 0xFFFFFFFF).view(np.int32)
        try:
            run["lr"][:steps].set(self.step_rates(steps))
            if self.eimage is not None:
                run["ema"][:steps].set(ema_factor_table(self.spec.optimizer.ema, self.step_count + 1, steps))
            self.ctl.set(ctl)
        except device_errors(cp) as exc:
            raise LaunchError(f"copying a training run's tables to the device failed: {exc}") from exc

    def _batch_buffers(self, batch: int, row_numbers: bool) -> tuple[Any, Any]:
        """The buffers of a drawn batch (one kind and size kept at a time): its row numbers
        (``row_numbers``; the second is unused), or the fp32 rows gathered."""
        cp = self.cp
        held = self._run.get("batch")
        want = ((batch,), cp.int32) if row_numbers else ((batch, self.spec.n_encoded_dims), cp.float32)
        if held is None or (held[0].shape, held[0].dtype) != want:
            self._run["batch"] = None
            self._graphs.clear()
            try:
                held = ((cp.empty(batch, dtype=cp.int32), self.dummy) if row_numbers else
                        (cp.empty((batch, self.spec.n_encoded_dims), dtype=cp.float32),
                         cp.empty((batch, self.spec.n_output_dims), dtype=cp.float32)))
            except device_errors(cp) as exc:
                raise LaunchError(f"allocating a {batch}-row training batch failed: {exc}") from exc
            self._run["batch"] = held
        return held

    def _replay(self, key: tuple, steps: int, enqueue) -> None:
        """``steps`` times the launches ``enqueue`` makes: directly for a few steps, else one
        captured CUDA graph (on a private stream, relaxed mode: other threads keep launching)
        replayed on the current stream, so the steps stay ordered with everything else."""
        cp = self.cp
        if steps < GRAPH_MIN_STEPS or not self.cuda_graphs:
            for _ in range(steps):
                enqueue()
            return
        graph = self._graphs.get(key)
        try:
            if graph is None:
                self._workspace_for(self._rows_padded(key[1]))  # allocated before, not during, capture
                self._training_module()  # and the training kernels loaded
                capture = cp.cuda.Stream(non_blocking=True)
                with capture:
                    capture.begin_capture()
                    try:
                        enqueue()
                    finally:
                        graph = capture.end_capture()
                if len(self._graphs) >= KEPT_GRAPHS:
                    self._graphs.pop(next(iter(self._graphs)))
                self._graphs[key] = graph
            stream = cp.cuda.get_current_stream()
            for _ in range(steps):
                graph.launch(stream=stream)
        except device_errors(cp) as exc:
            raise LaunchError(f"running the captured training step failed: {exc}") from exc

    def _finish_run(self, steps: int, rows: int, expected: EpochPosition | None = None) -> np.ndarray:
        """The run's losses (one copy back, the run's only wait), mean per output element; the
        control block read with them must show every step done and the order where expected."""
        ctl = self.download(self.ctl)
        losses = self.download(self._run["losses"][:steps])
        self.step_count += steps
        if ctl[CTL_STEP] != steps or (expected is not None and (ctl[CTL_CURSOR], ctl[CTL_EPOCH])
                                     != (expected.cursor, expected.epoch)):
            raise LaunchError(f"the device's step record ({ctl.tolist()}) does not match the {steps} steps "
                              f"launched{'' if expected is None else f' ending at {expected}'}")
        return (losses / (rows * self.spec.n_output_dims)).astype(np.float32)

    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        return self._device_loss_and_grads(*self._prepare_batch(x, y))

    def _device_loss_and_grads(self, dx: Any, dy: Any, rows: int) -> tuple[float, dict[str, np.ndarray]]:
        """``loss_and_grads`` of a batch already on the device as the training kernels read it."""
        ws, loss_slots = self._forward_backward(dx, dy, rows)
        grad_w, grad_b = self._gradients_into(ws)
        grads = {k: self.download(v) for k, v in self._named_layer_grads(grad_w, grad_b).items()}
        value = float(self.download(loss_slots.sum())) / (rows * self.spec.n_output_dims)
        return value, grads

    def _gradients_into(self, ws: dict[str, Any], grad_w: Any = None, grad_b: Any = None) -> tuple[Any, Any]:
        """The batch in ``ws``'s weight and bias gradients (unscaled fp32), reduced into flat
        buffers laid out as the masters ``w_all`` / ``b_all`` (padded; the padding 0: zeroed
        buffers given, else fresh ones). The padded weights are tiny-cuda-nn's matrices exactly
        (:func:`mmad.export.tcnn_layout`)."""
        cp = self.cp
        try:
            grad_w = cp.zeros(self.w_all.size, dtype=cp.float32) if grad_w is None else grad_w
            grad_b = cp.zeros(self.b_all.size, dtype=cp.float32) if grad_b is None else grad_b
        except device_errors(cp) as exc:
            raise LaunchError(f"allocating the gradient buffers failed: {exc}") from exc
        for i in reversed(range(self.n_layers)):  # each layer's partial sums are reduced before the next's
            _, _, k, n = self.layers[i]
            n_chunks, pw, pb = self._layer_grads(ws, i)
            self._optimize_layer(i, 1, n_chunks, pw, pb, grad_w[self.w_off[i]:self.w_off[i] + n * k],
                                 grad_b[self.b_off[i]:self.b_off[i] + n])
        return grad_w, grad_b

    def _named_layer_grads(self, grad_w: Any, grad_b: Any) -> dict[str, Any]:
        """``W{i}`` / ``b{i}`` views (unpadded) of ``_gradients_into``'s buffers, layer by layer."""
        out = {}
        for i, (fan_in, fan_out, k, n) in enumerate(self.layers):
            out[f"W{i}"] = grad_w[self.w_off[i]:self.w_off[i] + n * k].reshape(n, k)[:fan_out, :fan_in]
            out[f"b{i}"] = grad_b[self.b_off[i]:self.b_off[i] + fan_out]
        return out

    # -- backward from an outside gradient ----------------------------------------------------------
    def _check_backward_model(self, want_input_grad: bool) -> None:
        if self.eimage is not None:
            raise InvalidInput("backward from an outside gradient runs on the training weights: it is not built for "
                               "a model whose optimizer keeps an EMA average on the cuda backend (the cpu backend has it)")
        if want_input_grad and not self.encoded_input:
            raise InvalidInput("d loss / d input comes from the cuda models that encode their input on the device "
                               "(grid-encoded models and mmad.torch's modules); this model was compiled without it")

    def _gradient_rows(self, dL_dy: Any, rows: int) -> Any:
        """``dL_dy`` as the LOSS_GIVEN kernels read it: device fp32, C-contiguous, rows × n_output_dims."""
        dy, _ = self._device_input(dL_dy, self.spec.n_output_dims, "dL_dy", encode=False)
        if dy.shape[0] != rows:
            raise InvalidInput(f"dL_dy (the output's gradient) has {dy.shape[0]} rows; the forward had {rows}")
        return dy

    def forward_train(self, x: Any, out_dtype: Any = np.float32, stream: Any = None) -> tuple[Any, Any]:
        """See ``CompiledModel.forward_train``: the forward (the training weights: no EMA here),
        its input kept for ``backward``, whose training kernels recompute the activations."""
        self._check_backward_model(False)
        with stream_scope(self.cp, stream):
            dx, from_host = self._device_input(x, self.spec.n_input_dims, "input", encode=True)
            out = self._forward_encoded(dx, self._half_out(out_dtype), (self.wimage, self.b_all))
        return (self.download(out) if from_host else out), self._forward_context(dx.shape[0], (dx, from_host))

    def backward(self, ctx: Any, dL_dy: Any, want_input_grad: bool = False,
                 stream: Any = None) -> tuple[Any, dict[str, Any]]:
        """See ``CompiledModel.backward``: the training kernels with ``dL_dy`` as their target
        (LOSS_GIVEN), the weight gradients reduced as a step reduces them, no optimizer step.
        The parameters' gradients only: d loss / d input needs the device-encoded models."""
        self._check_backward_model(want_input_grad)
        self.check_forward_context(ctx, dL_dy)
        dx, from_host = ctx.state
        cp = self.cp
        with stream_scope(cp, stream):
            dy = self._gradient_rows(dL_dy, ctx.rows)
            if ctx.rows:
                grads = self._named_layer_grads(*self._gradients_into(self._forward_backward(dx, dy, ctx.rows,
                                                                                             given=True)[0]))
            else:  # no rows: nothing to launch, every gradient 0
                grads = self._named_layer_grads(cp.zeros(self.w_all.size, dtype=cp.float32),
                                                cp.zeros(self.b_all.size, dtype=cp.float32))
        if from_host:
            return None, {k: self.download(v) for k, v in grads.items()}
        return None, grads

    # -- parameters -------------------------------------------------------------------------------
    def _padded(self, flat: Any, offsets: list[int], i: int, is_w: bool) -> np.ndarray:
        fan_in, fan_out, k, n = self.layers[i]
        if is_w:
            return self.download(flat[offsets[i]:offsets[i] + n * k]).reshape(n, k)[:fan_out, :fan_in].copy()
        return self.download(flat[offsets[i]:offsets[i] + n])[:fan_out].copy()

    def _upload_padded(self, flat: Any, offsets: list[int], i: int, value: np.ndarray, is_w: bool) -> None:
        fan_in, fan_out, k, n = self.layers[i]
        if is_w:
            host = np.zeros((n, k), dtype=np.float32)
            host[:fan_out, :fan_in] = value
            flat[offsets[i]:offsets[i] + n * k] = self.cp.asarray(host.reshape(-1))
        else:
            host = np.zeros(n, dtype=np.float32)
            host[:fan_out] = value
            flat[offsets[i]:offsets[i] + n] = self.cp.asarray(host)

    def load_device_params(self, weights: list[Any], biases: list[Any]) -> None:
        """Every layer's fp32 parameters copied on the device from another model's device arrays
        (``weights[i]``: fan_out × fan_in, ``biases[i]``), then the fp16 images refreshed: how the
        ``mma-f16acc+cublaslt`` variant serves with this model what its cuBLASLt half trained."""
        try:
            for i, (fan_in, fan_out, k, n) in enumerate(self.layers):
                self.w_all[self.w_off[i]:self.w_off[i] + n * k].reshape(n, k)[:fan_out, :fan_in] = weights[i]
                self.b_all[self.b_off[i]:self.b_off[i] + fan_out] = biases[i]
        except device_errors(self.cp) as exc:
            raise LaunchError(f"copying parameters on the device failed: {exc}") from exc
        for i in range(self.n_layers):
            self._optimize_layer(i, 2, 0, None, None)

    def get_params(self) -> dict[str, np.ndarray]:
        out = {}
        for i in range(self.n_layers):
            out[f"W{i}"] = self._padded(self.w_all, self.w_off, i, True)
            out[f"b{i}"] = self._padded(self.b_all, self.b_off, i, False)
        return out

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        params = check_params(self.spec, params)
        self.params_version += 1
        try:
            for i in range(self.n_layers):
                self._upload_padded(self.w_all, self.w_off, i, params[f"W{i}"], True)
                self._upload_padded(self.b_all, self.b_off, i, params[f"b{i}"], False)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"uploading parameters failed: {exc}") from exc
        for i in range(self.n_layers):  # refresh the fp16 images the kernels read
            self._optimize_layer(i, 2, 0, None, None)

    def _read_slot(self, slot: int) -> dict[str, np.ndarray]:
        out = {}
        for i in range(self.n_layers):
            out[f"W{i}"] = self._padded(self.slot_w[slot], self.w_off, i, True)
            out[f"b{i}"] = self._padded(self.slot_b[slot], self.b_off, i, False)
        return out

    def _write_slots(self, slots: list[dict[str, np.ndarray]], step: int) -> None:
        try:
            for j, values in enumerate(slots):
                for i in range(self.n_layers):
                    self._upload_padded(self.slot_w[j], self.w_off, i, values[f"W{i}"], True)
                    self._upload_padded(self.slot_b[j], self.b_off, i, values[f"b{i}"], False)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"uploading the optimizer state failed: {exc}") from exc
        if self.eimage is not None:  # inference serves the restored average
            for i in range(self.n_layers):
                self._optimize_layer(i, 3, 0, None, None)

    def device_bytes(self) -> int:
        arrays = [self.w_all, self.b_all, self.wimage, self.ctl, *self.slot_w, *self.slot_b]
        arrays += [self.eimage] if self.eimage is not None else []
        arrays += [a for k, a in self._run.items() if k in ("lr", "losses", "grads", "ema")] + [a for a in self._run.get("batch") or () if a is not self.dummy]
        for ws in self._workspace.values():
            arrays += [v for v in ws.values() if isinstance(v, self.cp.ndarray)]
        return int(sum(a.nbytes for a in arrays))

    def close(self) -> None:
        self._workspace.clear()
        self._graphs.clear()
        self._run.clear()
        for name in ("w_all", "b_all", "wimage", "eimage", "slot_w", "slot_b", "dummy", "ctl"):
            if hasattr(self, name):
                delattr(self, name)


