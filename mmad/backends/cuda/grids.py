"""Models whose encoded input is made on the device: grid-encoded ones (HashGrid, DenseGrid,
TiledGrid) on the ``mma`` and ``mma-f16acc`` variants, and mmad.torch's (any encoding: the
input gradient comes from the same path).

``mmad/shaders/cuda/grid.cu`` and ``encodings.cu``. The MLP runs on the mma kernels (:mod:`.mma`)
with the encoded input as theirs; around them, per training step (all on the device, one captured
CUDA graph):

1. ``grid_encode_<k>`` interpolates each grid part's fp16 table into the encoded input (a thread
   per row and level; pair-major fp16, the layout the mma kernels read with ``ENCODED_INPUT``) and
   ``enc_forward_<k>`` encodes the parameter-free parts from the raw input (:mod:`.encodings`);
2. the mma training kernel (fused where the plan allows), which also writes d loss / d encoded
   input (delta_0 @ W_0, fp16);
3. ``grid_backward_<k>`` adds weight x that gradient into the tables' fp32 gradient (tcnn's
   scatter: the coarse levels summed in shared memory first, the others with global atomics);
4. the MLP's weight gradients and optimizer, then ``grid_optimize``: tcnn's Adam on the tables
   (per-value step counts, zero gradients skipped; numerics.grid_adam_update) or SGD, the fp16
   image the forward reads, the EMA average where the optimizer keeps one.

The tables are the parameters ``grid{k}`` (fp32 masters), read and written like the MLP's.
Datasets on the device hold the raw input (fp32), so each step encodes its batch afresh.

Backward from an outside gradient (``forward_train`` / ``backward``): the forward on the training
weights keeps its encoded input; the backward runs the training kernels compiled with the
gradient as their "loss" (``LOSS_GIVEN``: the loss-scaled d loss / d output in, the deltas, the
weight gradients and d loss / d encoded input out, as in a step), then the tables' gradient and,
when asked, ``grid_input_grad_<k>`` and ``enc_backward_<k>`` turn d loss / d encoded input into
d loss / d input (tcnn's ``dL_dinput``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from mmad.backends.cache import KernelCache
from mmad.backends.contract import (
    CompiledModel, Dataset, EpochPosition, ForwardContext, check_epoch_run, check_params, check_rows, check_rows_shape,
    optimizer_slots,
)
from mmad.backends.cuda.encodings import encodings_source, free_kernels, free_parts, launch_backward, launch_forward
from mmad.backends.cuda.knobs import CudaKnobs
from mmad.backends.cuda.mma import (
    FINISH_THREADS, NVRTC_OPTIONS, CudaMmaModel, f32_literal, optimizer_defines, stream_scope,
)
from mmad.backends.cuda.toolchain import LoadedModule, cached_cubin, device_errors, nvrtc_compile, nvrtc_version
from mmad.backends.encodings import GridPart, grid_input_layout
from mmad.backends.numerics import epoch_half_bits, grid_steps_from_state, step_base_rate
from mmad.errors import InvalidInput, LaunchError
from mmad.shaders import read_source
from mmad.spec import MLPSpec, kernel_code_defines

GRID_THREADS = 256  # grid.cu's block of the encode kernels: a thread per row of one level
BACKWARD_THREADS = 512  # grid_backward's block (at 1024 a 4-D grid spills), two per SM: few flushes of their shared sums
BACKWARD_SMEM_VALUES = 11776  # fp32 sums of the coarse levels a grid_backward block keeps (46 KiB, static)
ELEMENTWISE_THREADS = 256
MODE_CODES = {"dense": 0, "hash": 1, "zero": 2}
INTERP_CODES = {"Linear": 0, "Nearest": 1, "Smoothstep": 2}
BASE_KERNELS = ("grid_gather_targets", "grid_optimize", "grid_round_half")


def fastmod_factor(divisor: int) -> int:
    """Lemire's factor for ``a % divisor`` of 32-bit ``a`` as mulhi64(factor · a mod 2^64, divisor)."""
    return ((1 << 64) // divisor + 1) & ((1 << 64) - 1)


class GridPlan:
    """The grid and parameter-free parts of a spec's encoding and the generated source of their
    kernels (needs no GPU). The kernels read the raw input (``input_cols`` = n_input_dims)."""

    def __init__(self, spec: MLPSpec):
        self.parts = grid_input_layout(spec)[0]
        self.free = free_parts(spec)
        self.input_cols = spec.n_input_dims
        self.values = sum(p.entries * p.features for p in self.parts)
        self.source = self._source(spec)

    @staticmethod
    def input_gradient(p: GridPart) -> bool:
        """Whether a grid part has d output / d input (tcnn's: none for Nearest)."""
        return p.interpolation != "Nearest"

    @property
    def kernels(self) -> tuple[str, ...]:
        grids = tuple(f"grid_{kind}_{p.index}" for p in self.parts for kind in ("encode", "backward"))
        inputs = tuple(f"grid_input_grad_{p.index}" for p in self.parts if self.input_gradient(p))
        return BASE_KERNELS + grids + inputs + free_kernels(self.free)

    @staticmethod
    def shared_levels(p: GridPart) -> tuple[int, int]:
        """(levels, values) of ``p`` whose gradient grid_backward sums in shared memory: the
        longest run of coarse levels (the first rows of the table) within BACKWARD_SMEM_VALUES."""
        levels = 0
        while levels < len(p.levels) and (p.levels[levels].offset + p.levels[levels].entries) * p.features \
                <= BACKWARD_SMEM_VALUES:
            levels += 1
        return levels, (p.levels[levels - 1].offset + p.levels[levels - 1].entries) * p.features if levels else 0

    @staticmethod
    def backward_level_blocks(p: GridPart) -> int:
        """grid_backward's blocks in y: one for the levels summed in shared memory (if any), one
        for each other level."""
        smem_levels, _ = GridPlan.shared_levels(p)
        return (1 if smem_levels else 0) + len(p.levels) - smem_levels

    def _source(self, spec: MLPSpec) -> str:
        defines = {**optimizer_defines(spec), "ACT": 0, "LOSS": 0, "HUBER_DELTA": "0.f", "GRID_THREADS": GRID_THREADS}
        head = kernel_code_defines() + "".join(f"#define {k} {v}\n" for k, v in defines.items())
        parts = "".join(self._part_source(p) for p in self.parts)
        return (head + read_source("cuda/mlp_common.cuh") + encodings_source(self.free) + read_source("cuda/grid.cu")
                + parts)

    def _part_source(self, p: GridPart) -> str:
        levels = ",\n    ".join(
            f"{{{fastmod_factor(lv.entries)}ull, {f32_literal(lv.scale)}, {lv.resolution}u, {lv.entries}u, {lv.offset}u, "
            f"{MODE_CODES[mode]}, {lv.entries - 1 if lv.entries > 1 and lv.entries & (lv.entries - 1) == 0 else 0}u}}"
            for lv, mode in zip(p.levels, p.modes))
        k, t, x_cols = p.index, f"{p.dims}, {p.features}, {INTERP_CODES[p.interpolation]}", self.input_cols
        smem_levels, smem_values = GridPlan.shared_levels(p)
        # the corners' 16-byte group loads (encode, input gradient) need whole rows at aligned
        # addresses (table[p.offset:]); a 4-D part's 16 corners grouped need more than the 32
        # registers ptxas gives it (spills)
        grouped = p.features in (1, 2, 4) and p.offset % p.features == 0 and p.dims <= 3
        return f"""
__device__ __constant__ GridLevelDesc GRID_LEVELS_{k}[{len(p.levels)}] = {{
    {levels}}};

extern "C" __global__ void __launch_bounds__(GRID_THREADS) grid_encode_{k}(
    const float* __restrict__ x, const int* __restrict__ row_map, i64 rows, u16* __restrict__ out,
    const u16* __restrict__ table) {{
    grid_encode_part<{t}, {str(grouped).lower()}, {p.begin}, {p.column}, {x_cols}>(GRID_LEVELS_{k}, x, row_map, rows, out, table);
}}

// 2 blocks an SM: under this register cap ptxas 13.0 spills nothing (with only the block size given
// it spilled a few bytes of a 3-D part at 32-48 registers)
extern "C" __global__ void __launch_bounds__({BACKWARD_THREADS}, 2) grid_backward_{k}(
    const u16* __restrict__ din, int din_cols, const float* __restrict__ x, const int* __restrict__ row_map,
    i64 rows, int x_cols, float* __restrict__ grad, float inv_scale) {{
    grid_backward_part<{t}, {len(p.levels)}, {smem_levels}, {smem_values}>(GRID_LEVELS_{k}, {p.begin}, {p.column}, din, din_cols, x,
                                                          row_map, rows, x_cols, grad, inv_scale);
}}
""" + (f"""
extern "C" __global__ void __launch_bounds__(GRID_THREADS) grid_input_grad_{k}(
    const void* __restrict__ din, int din_half, int din_cols, const float* __restrict__ x, i64 rows, int x_cols,
    const u16* __restrict__ table, float inv_scale, float* __restrict__ dx) {{
    grid_input_grad_part<{t}, {str(grouped).lower()}, {len(p.levels)}>(GRID_LEVELS_{k}, {p.begin}, {p.column}, din,
                                                      din_half, din_cols, x, rows, x_cols, table, inv_scale, dx);
}}
""" if self.input_gradient(p) else "")


class CudaGridModel(CudaMmaModel):
    """A grid-encoded model: the mma kernels on the encoded input, the grid kernels around them."""

    encoded_input = True  # the mma kernels read the pair-major encoded input and write d loss / d it

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None,
                 knobs: CudaKnobs | None = None, forward_acc16: bool = False):
        self.grid_plan = GridPlan(spec)
        self._grid_cache = cache
        super().__init__(spec, cp, info, cache, knobs, forward_acc16)

    # -- build and buffers ---------------------------------------------------------------------------
    def _allocate(self) -> None:
        super()._allocate()
        cp, plan = self.cp, self.grid_plan
        what = f"grid kernels for model {self.spec.content_hash()}"

        def build() -> bytes:
            return nvrtc_compile(plan.source, self.arch_digits, NVRTC_OPTIONS, what)

        cubin = cached_cubin(self._grid_cache, build, backend="cuda-grid", device=self.arch,
                             compiler=f"nvrtc-{nvrtc_version()}", options=NVRTC_OPTIONS, source=plan.source)
        try:
            self._grid_module = LoadedModule(cp, cubin, plan.kernels)
            n = plan.values
            self.tables = cp.zeros(n, dtype=cp.float32)  # fp32 masters, every part back to back
            self.table_grad = cp.zeros(n, dtype=cp.float32)  # zeroed again by each optimizer step
            self.table_image = cp.zeros(n, dtype=cp.uint16)  # the fp16 tables the forward reads
            self.table_slots = [cp.zeros(n, dtype=cp.float32) for _ in optimizer_slots(self.spec)]
            self.table_steps = cp.zeros(n if self.spec.optimizer.otype == "Adam" else 1, dtype=cp.uint32)
            self.table_eimage = cp.zeros(n, dtype=cp.uint16) if self.eimage is not None else None
        except device_errors(cp) as exc:
            raise LaunchError(f"loading or allocating the {what} failed: {exc}") from exc

    def _grid_launch(self, name: str, grid, block, args, smem: int = 0) -> None:
        self._launch_from(self._grid_module, name, grid, block, args, smem)

    # -- the kernel input and the encoded input ---------------------------------------------------------
    def _kernel_input(self, x: Any, name: str = "input") -> tuple[Any, bool]:
        """(x as the encoding kernels read it on the device: fp32 rows of the raw input, whether
        x came from the host)."""
        cp = self.cp
        if not isinstance(x, cp.ndarray):
            return self.upload(check_rows(x, self.spec.n_input_dims, name)), True
        x = check_rows_shape(x, self.spec.n_input_dims, name)
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        return (x.copy() if x.data.ptr % 16 else x), False

    def _new_encoded(self, rows: int) -> Any:
        """An encoded input of ``rows`` rows: pair-major fp16 (grid.cu's ``pair_major``)."""
        try:
            return self.cp.empty(((self.spec.n_encoded_dims + 1) // 2, rows, 2), dtype=self.cp.float16)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"allocating the encoded input of {rows} rows failed: {exc}") from exc

    def _encode(self, kin: Any, rows: int, out: Any, row_map: Any = None, table: Any = None) -> None:
        """Enqueue the encoded input of ``rows`` rows of the kernel input ``kin`` (through
        ``row_map`` where given) into ``out`` (``_new_encoded``) from ``table`` (default: the
        training tables' fp16 image)."""
        if rows == 0:
            return
        plan, table = self.grid_plan, self.table_image if table is None else table
        rmap = 0 if row_map is None else row_map
        for p in plan.parts:
            self._grid_launch(f"grid_encode_{p.index}", (math.ceil(rows / GRID_THREADS), len(p.levels)),
                              (GRID_THREADS,), (kin, rmap, np.int64(rows), out, table[p.offset:]))
        launch_forward(self._grid_launch, plan.free, kin, row_map, rows, plan.input_cols, out, "pairs", 0)

    def forward(self, x: Any, out_dtype: Any = np.float32, into: Any = None) -> Any:
        """See ``CompiledModel.forward``: the encoded input made on the device from the inference
        tables (the EMA average's where the optimizer keeps one), then ``mlp_forward_pairs``
        (fp32 out) or ``mlp_forward_pairs_half`` (fp16 out). ``into``: a C-contiguous device array
        of the output dtype the kernel writes (``forward_into``)."""
        kin, from_host = self._kernel_input(x)
        encoded = self._new_encoded(kin.shape[0])
        self._encode(kin, kin.shape[0], encoded, table=self._inference_tables())
        out = self._forward_pairs(encoded, kin.shape[0], self._half_out(out_dtype), self._inference_weights(), into)
        return self.download(out) if from_host else out

    def _inference_tables(self) -> Any:
        """The fp16 tables the forward reads: the EMA average's where the optimizer keeps one."""
        return self.table_image if self.table_eimage is None else self.table_eimage

    def _training_tables(self) -> Any:
        """The fp16 tables training reads (and the backward's input gradient)."""
        return self.table_image

    def _forward_pairs(self, encoded: Any, rows: int, half: bool, weights: tuple[Any, Any], into: Any = None) -> Any:
        """The MLP's forward of the encoded input (``into`` or a new fp32 / fp16 array)."""
        cp = self.cp
        try:
            out = into if into is not None else cp.empty((rows, self.spec.n_output_dims),
                                                         dtype=cp.float16 if half else cp.float32)
        except device_errors(cp) as exc:
            raise LaunchError(f"allocating the output of {rows} rows failed: {exc}") from exc
        if rows:
            rows_pad = self._rows_padded(rows)
            mt, blocks = (self.mt_half, self.grid_half) if half else (self.mt_fwd, self.grid_fwd)
            grid = max(1, min(blocks, math.ceil(rows_pad // (16 * mt) / self.warps)))
            self._launch("mlp_forward_pairs_half" if half else "mlp_forward_pairs", (grid,), (self.warps * 32,),
                         (encoded, np.int64(rows), np.int64(rows_pad), out, *weights),
                         self.smem_fwd if self.w_smem_fwd else 0)
        return out

    def forward_into(self, x: Any, out: Any) -> None:
        """See ``CompiledModel.forward_into``: the kernel writes ``out`` itself when it is a
        C-contiguous fp32 or fp16 device array of the output's shape, else the result is copied in."""
        cp = self.cp
        if (self.is_device_array(out) and out.flags.c_contiguous and out.dtype in (cp.float16, cp.float32)
                and out.shape == (x.shape[0], self.spec.n_output_dims)):
            self.forward(x, out_dtype=out.dtype, into=out)
        else:
            CompiledModel.forward_into(self, x, out)

    # -- training -------------------------------------------------------------------------------------
    def _encoded_batch(self, rows: int) -> Any:
        """The encoded input of a training batch of ``rows`` rows, kept between calls (captured
        steps write it)."""
        held = self._run.get("encoded")
        if held is None or held.shape[1] != rows:
            self._run["encoded"] = None
            self._graphs.clear()
            held = self._run["encoded"] = self._new_encoded(rows)
        return held

    def _start_run(self, steps: int, position: EpochPosition) -> None:
        """The MLP's run tables, and the tables' own rates: Adam's base rate per step (each value
        applies the bias correction of its own step count), SGD's rate."""
        super()._start_run(steps, position)
        run = self._run
        if run.get("grid_lr") is None or run["grid_lr"].size < run["capacity"]:
            try:
                run["grid_lr"] = self.cp.zeros(run["capacity"], dtype=self.cp.float32)
            except device_errors(self.cp) as exc:
                raise LaunchError(f"allocating the tables of {steps} training steps failed: {exc}") from exc
            self._graphs.clear()
        opt, first = self.spec.optimizer, self.step_count + 1
        rates = np.array([step_base_rate(opt, first + k) for k in range(steps)], np.float32)
        try:
            run["grid_lr"][:steps].set(rates)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"copying a training run's tables to the device failed: {exc}") from exc

    def _grid_gradients(self, din: Any, din_cols: int, kin: Any, rows: int, row_map: Any = None,
                        into: Any = None) -> None:
        """Enqueue d loss / d tables (added into ``into``, default ``table_grad``) from the
        loss-scaled d loss / d encoded input ``din`` (fp16 rows of ``din_cols``: the training
        kernel leaves it in its workspace, the mma plan's ``encoded_input``)."""
        inv_scale = np.float32(1.0 / self.spec.loss_scale)
        blocks = max(1, min(2 * self.info["sm_count"], math.ceil(2 * rows / BACKWARD_THREADS)))  # two threads a row
        grad = self.table_grad if into is None else into
        for p in self.grid_plan.parts:
            self._grid_launch(f"grid_backward_{p.index}", (blocks, GridPlan.backward_level_blocks(p)), (BACKWARD_THREADS,),
                              (din, np.int32(din_cols), kin, 0 if row_map is None else row_map,
                               np.int64(rows), np.int32(kin.shape[1]), grad[p.offset:], inv_scale))

    def _optimize_tables(self, mode: int) -> None:
        """mode 0: the optimizer step at the run's rate (ctl's step); 2: the images from the
        masters (set_params); 3: the EMA image from the average (a restored state)."""
        d, slots = self.dummy, self.table_slots
        second = 1 if self.spec.optimizer.otype == "Adam" else 0
        n = self.grid_plan.values
        if n == 0:  # mmad.torch's models without a grid: no tables
            return
        ema = ((slots[-1], self.table_eimage, self._run.get("ema", d) if mode == 0 else d)
               if self.table_eimage is not None else (d, d, d))
        self._grid_launch("grid_optimize", (math.ceil(n / ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,),
                          (np.int32(mode), np.int64(n), self.tables, self.table_grad, slots[0], slots[second],
                           self.table_steps, self.table_image, self._run.get("grid_lr", d) if mode == 0 else d,
                           self.ctl, *ema))

    def _grid_step(self, kin: Any, row_map: Any, dy: Any, rows: int, dataset_rows: int) -> None:
        """One optimizer step's launches, the same every step: encode the batch, the MLP's forward
        and backward, the tables' gradient, the MLP's and the tables' updates, the bookkeeping."""
        encoded = self._run["encoded"]
        self._encode(kin, rows, encoded, row_map)
        ws, loss_slots = self._forward_backward(encoded, dy, rows)
        self._grid_gradients(ws["din"], self.k_in, kin, rows, row_map)
        for i in reversed(range(self.n_layers)):
            n_chunks, pw, pb = self._layer_grads(ws, i)
            self._optimize_layer(i, 0, n_chunks, pw, pb)
        self._optimize_tables(0)
        self._launch("mlp_finish_step", (1,), (FINISH_THREADS,),
                     (loss_slots, np.int32(loss_slots.size), self._run["losses"], self.ctl, np.int32(rows),
                      np.int64(dataset_rows)))

    def _grid_batch(self, x: Any, y: Any) -> tuple[Any, Any, int]:
        kin, _ = self._kernel_input(x)
        dy, _ = super()._device_input(y, self.spec.n_output_dims, "target", encode=False)
        if dy.shape[0] != kin.shape[0]:
            raise InvalidInput(f"target has {dy.shape[0]} rows but input has {kin.shape[0]}")
        if kin.shape[0] == 0:
            raise InvalidInput("a training batch needs at least one row")
        return kin, dy, kin.shape[0]

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        kin, dy, rows = self._grid_batch(x, y)
        self._start_run(steps, EpochPosition(0))
        self._encoded_batch(rows)
        key = ("grid-batch", rows, kin.data.ptr, dy.data.ptr)
        self._replay(key, steps, lambda: self._grid_step(kin, None, dy, rows, 0))
        return self._finish_run(steps, rows)

    def train_epochs(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> np.ndarray:
        """See ``CompiledModel.train_epochs``: each step draws its batch of the epoch's order
        (``mlp_batch_rows``), encodes it from the dataset's kernel input through the row numbers
        and gathers its targets (``grid_gather_targets``), then trains as ``train_step``."""
        check_epoch_run(data, batch, steps)
        if not data.on_device:
            raise InvalidInput("this dataset is not on the cuda device (put_dataset keeps it there)")
        half_bits = epoch_half_bits(data.rows)
        rows_map, targets = self._epoch_buffers(batch)
        self._start_run(steps, position)
        self._encoded_batch(batch)
        y_half = np.int32(data.y.dtype == self.cp.float16)
        n_out = self.spec.n_output_dims

        def step() -> None:
            self._launch("mlp_batch_rows", (min(math.ceil(batch / 256), self.info["sm_count"] * 8),), (256,),
                         (np.int64(data.rows), np.int32(half_bits), self.ctl, np.int32(batch), rows_map))
            self._grid_launch("grid_gather_targets", (math.ceil(batch * n_out / ELEMENTWISE_THREADS),),
                              (ELEMENTWISE_THREADS,), (data.y, y_half, rows_map, np.int64(batch), np.int32(n_out),
                                                       targets))
            self._grid_step(data.x, rows_map, targets, batch, data.rows)

        key = ("grid-epochs", batch, data.rows, data.x.data.ptr, data.y.data.ptr, data.y.dtype.char)
        self._replay(key, steps, step)
        return self._finish_epochs(data, batch, steps, position)

    def _epoch_buffers(self, batch: int) -> tuple[Any, Any]:
        """A drawn batch's row numbers and gathered fp32 targets (one size kept at a time)."""
        cp = self.cp
        held = self._run.get("batch")
        if held is None or held[0].shape != (batch,):
            self._run["batch"] = None
            self._graphs.clear()
            try:
                held = self._run["batch"] = (cp.empty(batch, dtype=cp.int32),
                                             cp.empty((batch, self.spec.n_output_dims), dtype=cp.float32))
            except device_errors(cp) as exc:
                raise LaunchError(f"allocating a {batch}-row training batch failed: {exc}") from exc
        return held

    def parallel_start(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> Any:
        raise InvalidInput("data-parallel training of a grid-encoded model is not built on the cuda backend yet: "
                           "train it on one device")

    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        kin, dy, rows = self._grid_batch(x, y)
        encoded = self._encoded_batch(rows)
        self._encode(kin, rows, encoded)
        loss, grads = self._device_loss_and_grads(encoded, dy, rows)
        # the deltas and the first layer's weights are still this batch's: nothing was updated
        self._grid_gradients(self._workspace[self._rows_padded(rows)]["din"], self.k_in, kin, rows)
        values = self.download(self.table_grad)
        self.table_grad.fill(0)
        for p in self.grid_plan.parts:
            grads[f"grid{p.index}"] = values[p.offset:p.offset + p.entries * p.features].reshape(p.entries, p.features)
        return loss, grads

    # -- backward from an outside gradient --------------------------------------------------------------
    def forward_train(self, x: Any, out_dtype: Any = np.float32, stream: Any = None) -> tuple[Any, ForwardContext]:
        """See ``CompiledModel.forward_train``: the encoded input (training tables) kept for
        ``backward``, the forward on the training weights."""
        self._check_backward_model(False)
        with stream_scope(self.cp, stream):
            kin, from_host = self._kernel_input(x)
            rows = kin.shape[0]
            encoded = self._new_encoded(rows)
            self._encode(kin, rows, encoded, table=self._training_tables())
            out = self._forward_pairs(encoded, rows, self._half_out(out_dtype), (self.wimage, self.b_all))
        return (self.download(out) if from_host else out), self._forward_context(rows, (kin, encoded, from_host))

    def backward(self, ctx: ForwardContext, dL_dy: Any, want_input_grad: bool = False,
                 stream: Any = None) -> tuple[Any, dict[str, Any]]:
        """See ``CompiledModel.backward``: the LOSS_GIVEN training kernels from the kept encoded
        input, the layers' gradients, the tables' (tcnn's scatter into a fresh buffer) and, with
        ``want_input_grad``, every part's d loss / d input from d loss / d encoded input."""
        dx, grad_all, grad_b, from_host = self._backward_buffers(ctx, dL_dy, want_input_grad, stream)
        n_w = self.w_all.size
        grads = {**self._named_layer_grads(grad_all[:n_w], grad_b), **self._named_tables(grad_all[n_w:])}
        if from_host:
            return (None if dx is None else self.download(dx)), {k: self.download(v) for k, v in grads.items()}
        return dx, grads

    def _backward_buffers(self, ctx: ForwardContext, dL_dy: Any, want_input_grad: bool,
                          stream: Any) -> tuple[Any, Any, Any, bool]:
        """(d loss / d input or None, the weights' gradients then the tables' in one flat buffer
        (the masters' padded layout, then the tables'), the biases' gradients, whether the
        forward's input came from the host)."""
        self._check_backward_model(want_input_grad)
        self.check_forward_context(ctx, dL_dy)
        kin, encoded, from_host = ctx.state
        rows, cp = ctx.rows, self.cp
        n_w = self.w_all.size
        with stream_scope(cp, stream):
            dy = self._gradient_rows(dL_dy, rows)
            try:
                grad_all = cp.zeros(n_w + self.grid_plan.values, dtype=cp.float32)
                grad_b = cp.zeros(self.b_all.size, dtype=cp.float32)
                dx = cp.zeros((rows, self.spec.n_input_dims), dtype=cp.float32) if want_input_grad else None
            except device_errors(cp) as exc:
                raise LaunchError(f"allocating the gradient buffers failed: {exc}") from exc
            if rows:  # (no rows: nothing to launch, every gradient 0)
                ws, _ = self._forward_backward(encoded, dy, rows, given=True)
                self._gradients_into(ws, grad_all[:n_w], grad_b)
                self._grid_gradients(ws["din"], self.k_in, kin, rows, into=grad_all[n_w:])
                if want_input_grad:
                    self._input_gradient(ws["din"], self.k_in, kin, rows, dx)
        return dx, grad_all, grad_b, from_host

    def _named_tables(self, flat: Any) -> dict[str, Any]:
        """``grid{k}`` views of a flat buffer laid out as the tables (every part back to back)."""
        return {f"grid{p.index}": flat[p.offset:p.offset + p.entries * p.features].reshape(p.entries, p.features)
                for p in self.grid_plan.parts}

    def _input_gradient(self, din: Any, din_cols: int, kin: Any, rows: int, dx: Any) -> None:
        """Enqueue d loss / d input of every part, added into ``dx``, from the loss-scaled d loss /
        d encoded input ``din`` (row-major, fp16: the training kernels'; ``din_cols`` a row)."""
        inv_scale = np.float32(1.0 / self.spec.loss_scale)
        plan, table = self.grid_plan, self._training_tables()
        for p in plan.parts:
            if plan.input_gradient(p):
                self._grid_launch(f"grid_input_grad_{p.index}", (math.ceil(rows / GRID_THREADS),), (GRID_THREADS,),
                                  (din, np.int32(din.dtype.itemsize == 2), np.int32(din_cols), kin, np.int64(rows),
                                   np.int32(plan.input_cols), table[p.offset:], inv_scale, dx))
        launch_backward(self._grid_launch, plan.free, kin, rows, plan.input_cols, din, din_cols, inv_scale, dx)

    # -- datasets: the raw input, encoded by each step -----------------------------------------------------
    def _dataset_input_layout(self, x_dtype: Any) -> tuple[int, np.dtype]:
        """The raw input, fp32 (grid positions need its precision)."""
        return self.grid_plan.input_cols, np.dtype(np.float32)

    def _dataset_inputs(self, cx: np.ndarray, xd: np.dtype) -> np.ndarray:
        return np.ascontiguousarray(cx, dtype=np.float32)

    # -- parameters and optimizer state ------------------------------------------------------------------
    def _tables_of(self, flat: Any) -> dict[str, np.ndarray]:
        values = self.download(flat)
        return {f"grid{p.index}": values[p.offset:p.offset + p.entries * p.features].reshape(p.entries, p.features)
                for p in self.grid_plan.parts}

    def _upload_tables(self, flat: Any, named: dict[str, np.ndarray], dtype: Any = np.float32) -> None:
        host = np.empty(self.grid_plan.values, dtype=dtype)
        for p in self.grid_plan.parts:
            host[p.offset:p.offset + p.entries * p.features] = np.asarray(named[f"grid{p.index}"]).ravel()
        try:
            flat.set(host)
        except device_errors(self.cp) as exc:
            raise LaunchError(f"uploading the grid tables failed: {exc}") from exc

    def get_params(self) -> dict[str, np.ndarray]:
        return {**super().get_params(), **self._tables_of(self.tables)}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        params = check_params(self.spec, params)
        super().set_params(params)  # bumps params_version
        self._upload_tables(self.tables, params)
        self._optimize_tables(2)

    def _read_slot(self, slot: int) -> dict[str, np.ndarray]:
        return {**super()._read_slot(slot), **self._tables_of(self.table_slots[slot])}

    def _write_slots(self, slots: list[dict[str, np.ndarray]], step: int) -> None:
        super()._write_slots(slots, step)
        for flat, values in zip(self.table_slots, slots):
            self._upload_tables(flat, values)
        if self.table_eimage is not None:
            self._optimize_tables(3)

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        """The contract's state plus, under Adam, ``steps.grid{k}``: each table value's step count."""
        state = super().get_optimizer_state()
        if self.spec.optimizer.otype == "Adam":
            steps = self.download(self.table_steps)
            for p in self.grid_plan.parts:
                state[f"steps.grid{p.index}"] = steps[p.offset:p.offset + p.entries * p.features].reshape(
                    p.entries, p.features)
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what ``get_optimizer_state`` returned; without ``steps.grid{k}`` (a state
        another backend wrote) the counts follow from Adam's moments (grid_steps_from_state)."""
        super().set_optimizer_state(state)
        if self.spec.optimizer.otype == "Adam":
            self._upload_tables(self.table_steps, {
                f"grid{p.index}": grid_steps_from_state(state, f"grid{p.index}", (p.entries, p.features),
                                                        self.step_count) for p in self.grid_plan.parts}, np.uint32)

    def device_bytes(self) -> int:
        arrays = [self.tables, self.table_grad, self.table_image, self.table_steps, *self.table_slots]
        arrays += [a for a in (self.table_eimage, self._run.get("encoded"), self._run.get("grid_lr")) if a is not None]
        return super().device_bytes() + int(sum(a.nbytes for a in arrays))

    def close(self) -> None:
        super().close()
        for name in ("tables", "table_grad", "table_image", "table_slots", "table_steps", "table_eimage"):
            if hasattr(self, name):
                delattr(self, name)


__all__ = ["CudaGridModel", "GridPlan"]
