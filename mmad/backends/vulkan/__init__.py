"""vulkan backend: fused MLP training and inference through Vulkan compute (GLSL → SPIR-V).

Three variants share the host code (:mod:`.runtime`), the buffers and the kernels for the
loss and optimizer; they differ in the fused forward/backward and weight-gradient kernels:

* ``simt`` — any Vulkan 1.2 device: shared-memory tile products with 4×4 register tiles.
* ``coopmat`` — ``VK_KHR_cooperative_matrix`` with an fp16×fp16→fp32 subgroup shape; the
  tile shape comes from the probed list (``shaders/glsl/coopmat_*.comp``).
* ``coopmat2`` — ``VK_NV_cooperative_matrix2``: workgroup-scope matrices of a whole tile and layer,
  flexible dimensions, conversions and tensor addressing (``shaders/glsl/coopmat2_*.comp``, compiled
  by the glslang inside slangpy); ``coopmat2_plan`` sizes its tiles from the probed shapes.

Numerics (the contract in ``mmad/backends/contract.py``): activations, deltas and the weight copies
the kernels multiply are rounded to fp16 — simt in fp32 storage, with an exact integer
round-to-nearest-even (``r16`` in ``mlp_common.glsl``) so that the result does not depend on
the device having ``shaderFloat16``/16-bit storage (lavapipe has neither in every version);
coopmat (which needs both) stores training's activations and deltas as fp16;
every product accumulates in fp32; bias and activation act on the fp32 accumulator; the output
layer stays fp32. Masters and Adam/SGD state are fp32 on the device; the fp16 copies (two
layouts: transposed for forward, plain for backward) are refreshed by the optimizer kernel.
Encodings without parameters run on the host (``CompiledModel.encode``) before upload. The grid
encodings (HashGrid, DenseGrid, TiledGrid; both variants) run on the device (``shaders/glsl/grid.comp``):
a kernel input of raw dims and host-encoded columns is encoded on the device before the forward,
the backward runs on through the first layer, and the tables' gradients are fp32 atomic adds where
the device offers them (tcnn's scatter), else a sort and a gather (deterministic; ``GRID_GRADIENT_ENV``
asks for either); the tables follow the MLP's parameters in the flat buffers.
Rows are padded to a multiple of ``ROW_ALIGN`` internally; padded rows get zero gradients and
never reach the caller.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmad.backends import numerics as nm
from mmad.backends.numerics import batches_per_epoch, epoch_half_bits
from mmad.backends.cache import KernelCache, build_all
from mmad.backends.encodings import GridPart, grid_input_layout
from mmad.backends.contract import (
    Backend, CompiledModel, Dataset, DeviceInfo, EpochPosition, MMAShape, ProbeRow, check_device_index, check_epoch_run,
    check_finite_rows, check_host_output, check_params, fill_dataset,
    check_rows, check_rows_shape, init_params, optimizer_slots, output_dtype, param_shapes,
)
from mmad.backends.cpu import copy_rows
from mmad.backends.vulkan.glsl import GLSLANG, SLANG_GLSLANG, build_spirv
from mmad.backends.vulkan import runtime as vr
from mmad.errors import BackendUnavailable, CompileError, InvalidInput, LaunchError, MMADError, SpecError
from mmad.shaders import read_source
from mmad.spec import ACTIVATION_CODES, LOSS_CODES, MLPSpec, kernel_code_defines

log = logging.getLogger("mmad.vulkan")

VARIANTS = ("coopmat2", "coopmat", "simt")  # best first
# the variants whose kernels multiply with cooperative matrices: fp16 operands, fp16 weight copies,
# training's fp16 activations and deltas (the same buffers for both)
COOPERATIVE = ("coopmat2", "coopmat")
# kernel -> (storage buffers, push-constant bytes); the coopmat forward and backward also bind
# the fp16 hidden activations, and coopmat training runs its own forward pipeline
PIPELINE_INTERFACE = {"forward": (5, 24), "backward": (5, 44), "wgrad": (4, 28), "optimizer": (13, 20),
                      "finalize": (2, 16), "gather": (5, 48)}
COOPMAT_INTERFACE = {**PIPELINE_INTERFACE, "forward": (6, 24), "forward_train": (6, 24), "backward": (6, 44)}
# kernels whose work is divided by subgroup (gl_SubgroupID, THREADS = subgroups x the probed size):
# their pipelines require that subgroup size where the device lets them (VK_EXT_subgroup_size_control)
SUBGROUP_SIZED = {"coopmat": ("forward", "forward_train", "backward", "wgrad")}
# coopmat_forward.comp's specialization constant that makes its training pipeline
TRAINING_CONSTANT = 14
# mlp_common.glsl's INPUT_F16 / OUTPUT_F16: the kernels that read the input rows (forward, layer
# 0's weight gradient) or write the output (forward) specialised for fp16 device arrays
INPUT_F16_CONSTANT, OUTPUT_F16_CONSTANT = 17, 18
# the grid kernels (grid.comp, grid_sort.comp), the same for both variants
GRID_KERNELS = {"grid_encode": (3, 4), "grid_keys": (4, 16), "grid_gather": (5, 16), "grid_sort": (2, 12),
                "grid_sort_block": (2, 12), "grid_scatter": (3, 12), "grid_zero": (1, 4)}
# a grid model's table gradient sorts at most this many table reads (rows x levels x corners) at
# once: the batch's rows are taken in chunks of that many reads, each chunk's sums added
MAX_GRID_LOOKUPS = 1 << 22
SORT_BLOCK = 512  # grid_sort.comp: the reads one workgroup sorts in shared memory (its SORT_BLOCK)
_INTERP_CODES = {"Linear": 0, "Nearest": 1, "Smoothstep": 2}
_MODE_CODES = {"dense": 0, "hash": 1, "zero": 2}
# hidden activations whose derivative depends only on z > 0: the coopmat kernels then keep no
# fp32 hidden pre-activations, only the fp16 activations with that bit (flag_nonpositive)
SIGN_DERIVATIVE_ACTIVATIONS = ("None", "ReLU", "LeakyReLU")
ROW_ALIGN = 128
HIST_CAP = 1024
BIAS_ROWS = 16  # biases are stored row-replicated so a coopmat accumulator can load them  # loss history slots in the control block: steps per submission
COOPMAT_ENV = "MMAD_VULKAN_COOPMAT"
# the most subgroups a coopmat workgroup may have (4, 8 or 16; coopmat_tiling)
COOPMAT_SUBGROUPS_ENV = "MMAD_VULKAN_COOPMAT_SUBGROUPS"
# 1: open the device with VK_KHR_pipeline_executable_properties (compiler statistics per kernel)
PIPELINE_STATS_ENV = "MMAD_VULKAN_PIPELINE_STATS"
# 1: bake activations/loss into each pipeline (default on GPUs); 0: push constants, shared
# pipelines (default on software devices, where each pipeline costs seconds of LLVM time)
SPECIALIZE_ENV = "MMAD_VULKAN_SPECIALIZE"
# how a grid model's table gradient is summed: "atomic" (fp32 atomicAdd, tiny-cuda-nn's scatter;
# the default where the device offers shaderBufferFloat32AtomicAdd) or "sorted" (the reads sorted
# by table row and summed in a fixed order: bit-identical repeats, on every device)
GRID_GRADIENT_ENV = "MMAD_VULKAN_GRID_GRADIENT"
GRID_GRADIENTS = ("atomic", "sorted")
# NVIDIA's cooperative extensions beyond VK_KHR_cooperative_matrix and their GLSL extensions: the
# probe says whether the device offers each and why no variant uses it
NV_COOPERATIVE_EXTENSIONS = {"VK_NV_cooperative_matrix2": "GL_NV_cooperative_matrix2",
                             "VK_NV_cooperative_vector": "GL_NV_cooperative_vector"}
# shape families the coopmat kernels are written for (M, N, K), best first
COOPMAT_FAMILIES = [(16, 16, 16), (16, 8, 16), (8, 16, 16), (8, 8, 16), (8, 8, 8)]


# -- coopmat2 (VK_NV_cooperative_matrix2) ----------------------------------------------------
COOPMAT2_ENV = "MMAD_VULKAN_COOPMAT2"  # 0: the coopmat2 variant off (its probe row says so)
# "BMxTHREADS": the forward/backward tile (rows, workgroup invocations) instead of the planner's;
# "TNxTKxBK": the weight-gradient tile and rows a step. For measurements (docs/vulkan.md).
COOPMAT2_TILE_ENV = "MMAD_VULKAN_COOPMAT2_TILE"
COOPMAT2_WGRAD_ENV = "MMAD_VULKAN_COOPMAT2_WGRAD_TILE"
# the extension's features the kernels use: matrices of a whole workgroup, of our layers' sizes,
# an accumulator turned into the next operand, and loads/stores through tensor layouts
COOPMAT2_FEATURES = ("cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                     "cooperativeMatrixConversions", "cooperativeMatrixTensorAddressing")
COOPMAT2_GLSL = "GL_NV_cooperative_matrix2"
# the coopmat2 kernels (the rest of a model's kernels are every variant's, compiled by cmeel's glslang)
COOPMAT2_KERNELS = ("forward", "forward_train", "backward", "wgrad")
# fp32 accumulator values a thread holds for a tile's widest layer (a BM x width matrix over the
# workgroup): with the A operand and the weights' fragments that stays clear of spilling
COOPMAT2_ACC_BUDGET = 64
COOPMAT2_ROWS = (128, 64, 32, 16)  # tile rows, most first (ROW_ALIGN is a multiple of each)
COOPMAT2_WGRAD_SIDES = (128, 64, 32, 16)
COOPMAT2_WGRAD_STEP = 64  # rows a weight-gradient step (the batch splits are multiples of 64 rows)


def usable_coopmat2_shapes(shapes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The flexible-dimension shapes the coopmat2 kernels can use: fp16 x fp16 + fp32 -> fp32,
    workgroup scope, not saturating; most invocations first (a tile's rows share each weight read)."""
    usable = [s for s in shapes if (s["a"], s["b"], s["c"], s["result"], s["scope"]) ==
              ("f16", "f16", "f32", "f32", "workgroup") and not s.get("saturating") and s["workgroup_invocations"] > 0]
    return sorted(usable, key=lambda s: (-s["workgroup_invocations"], s["m"] * s["n"] * s["k"]))


@dataclass(frozen=True)
class Coopmat2Plan:
    """Tiles of the coopmat2 kernels for one model on one device: ``rows`` (BM) rows per workgroup
    of ``threads`` invocations in the forward and backward (every layer one BM x width matrix),
    and the weight gradients' TN x TK tile of dW over BK batch rows a step; widths padded to the
    shape's granularity (``in_pad``, ``out_pad``)."""

    granularity: tuple[int, int, int]
    threads: int
    rows: int
    wgrad: tuple[int, int, int]
    in_pad: int
    out_pad: int
    delta_stride: int  # halves a row of the backward's shared fp16 tile (output deltas, grid input gradients)

    @property
    def shared_bytes(self) -> int:
        """The backward's shared memory (the forward and weight gradients declare none)."""
        return 2 * self.rows * self.delta_stride + 4 * self.threads

    def header(self) -> list[str]:
        """The kernels' #defines (CM_M/N/K: the granularity, which optimizer.comp's fp16 copies test for)."""
        tn, tk, bk = self.wgrad
        m, n, k = self.granularity
        return [f"#define BM {self.rows}", f"#define DS {self.delta_stride}", f"#define TN {tn}",
                f"#define TK {tk}", f"#define BK {bk}", f"#define BIAS_N {math.lcm(16, n)}",
                f"#define CM_M {m}", f"#define CM_N {n}", f"#define CM_K {k}"]


def _parse_tile(env: str, parts: int) -> tuple[int, ...] | None:
    asked = os.environ.get(env, "").strip().lower()
    if not asked:
        return None
    try:
        values = tuple(int(v) for v in asked.split("x"))
    except ValueError:
        values = ()
    if len(values) != parts or min(values) <= 0:
        raise SpecError(env, f"must be {'x'.join(['N'] * parts)} with positive integers; got {asked!r}")
    return values


def coopmat2_plan(spec: MLPSpec, shapes: list[dict[str, Any]], properties: dict[str, int], max_shared: int,
                  max_invocations: int, grid: bool = False) -> Coopmat2Plan:
    """The coopmat2 tiles for ``spec`` (see Coopmat2Plan), from the device's flexible-dimension
    ``shapes`` and VK_NV_cooperative_matrix2 ``properties``. Every matrix dimension is a multiple of
    the shape's granularity and at most the extension's largest dimension; the workgroup is one
    shape's invocation count (256 preferred); the tile keeps the most rows (up to ROW_ALIGN) whose
    widest layer costs a thread at most COOPMAT2_ACC_BUDGET accumulator values and whose backward
    tile fits shared memory beside what the driver reserves for workgroup-scope matrices.
    SpecError (naming the field) where the model cannot run on coopmat2."""
    usable = usable_coopmat2_shapes(shapes)
    max_dim = properties.get("cooperativeMatrixFlexibleDimensionsMaxDimension", 0) or 1 << 16
    max_group = min(max_invocations, properties.get("cooperativeMatrixWorkgroupScopeMaxWorkgroupSize", 0)
                    or max_invocations)
    reserved = properties.get("cooperativeMatrixWorkgroupScopeReservedSharedMemory", 0)
    asked = _parse_tile(COOPMAT2_TILE_ENV, 2)
    usable = [s for s in usable if s["workgroup_invocations"] <= max_group
              and (asked is None or s["workgroup_invocations"] == asked[1])]
    if not usable:
        raise SpecError(COOPMAT2_TILE_ENV if asked else "variant",
                        "no fp16*fp16+fp32 workgroup-scope shape of VK_NV_cooperative_matrix2 "
                        + (f"has {asked[1]} invocations" if asked else f"fits {max_group} invocations"))
    shape = usable[0]
    gm, gn, gk = shape["m"], shape["n"], shape["k"]
    threads = shape["workgroup_invocations"]
    step = math.lcm(16, gn, gk)  # every width is an M/N/K somewhere: forward, backward, weight gradients
    in_pad, out_pad = _round_up(spec.n_encoded_dims, step), _round_up(spec.n_output_dims, step)
    if spec.n_neurons % step:
        raise SpecError("network.n_neurons", f"vulkan:coopmat2 on this device needs a multiple of {step}; "
                                             f"got {spec.n_neurons}")
    for field_name, width in (("encoding", in_pad), ("network.n_neurons", spec.n_neurons), ("n_output_dims", out_pad)):
        if width > max_dim:
            raise SpecError(field_name, f"a layer {width} wide exceeds the {max_dim} of this device's "
                                        "cooperative matrices (VK_NV_cooperative_matrix2) for vulkan:coopmat2")
    widest = max(in_pad, spec.n_neurons, out_pad)
    delta_stride = max(out_pad, in_pad if grid else 0) + 8
    rows_options = [asked[0]] if asked else list(COOPMAT2_ROWS)
    rows = next((r for r in rows_options if r % gm == 0 and r <= max_dim and ROW_ALIGN % r == 0
                 and (asked or r * widest <= COOPMAT2_ACC_BUDGET * threads)
                 and 2 * r * delta_stride + 4 * threads + reserved <= max_shared), None)
    if rows is None:
        raise (SpecError(COOPMAT2_TILE_ENV, f"{asked[0]} rows: not a multiple of {gm} dividing {ROW_ALIGN}, or "
                                            "its backward tile exceeds shared memory") if asked else
               SpecError("n_output_dims" if out_pad == widest else "encoding",
                         f"no coopmat2 tile of {gm} or more rows fits a layer {widest} wide in {max_shared} bytes "
                         f"of shared memory ({reserved} reserved for workgroup-scope matrices)"))
    wgrad = _parse_tile(COOPMAT2_WGRAD_ENV, 3)
    if wgrad is None:
        side = next((t for t in COOPMAT2_WGRAD_SIDES if t <= widest and t * t <= COOPMAT2_ACC_BUDGET * threads
                     and t % gm == 0 and t % gn == 0), None)
        step_rows = next((b for b in (COOPMAT2_WGRAD_STEP, 32, 16) if b % gk == 0), None)
        if side is None or step_rows is None:
            raise SpecError("variant", f"no weight-gradient tile of this device's {gm}x{gn}x{gk} granularity fits "
                                       "vulkan:coopmat2's kernels")
        wgrad = (side, side, step_rows)
    tn, tk, bk = wgrad
    if tn % gm or tk % gn or bk % gk or COOPMAT2_WGRAD_STEP % bk or max(wgrad) > max_dim:
        raise SpecError(COOPMAT2_WGRAD_ENV, f"{tn}x{tk}x{bk}: TN must be a multiple of {gm}, TK of {gn}, BK of {gk} "
                                            f"dividing {COOPMAT2_WGRAD_STEP}, all at most {max_dim}")
    return Coopmat2Plan((gm, gn, gk), threads, rows, wgrad, in_pad, out_pad, delta_stride)


def coopmat_subgroups_cap() -> int:
    """The most subgroups a coopmat workgroup may have (COOPMAT_SUBGROUPS_ENV, default 16); 4
    gives the layout of four column subgroups for every width (benchmarks compare the two)."""
    asked = os.environ.get(COOPMAT_SUBGROUPS_ENV, "").strip()
    if not asked:
        return 16
    if asked not in ("4", "8", "16"):
        raise SpecError(COOPMAT_SUBGROUPS_ENV, f"must be 4, 8 or 16; got {asked!r}")
    return int(asked)


# what a model compiled without a variant takes, best first: coopmat2 only when named (on the H200
# it ran 0.7-1.1x coopmat on S/M/L and 0.3x on W, and needs widths in multiples of 32: docs/vulkan.md)
AUTOMATIC = ("coopmat", "simt")


def variant_choices(spec: MLPSpec) -> tuple[str, ...]:
    """The variants that compute ``spec`` as its precision says, best first: the cooperative
    matrices multiply fp16 operands, so a precision fp32 model runs on simt only."""
    return ("simt",) if spec.precision == "fp32" else VARIANTS


def pipeline_interface(variant: str, grid: bool) -> dict[str, tuple[int, int]]:
    """(storage buffers, push-constant bytes) of each kernel of a model: a grid model's backward
    also writes d loss / d encoded input, its optimizer steps the tables too, and it has the grid
    kernels."""
    interface = dict(COOPMAT_INTERFACE if variant in COOPERATIVE else PIPELINE_INTERFACE)
    if grid:
        n_bind, push = interface["backward"]
        interface.update(GRID_KERNELS, backward=(n_bind + 1, push), optimizer=(17, 20))
    return interface


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def usable_coopmat_shapes(shapes: list[dict[str, Any]]) -> list[tuple[int, int, int]]:
    """fp16×fp16→fp32 subgroup shapes of the probed list that a kernel family covers, best first."""
    have = {(s["m"], s["n"], s["k"]) for s in shapes
            if s["a"] == "f16" and s["b"] == "f16" and s["c"] == "f32" and s["result"] == "f32"
            and s["scope"] == "subgroup"}
    return [f for f in COOPMAT_FAMILIES if f in have]


# -- grid encodings ------------------------------------------------------------------------
@dataclass(frozen=True)
class GridLayout:
    """A grid model's kernel input and tables: the raw input dims, then the host-encoded columns
    of the parameter-free parts (``host``: (first encoded column, width, column in the kernel
    input)), ``x_cols`` columns padded to ``x_pad``; the grid parts and their tables' values."""

    parts: tuple[GridPart, ...]
    host: tuple[tuple[int, int, int], ...]
    x_cols: int

    @property
    def x_pad(self) -> int:
        return _round_up(self.x_cols, 4)

    @property
    def table_values(self) -> int:
        return sum(g.entries * g.features for g in self.parts)

    @property
    def max_lookups(self) -> int:
        return max(g.lookups for g in self.parts)

    @classmethod
    def build(cls, spec: MLPSpec) -> "GridLayout | None":
        if not spec.grid_shapes:
            return None
        return cls(*grid_input_layout(spec))

    def header(self, mlp_params: int, in_pad: int) -> str:
        """``#define``s and constant arrays of grid.comp (and GRID_PARTS / MLP_PARAMS, which the
        backward and the optimizer test); ``in_pad``: the columns of the first layer's input, of
        which the encode writes the grid parts' per level and every other column (host-encoded or
        padding) one by one."""
        def array(name: str, kind: str, values: list) -> str:
            values = values or [0]  # GLSL has no empty arrays
            return f"const {kind} {name}[{len(values)}] = {kind}[{len(values)}]({', '.join(map(str, values))});"
        levels = [lv for g in self.parts for lv in g.levels]
        modes = [m for g in self.parts for m in g.modes]
        level0 = [sum(len(g.levels) for g in self.parts[:k]) for k in range(len(self.parts))]
        grid_cols = {g.column + j for g in self.parts for j in range(len(g.levels) * g.features)}
        others = [c for c in range(in_pad) if c not in grid_cols]
        lines = [f"#define GRID_PARTS {len(self.parts)}", f"#define HOST_PARTS {len(self.host)}",
                 f"#define MLP_PARAMS {mlp_params}", f"#define X_COLS {self.x_pad}",
                 f"#define MAX_FEATURES {max(g.features for g in self.parts)}",
                 f"#define GRID_TOTAL_LEVELS {len(levels)}", f"#define OTHER_COLS {len(others)}",
                 array("OTHER_COLUMN", "int", others),
                 array("GRID_BEGIN", "int", [g.begin for g in self.parts]),
                 array("GRID_DIMS", "int", [g.dims for g in self.parts]),
                 array("GRID_COLUMN", "int", [g.column for g in self.parts]),
                 array("GRID_LEVELS", "int", [len(g.levels) for g in self.parts]),
                 array("GRID_LEVEL0", "int", level0),
                 array("GRID_FEATURES", "int", [g.features for g in self.parts]),
                 array("GRID_CORNERS", "int", [g.corners for g in self.parts]),
                 array("GRID_INTERP", "int", [_INTERP_CODES[g.interpolation] for g in self.parts]),
                 array("GRID_TABLE", "int", [g.offset for g in self.parts]),
                 array("GRID_ENTRIES", "int", [g.entries for g in self.parts]),
                 # the float32 scale as its exact decimal value (parsed without a second rounding)
                 array("LV_SCALE", "float", [repr(float(np.float32(lv.scale))) for lv in levels]),
                 array("LV_RES", "uint", [f"{lv.resolution}u" for lv in levels]),
                 array("LV_START", "uint", [f"{lv.offset}u" for lv in levels]),
                 array("LV_ROWS", "uint", [f"{lv.entries}u" for lv in levels]),
                 array("LV_MODE", "uint", [f"{_MODE_CODES[m]}u" for m in modes]),
                 array("HOST_COLUMN", "int", [h[0] for h in self.host]),
                 array("HOST_WIDTH", "int", [h[1] for h in self.host]),
                 array("HOST_SRC", "int", [h[2] for h in self.host])]
        return "\n".join(lines) + "\n"


MAX_ACCUMULATORS = 8  # coopmat accumulator blocks per subgroup (registers: 8 x 16 x 16 fp32 = 32 a thread)
MIN_SUBGROUPS = 4


def coopmat_tiling(kmax: int, shape: tuple[int, int, int], subgroup_size: int, max_shared: int,
                   max_threads: int = 512, max_subgroups: int = 16) -> tuple[int, int, int] | None:
    """(rows per tile R, SG_COLS, SG_ROWS) of the coopmat kernels: subgroup s owns column blocks
    s % SG_COLS + j * SG_COLS (NCJ of them at the widest layer) over R / CM_M / SG_ROWS row blocks
    (its row group s / SG_COLS). Each weight block is read from global memory once per subgroup
    and reused for every row block it owns, so the tile takes as many rows as fit (up to
    ROW_ALIGN; the activation tile, R x (KMAX + 8) halves, in shared memory) with at most
    MAX_ACCUMULATORS blocks per subgroup; wide layers get more subgroups side by side rather than
    fewer rows (L, W: 8 column subgroups instead of 4 doubles R). Among the layouts of that R: the
    most accumulators a subgroup, then the fewest threads, then the fewest row groups. Subgroup
    counts are powers of two (the backward's loss reduction halves THREADS), at least
    MIN_SUBGROUPS, at most ``max_subgroups`` and ``max_threads`` / subgroup_size. None: no tile fits."""
    m_cm, n_cm, _ = shape
    col_blocks = kmax // n_cm
    rows = ROW_ALIGN
    while rows >= m_cm:
        options = []
        row_blocks = rows // m_cm
        sg_cols = 1
        while sg_cols <= max(col_blocks, MIN_SUBGROUPS):
            sg_rows = 1
            while sg_rows <= row_blocks:
                subgroups, threads = sg_cols * sg_rows, sg_cols * sg_rows * subgroup_size
                nacc = row_blocks // sg_rows * math.ceil(col_blocks / sg_cols)
                if (nacc <= MAX_ACCUMULATORS and MIN_SUBGROUPS <= subgroups <= max_subgroups
                        and threads <= max_threads and 2 * rows * (kmax + 8) + 4 * threads <= max_shared):
                    options.append((-nacc, threads, sg_rows, sg_cols))
                sg_rows *= 2
            sg_cols *= 2
        if options:
            _, _, sg_rows, sg_cols = min(options)
            return rows, sg_cols, sg_rows
        rows //= 2
    return None


def sort_items(reads: int) -> int:
    """The bitonic sort's length for ``reads`` table reads: the next power of two, at least one
    shared-memory block."""
    return max(SORT_BLOCK, 1 << (max(reads, 1) - 1).bit_length())


def grid_gradient(info: vr.DeviceInfo) -> str:
    """How a grid model's table gradient is summed on this device (GRID_GRADIENT_ENV): "atomic"
    where it offers shaderBufferFloat32AtomicAdd, else "sorted"; a choice the device cannot run
    is refused, never replaced."""
    asked = os.environ.get(GRID_GRADIENT_ENV, "").strip()
    if asked and asked not in GRID_GRADIENTS:
        raise SpecError(GRID_GRADIENT_ENV, f"must be one of {', '.join(GRID_GRADIENTS)}; got {asked!r}")
    if asked == "atomic" and not info.float32_atomic_add:
        raise BackendUnavailable("vulkan", f"{GRID_GRADIENT_ENV}=atomic: {info.name} does not offer "
                                           f"shaderBufferFloat32AtomicAdd ({vr.ATOMIC_FLOAT_EXT})")
    return asked or ("atomic" if info.float32_atomic_add else "sorted")


def check_tables_fit(spec: MLPSpec, geometry: "Geometry", max_storage_range: int) -> None:
    """Every parameter buffer (masters, moments, gradients) is bound whole: refuse (SpecError, in
    the config's terms) a model whose layers and grid tables exceed maxStorageBufferRange."""
    if geometry.grid is None:
        return
    values = geometry.n_values
    if values * 4 > max_storage_range:
        raise SpecError("encoding", f"the layers and grid tables hold {values:,} values; this device binds at most "
                                    f"{max_storage_range // 4:,} fp32 values in one buffer (maxStorageBufferRange): "
                                    "use a smaller log2_hashmap_size or fewer levels on vulkan")


# -- model geometry ------------------------------------------------------------------------
@dataclass
class Geometry:
    """Padded shapes, buffer offsets and tiling of one model on one device (and variant)."""

    spec: MLPSpec
    threads: int
    rows_per_tile: int
    kmax: int
    mtpt: int      # simt: 4x4 micro-tiles per invocation
    wchunk: int    # elements of the shared weight chunk (fp32 for simt, fp16 for coopmat)
    in_pad: int
    out_pad: int
    k: list[int]
    n: list[int]
    coopmat: tuple[int, int, int] | None = None
    nacc: int = 0  # coopmat: accumulator blocks per subgroup
    subgroups: int = 0
    micro_rows: int = 4  # simt: rows of an invocation's register tile
    act_stride: int = 0  # coopmat: row stride of the shared activation tile (fp16 elements)
    ncj: int = 0         # coopmat: column blocks per subgroup at the widest layer
    sg_cols: int = 0     # coopmat: subgroups side by side over the columns (SG_COLS; coopmat_tiling)
    grid: GridLayout | None = None  # grid models: the kernel input and the tables
    coopmat2: Coopmat2Plan | None = None  # coopmat2: its tiles (coopmat is then the shape's granularity)

    def __post_init__(self) -> None:
        if self.grid is None:
            self.grid = GridLayout.build(self.spec)

    @property
    def x_pad(self) -> int:
        """Columns of a row of the kernels' input buffer: the encoded input padded (IN_PAD), or
        for grid models the kernel input (raw dims and host-encoded columns) padded to 4."""
        return self.grid.x_pad if self.grid else self.in_pad

    @property
    def n_values(self) -> int:
        """Every parameter value the flat buffers hold: the MLP's, then the grid tables'."""
        return self.n_params + (self.grid.table_values if self.grid else 0)

    @classmethod
    def build(cls, spec: MLPSpec, max_shared: int, coopmat: tuple[int, int, int] | None = None,
              subgroup_size: int = 32, max_threads: int = 512, max_subgroups: int = 16,
              coopmat2: Coopmat2Plan | None = None) -> "Geometry":
        """simt by default; ``coopmat``: the KHR kernels' subgroup shape; ``coopmat2``: that
        variant's plan (coopmat2_plan)."""
        in_pad = coopmat2.in_pad if coopmat2 else _round_up(spec.n_encoded_dims, 16)
        out_pad = coopmat2.out_pad if coopmat2 else _round_up(spec.n_output_dims, 16)
        k = [in_pad] + [spec.n_neurons] * spec.n_hidden_layers
        n = [spec.n_neurons] * spec.n_hidden_layers + [out_pad]
        kmax = max(k + n)
        if coopmat2 is not None:  # weights from the fp16 copy in global memory, no shared chunk
            return cls(spec, coopmat2.threads, coopmat2.rows, kmax, 0, 0, in_pad, out_pad, k, n,
                       coopmat2.granularity, coopmat2=coopmat2)
        too_wide = SpecError("n_output_dims" if out_pad == kmax else "encoding",
                             f"a layer {kmax} wide does not fit the vulkan kernels' shared memory "
                             f"({max_shared} bytes)")
        if coopmat is not None:
            tiling = coopmat_tiling(kmax, coopmat, subgroup_size, max_shared, max_threads, max_subgroups)
            if tiling is None:
                raise too_wide
            rows, sg_cols, sg_rows = tiling
            ncj = math.ceil(kmax // coopmat[1] / sg_cols)
            threads = sg_cols * sg_rows * subgroup_size
            nacc = rows // coopmat[0] // sg_rows * ncj
            # weights are read from the fp16 copy in global memory: no shared chunk (wchunk 0)
            return cls(spec, threads, rows, kmax, 0, 0, in_pad, out_pad, k, n, coopmat, nacc, sg_cols * sg_rows,
                       act_stride=kmax + 8, ncj=ncj, sg_cols=sg_cols)
        act_elems = 4096 if max_shared >= 48 * 1024 else 2048
        micro_rows = 8 if max_shared >= 48 * 1024 else 4  # register tile rows (MR)
        threads = act_elems // (4 * micro_rows)
        rows = 128
        while rows > micro_rows and rows * kmax > act_elems:
            rows //= 2
        act_bytes = 2 * rows * kmax * 4 + threads * 4
        wchunk = min(4096, (max_shared - act_bytes) // 4 // 4 * 4)
        # the weight chunk must hold at least 4 rows of the widest operand
        if wchunk < 4 * kmax:
            raise too_wide
        mtpt = math.ceil((rows // micro_rows) * (kmax // 4) / threads)
        return cls(spec, threads, rows, kmax, mtpt, wchunk, in_pad, out_pad, k, n, micro_rows=micro_rows)

    @property
    def shared_bytes(self) -> int:
        """Shared memory of the largest kernel (the fused forward/backward)."""
        if self.coopmat2:
            return self.coopmat2.shared_bytes
        if self.coopmat:
            return 2 * self.rows_per_tile * self.act_stride + 4 * self.threads
        return 2 * self.rows_per_tile * self.kmax * 4 + 4 * self.threads + 4 * self.wchunk

    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def wgrad_tile(self) -> tuple[int, int]:
        """(rows, columns) of dW a weight-gradient workgroup computes."""
        return self.coopmat2.wgrad[:2] if self.coopmat2 else (64, 64)

    @property
    def store_hidden_z(self) -> bool:
        """Whether training stores the hidden layers' fp32 pre-activations (simt always; coopmat
        where the hidden activation's derivative needs more than z's side of 0)."""
        return not self.coopmat or self.spec.activation not in SIGN_DERIVATIVE_ACTIVATIONS

    def training_row_bytes(self) -> dict[str, int]:
        """Bytes per row of each per-chunk training buffer: fp32 pre-activations ``z``, deltas
        ``d`` (fp16 on coopmat, fp32 on simt) and, on coopmat, the fp16 hidden activations ``h``."""
        if not self.coopmat:
            return {"z": 4 * self.z_cols, "d": 4 * self.z_cols}
        hidden = self.z_cols - self.out_pad
        return {"z": 4 * (self.z_cols if self.store_hidden_z else self.out_pad), "d": 2 * self.z_cols,
                "h": 2 * hidden}

    def chunk_rows(self, outer: int) -> int:
        """Weight rows per shared chunk for a layer whose rows are ``outer`` long."""
        step = 16 if self.coopmat else 4
        return max(step, self.wchunk // outer // step * step)

    def offsets(self) -> dict[str, list[int]]:
        wt, wr, b, zc, gw, gb, p = [], [], [], [], [], [], []
        w_total = sum(ki * ni for ki, ni in zip(self.k, self.n))
        pos = bias_pos = zcol = g = param = 0
        for i, (ki, ni) in enumerate(zip(self.k, self.n)):
            wt.append(pos)
            wr.append(w_total + pos)
            pos += ki * ni
            b.append(bias_pos)
            bias_pos += ni
            zc.append(zcol)
            zcol += ni
            gw.append(g)
            g += ki * ni
            gb.append(g)
            g += ni
            p.append(param)
            fan_in, fan_out = self.spec.layer_dims[i]
            param += fan_out * fan_in + fan_out
        return {"WT_OFF": wt, "WR_OFF": wr, "B_OFF": b, "Z_COL": zc, "GW_OFF": gw, "GB_OFF": gb,
                "P_OFF": p, "totals": [2 * w_total, bias_pos, zcol, g, param]}

    @property
    def weight_floats(self) -> int:
        return self.offsets()["totals"][0]

    @property
    def bias_floats(self) -> int:
        return self.offsets()["totals"][1]

    @property
    def z_cols(self) -> int:
        return self.offsets()["totals"][2]

    @property
    def grad_floats(self) -> int:
        return self.offsets()["totals"][3]

    @property
    def n_params(self) -> int:
        return self.offsets()["totals"][4]

    def header(self, with_params: bool = False) -> str:
        """``#define``s and constant arrays the kernels are specialised with.

        Only the optimizer needs the unpadded parameter layout (``with_params``): leaving it
        out of the others lets models of one padded geometry share their pipelines.
        """
        off = self.offsets()
        lines = [kernel_code_defines().rstrip("\n"), f"#define HIST_CAP {HIST_CAP}",
                 f"#define THREADS {self.threads}", f"#define R {self.rows_per_tile}",
                 f"#define KMAX {self.kmax}", f"#define N_LAYERS {self.n_layers}",
                 f"#define IN_PAD {self.in_pad}", f"#define OUT_PAD {self.out_pad}",
                 f"#define Z_COLS {self.z_cols}", f"#define BIAS_ROWS {BIAS_ROWS}"]
        if self.coopmat2:
            lines += [*self.coopmat2.header(), f"#define NN {self.spec.n_neurons}",
                      f"#define STORE_HIDDEN_Z {int(self.store_hidden_z)}",
                      f"#define ZOUT_COL {off['Z_COL'][-1] if self.store_hidden_z else 0}"]
        elif self.coopmat:
            m_cm, n_cm, k_cm = self.coopmat
            lines += [f"#define NACC {self.nacc}", f"#define SUBGROUPS {self.subgroups}",
                      f"#define SG_COLS {self.sg_cols}", f"#define NCJ {self.ncj}",
                      f"#define NRB {self.rows_per_tile // m_cm // (self.subgroups // self.sg_cols)}",
                      f"#define AS {self.act_stride}",
                      f"#define STORE_HIDDEN_Z {int(self.store_hidden_z)}",
                      # the output layer's column in the fp32 pre-activation buffer
                      f"#define ZOUT_COL {off['Z_COL'][-1] if self.store_hidden_z else 0}",
                      f"#define CM_M {m_cm}", f"#define CM_N {n_cm}", f"#define CM_K {k_cm}"]
        else:
            lines += [f"#define MTPT {self.mtpt}", f"#define MR {self.micro_rows}",
                      f"#define WCHUNK4 {self.wchunk // 4}"]
        arrays = {"LAYER_K": self.k, "LAYER_N": self.n,
                  "KC_FWD": [self.chunk_rows(ni) for ni in self.n],
                  "KC_BWD": [self.chunk_rows(ki) for ki in self.k]}
        arrays.update({k: v for k, v in off.items() if k not in ("totals", "P_OFF")})
        if with_params:
            arrays.update({"FAN_IN": [d[0] for d in self.spec.layer_dims],
                           "FAN_OUT": [d[1] for d in self.spec.layer_dims], "P_OFF": off["P_OFF"]})
        for name, values in arrays.items():
            lines.append(f"const int {name}[{len(values)}] = int[{len(values)}]({', '.join(map(str, values))});")
        return "\n".join(lines) + "\n"


def specialization(spec: MLPSpec, specialize_choices: bool) -> dict[int, int | float]:
    """Specialization constants (ids of ``mlp_common.glsl`` and ``optimizer.comp``).

    With ``specialize_choices`` the activations and the loss are baked in (ids 0-2); without,
    they stay -1 and the kernels read them from push constants (shared pipelines).
    """
    opt = spec.optimizer
    choices = {0: ACTIVATION_CODES[spec.activation], 1: ACTIVATION_CODES[spec.output_activation],
               2: LOSS_CODES[spec.loss]} if specialize_choices else {}
    return {**choices, 3: float(spec.loss_scale), 5: 0 if spec.precision == "fp32" else 1,
            6: 1 if opt.otype == "Adam" else 0, 8: float(opt.beta1),
            9: float(opt.beta2), 10: float(opt.epsilon), 11: float(opt.l2_reg), 12: float(opt.momentum),
            15: int(opt.ema is not None), 16: int(opt.ema is not None and opt.ema.full_precision)}


def shader_source(path: str, header: str) -> str:
    """A kernel's source with the model header placed right after its ``#version`` line."""
    text = read_source(path)
    first, _, rest = text.partition("\n")
    return f"{first}\n{header}{rest}"


# -- device arrays -------------------------------------------------------------------------
@dataclass
class VulkanArray:
    """Rows of a model's input, target or output, resident in a device buffer (padded), float32
    or float16 (inputs uploaded as float16, outputs of ``forward(..., out_dtype=float16)``)."""

    buffer: vr.Buffer
    rows: int
    cols: int
    padded_cols: int
    kind: str  # "input", "target" or "output"
    owner: "VulkanModel"
    dtype: np.dtype = np.dtype(np.float32)

    @property
    def half(self) -> bool:
        return self.dtype == np.float16

    @property
    def rows_pad(self) -> int:
        return _round_up(max(self.rows, 1), ROW_ALIGN)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def free(self) -> None:
        if self.buffer.handle is not None:
            self.owner._untrack(self.buffer)
            self.buffer.free()


@dataclass(eq=False)
class VulkanDatasetArray:
    """One array of a dataset held by ``put_dataset``: ``rows`` x ``cols`` in a device-local
    buffer, compact (no padding), float32 or float16 (two to a 32-bit word). The buffer is
    freed when this array is dropped (``weakref.finalize``), by ``free()``, or with the model."""

    buffer: vr.Buffer
    rows: int
    cols: int
    dtype: np.dtype
    owner: "VulkanModel"

    def __post_init__(self) -> None:
        self._finalizer = weakref.finalize(self, _free_dataset_buffer, weakref.ref(self.owner), self.buffer)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.buffer.allocated

    def free(self) -> None:
        self._finalizer()


def _free_dataset_buffer(model_ref: "weakref.ref[VulkanModel]", buffer: vr.Buffer) -> None:
    model = model_ref()
    if model is None:
        buffer.free()
        return
    with model._lock:
        if buffer.handle is not None:  # else the model's close() freed it
            model._untrack(buffer)  # and the programs recorded with it
            buffer.free()


def _dataset_buffer_bytes(rows: int, cols: int, dtype: np.dtype) -> int:
    return max(16, _round_up(rows * cols * dtype.itemsize, 4))


class VulkanModel(CompiledModel):
    backend = "vulkan"
    supports_ema = True
    # training runs a batch in row chunks whose buffers fit maxStorageBufferRange; a smaller
    # cap (tests) forces chunking on any device
    max_chunk_rows: int | None = None
    # record GPU timestamps around every dispatch (set_gpu_timestamps; benchmarks)
    gpu_timestamps: bool = False

    def __init__(self, spec: MLPSpec, device: vr.Device, variant: str, pipelines: dict[str, vr.Pipeline],
                 geometry: Geometry, shape: tuple[int, int, int] | None = None,
                 make_pipeline: Any = None):
        super().__init__(spec)
        if spec.precision == "bf16":
            raise SpecError("precision", "the vulkan backend runs fp16 and fp32; bf16 is not supported")
        self.variant = variant
        self.device = device
        self.geo = geometry
        self.coopmat_shape = shape
        # a grid model's table gradient: "atomic" (grid.comp's scatter) or "sorted" (keys, sort, gather)
        self.grid_gradient = "atomic" if "grid_scatter" in pipelines else "sorted"
        self._lock = threading.RLock()
        self._buffers: list[vr.Buffer] = []
        self._programs: dict[Any, vr.Program] = {}
        self._last_run: dict[str, vr.Program] = {}  # "forward"/"train": the program that ran last
        self._closed = False
        self._pipelines = pipelines  # owned by the backend, shared by models with the same kernels
        # (name, extra specialization constants) -> pipeline: the fp16 device-array kernels, made
        # on first use by the backend's ``make_pipeline(name, extra)``
        self._make_pipeline = make_pipeline
        self._io_pipelines: dict[tuple, vr.Pipeline] = {}
        self._acts = (ACTIVATION_CODES[spec.activation], ACTIVATION_CODES[spec.output_activation])
        try:
            geo = geometry
            self.n_params = geo.n_values  # the flat buffers' values: the MLP's, then the grid tables'
            self._wall = self._alloc(geo.weight_floats * 4)
            # the coopmat kernels read an fp16 copy of the (already fp16-rounded) weights
            self._wall16 = self._alloc(geo.weight_floats * 2) if variant in COOPERATIVE else None
            self._bias = self._alloc(BIAS_ROWS * geo.bias_floats * 4)
            self._master = self._alloc(self.n_params * 4)
            self._slot_a = self._alloc(self.n_params * 4)
            self._slot_b = self._alloc(self.n_params * 4 if spec.optimizer.otype == "Adam" else 16)
            self._grad = self._alloc(self.n_params * 4)
            # step, base, 2 pads, then HIST_CAP losses, HIST_CAP learning rates, HIST_CAP (keep,
            # take) EMA factors and HIST_CAP base rates (grid tables' Adam) (one each per step of a
            # submission: computed on the host, in float64, the optimizer kernel reads its step's)
            self._ctrl = self._alloc(16 + 5 * HIST_CAP * 4, host_visible=True)
            for buf in (self._wall, self._bias, self._slot_a, self._slot_b):
                buf.fill_zero()
            self._ctrl.write(np.zeros(4, np.uint32))
            self._batch: dict[str, vr.Buffer] = {}
            self._unused = self._alloc(16)  # bound where a kernel's buffer is not used (inference Z)
            self._mma_weights = self._wall16 if self._wall16 is not None else self._wall
            self._alloc_grids(spec)
            self._alloc_ema(spec, variant)
            self.set_params(init_params(spec))
        except BaseException:
            self.close()
            raise

    def _alloc_grids(self, spec: MLPSpec) -> None:
        """Grid models: the tables' compute-type copy grid.comp interpolates (fp16-rounded values
        in fp32 storage, as the weights), their summed gradients and, under Adam, each value's
        step count (tcnn's param_steps)."""
        self._grid_layout = self.geo.grid
        self._grid_adam = self._grid_layout is not None and spec.optimizer.otype == "Adam"
        self._table = self._ggrad = self._gsteps = None
        if self._grid_layout is None:
            return
        values = self._grid_layout.table_values
        self._table = self._alloc(values * 4)
        self._ggrad = self._alloc(values * 4)
        self._gsteps = self._alloc(values * 4 if self._grid_adam else 16)
        self._gsteps.fill_zero()

    def _alloc_ema(self, spec: MLPSpec, variant: str) -> None:
        """With tcnn's EMA wrapper: the average (unpadded, like the masters) and the weights and
        biases inference reads, written from it by the optimizer kernel; the forward kernel
        reads only the transposed weight layout (WT_OFF: the first half of ``_wall``'s layout).
        Without EMA inference reads the training weights."""
        self._ema = self._ewall = self._ebias = self._etable = None
        self._infer_weights, self._infer_bias = self._mma_weights, self._bias
        self._infer_table = self._table
        if spec.optimizer.ema is None:
            return
        if self._grid_layout is not None:  # the averaged tables' compute-type copy inference reads
            self._etable = self._infer_table = self._alloc(self._grid_layout.table_values * 4)
        self._ema = self._alloc(self.n_params * 4)
        half = self.geo.weight_floats // 2
        self._ewall = self._alloc(half * 2 if variant in COOPERATIVE else half * 4)  # fp16 for the cooperative variants
        self._ebias = self._alloc(BIAS_ROWS * self.geo.bias_floats * 4)
        for buf in (self._ewall, self._ebias):
            buf.fill_zero()
        self._infer_weights, self._infer_bias = self._ewall, self._ebias

    # -- buffers --------------------------------------------------------------------------
    def _alloc(self, nbytes: int, host_visible: bool = False) -> vr.Buffer:
        buf = self.device.buffer(nbytes, host_visible)
        self._buffers.append(buf)
        return buf

    def _untrack(self, buf: vr.Buffer) -> None:
        if buf in self._buffers:
            self._buffers.remove(buf)
        for key in [k for k, p in self._programs.items() if any(buf in d.buffers for d in p.dispatches)]:
            self._programs.pop(key).destroy()

    def _check_open(self) -> None:
        if self._closed:
            raise LaunchError("this vulkan model was closed")

    def _chunks(self, rows_pad: int) -> list[tuple[int, int]]:
        """(first row, padded rows) of each chunk a training batch runs in: as many rows as
        keep every per-chunk buffer within ``maxStorageBufferRange`` (or ``max_chunk_rows``)."""
        row_bytes = max(self.geo.training_row_bytes().values())
        limit = self.device.info.max_storage_range // row_bytes // ROW_ALIGN * ROW_ALIGN
        if self.max_chunk_rows:
            limit = min(limit, self.max_chunk_rows // ROW_ALIGN * ROW_ALIGN)
        size = max(ROW_ALIGN, min(rows_pad, limit))
        return [(base, min(size, rows_pad - base)) for base in range(0, rows_pad, size)]

    def _ensure_batch(self, rows_pad: int, training: bool = False) -> dict[str, vr.Buffer]:
        """Per-batch buffers for at least ``rows_pad`` rows (grown, never shrunk): input,
        target and output always; for training the per-chunk pre-activations, deltas (and
        coopmat's fp16 activations), the per-tile losses and the weight-gradient partial sums of
        every chunk."""
        geo = self.geo
        need = {"x": rows_pad * geo.x_pad * 4, "y": rows_pad * geo.out_pad * 4}
        if geo.grid is not None:  # the encoded input (grid.comp) and, training, d loss / d encoded input
            need["enc"] = rows_pad * geo.in_pad * 4
            if training:
                need["din"] = rows_pad * geo.in_pad * 4
        if training:
            chunks = self._chunks(rows_pad)
            chunk = chunks[0][1]
            need["out"] = chunk * geo.out_pad * 4
            need.update({name: chunk * nbytes for name, nbytes in geo.training_row_bytes().items()})
        else:
            need["out"] = rows_pad * geo.out_pad * 4
        for name, nbytes in need.items():
            if nbytes > self.device.info.max_storage_range:
                cols = {"x": geo.x_pad, "enc": geo.in_pad, "din": geo.in_pad}.get(name, geo.out_pad)
                fits = self.device.info.max_storage_range // (cols * 4) // ROW_ALIGN * ROW_ALIGN
                raise InvalidInput(f"a batch of {rows_pad} rows needs a {nbytes}-byte buffer, over this device's "
                                   f"maxStorageBufferRange ({self.device.info.max_storage_range}); send at most "
                                   f"{fits} rows per call")
        if training:
            splits = sum(self._splits(rows)[0] for _, rows in chunks)
            need.update({"loss": rows_pad // geo.rows_per_tile * 4, "part": splits * geo.grad_floats * 4})
            if geo.grid is not None and self.grid_gradient == "sorted":  # a row chunk's table reads (grid_sort.comp)
                items = max(sort_items(rows * g.lookups) for g in geo.grid.parts for _, rows in self._grid_chunks(rows_pad))
                need.update({"skey": items * 4, "sid": items * 4, "gweight": items * 4})
        for name, nbytes in need.items():
            current = self._batch.get(name)
            if current is None or current.size < nbytes:
                self._replace_batch_buffer(name, nbytes)
        return self._batch

    def _replace_batch_buffer(self, name: str, nbytes: int) -> None:
        old = self._batch.pop(name, None)
        if old is not None:
            self._untrack(old)
            old.free()
        self._batch[name] = self._alloc(nbytes)

    def _ensure_encoded_input(self, rows_pad: int) -> None:
        """A grid model's forward of ``rows_pad`` rows: the batch buffer ``enc`` grid.comp encodes
        into (only that one: a device array's forward needs no other batch buffer)."""
        nbytes = rows_pad * self.geo.in_pad * 4
        if nbytes > self.device.info.max_storage_range:
            fits = self.device.info.max_storage_range // (self.geo.in_pad * 4) // ROW_ALIGN * ROW_ALIGN
            raise InvalidInput(f"a batch of {rows_pad} rows needs a {nbytes}-byte buffer for its encoded input, over "
                               f"this device's maxStorageBufferRange ({self.device.info.max_storage_range}); send at "
                               f"most {fits} rows per call")
        current = self._batch.get("enc")
        if current is None or current.size < nbytes:
            self._replace_batch_buffer("enc", nbytes)

    def _grid_chunks(self, n_rows: int) -> list[tuple[int, int]]:
        """(first row, rows) of each chunk whose table reads a gradient sorts at once: at most
        ``MAX_GRID_LOOKUPS`` reads of the grid part that reads the most."""
        size = max(1, MAX_GRID_LOOKUPS // self.geo.grid.max_lookups)
        return [(base, min(size, n_rows - base)) for base in range(0, n_rows, size)]

    @staticmethod
    def _splits(rows_pad: int) -> tuple[int, int]:
        """(number of batch splits, rows per split) of the weight-gradient reduction."""
        # up to 512 splits: each weight-gradient dispatch then has enough workgroups to fill a
        # large GPU (128 left M's 64x64 layers at one workgroup per SM)
        # (a multiple of 64: the kernels stage 64 rows at a time)
        per_split = max(256, _round_up(math.ceil(rows_pad / 512), 64))
        return math.ceil(rows_pad / per_split), per_split

    def _grid(self, tiles: int) -> tuple[int, int, int]:
        x = min(tiles, 32768)
        y = math.ceil(tiles / x)
        if y > self.device.info.max_group_count[1]:
            raise InvalidInput(f"batch of {tiles * self.geo.rows_per_tile} rows exceeds the device's dispatch limits")
        return x, y, 1

    # -- host <-> device ------------------------------------------------------------------
    def _kernel_input(self, x: np.ndarray) -> np.ndarray:
        """What the kernels read for host rows ``x`` (unpadded): the encoded input, or for grid
        models the raw input followed by the host-encoded columns of the parameter-free parts
        (grid.comp computes the grid columns from the raw dims)."""
        if self.geo.grid is None:
            return self.encode(x)
        return nm.grid_kernel_input(self.spec.encoding, x)

    @property
    def _kernel_input_cols(self) -> int:
        return self.geo.grid.x_cols if self.geo.grid is not None else self.spec.n_encoded_dims

    def _encode(self, x: np.ndarray, rows_pad: int) -> np.ndarray:
        enc = self._kernel_input(x)
        out = np.zeros((rows_pad, self.geo.x_pad), np.float32)
        out[:x.shape[0], :enc.shape[1]] = enc
        return out

    def _pad_target(self, y: np.ndarray, rows_pad: int) -> np.ndarray:
        out = np.zeros((rows_pad, self.geo.out_pad), np.float32)
        out[:y.shape[0], :y.shape[1]] = y
        return out

    def upload(self, x: np.ndarray) -> VulkanArray:
        """Encode, pad and copy inputs to the device (a ``VulkanArray`` of kind ``input``). float16
        rows of a model without an encoding stay float16 on the device (half the bytes; the
        kernels round every input to fp16 anyway); anything else is stored as float32."""
        with self._lock:
            self._check_open()
            half = getattr(x, "dtype", None) == np.float16 and self.spec.encoding.passthrough
            x = self.check_input(x)
            rows_pad = _round_up(max(x.shape[0], 1), ROW_ALIGN)
            dtype = np.dtype(np.float16 if half else np.float32)
            buf = self._alloc(rows_pad * self.geo.x_pad * dtype.itemsize)
            buf.write(self._encode(x, rows_pad).astype(dtype, copy=False))  # float16 -> float32 -> float16: exact
            return VulkanArray(buf, x.shape[0], self.spec.n_input_dims, self.geo.x_pad, "input", self, dtype)

    def upload_target(self, y: np.ndarray) -> VulkanArray:
        """Copy training targets to the device (a ``VulkanArray`` of kind ``target``)."""
        with self._lock:
            self._check_open()
            y = check_rows(y, self.spec.n_output_dims, "target")
            rows_pad = _round_up(max(y.shape[0], 1), ROW_ALIGN)
            buf = self._alloc(rows_pad * self.geo.out_pad * 4)
            buf.write(self._pad_target(y, rows_pad))
            return VulkanArray(buf, y.shape[0], self.spec.n_output_dims, self.geo.out_pad, "target", self)

    def download(self, a: Any) -> np.ndarray:
        if not isinstance(a, VulkanArray):
            return np.asarray(a)
        with self._lock:
            self._check_open()
            raw = a.buffer.read(a.rows * a.padded_cols * a.dtype.itemsize)
            full = np.frombuffer(raw, a.dtype).reshape(a.rows, a.padded_cols)
            if a.kind == "input":  # encoded inputs (grid models: the raw inputs, which the device encodes)
                return full[:, :self.spec.n_input_dims if self.geo.grid else self.spec.n_encoded_dims].copy()
            return full[:, :a.cols].copy()

    def synchronize(self) -> None:
        self.device.wait_idle()

    # -- programs -------------------------------------------------------------------------
    def _forward_program(self, x_buf: vr.Buffer, out_buf: vr.Buffer, rows_pad: int, z_buf: vr.Buffer,
                         input_f16: bool = False, output_f16: bool = False) -> vr.Program:
        if self.geo.grid is not None:
            self._ensure_encoded_input(rows_pad)
        key = ("forward", id(x_buf), id(out_buf), rows_pad, input_f16, output_f16)
        program = self._programs.get(key)
        if program is None:
            tiles = rows_pad // self.geo.rows_per_tile
            grid = self._grid(tiles)
            push = np.array([rows_pad, grid[0], 0, *self._acts, 0], np.uint32).tobytes()
            dispatches = []
            if self.geo.grid is not None:  # the grid columns from the raw input (inference's tables)
                dispatches.append(self._encode_dispatch(x_buf, self._infer_table, rows_pad))
                x_buf = self._batch["enc"]
            buffers = [x_buf, self._infer_weights, self._infer_bias, out_buf, z_buf]
            if self.variant in COOPERATIVE:
                buffers.append(z_buf)  # the fp16 activations, not written either
            dispatches.append(vr.Dispatch(self._pipeline_for("forward", input_f16, output_f16), buffers, push, grid))
            program = vr.Program(self.device, dispatches, timestamps=self.gpu_timestamps)
            self._programs[key] = program
        self._last_run["forward"] = program
        return program

    def _encode_dispatch(self, x_buf: vr.Buffer, table: vr.Buffer, rows_pad: int) -> vr.Dispatch:
        """grid.comp's encode: the batch buffer ``enc`` (rows_pad x IN_PAD) from the kernel input, an
        invocation per (row, grid level) and per (row, other column)."""
        grid = self.geo.grid
        per_row = self.geo.in_pad - sum(len(g.levels) * (g.features - 1) for g in grid.parts)
        groups = min(65535, math.ceil(rows_pad * per_row / 256))
        return vr.Dispatch(self._pipelines["grid_encode"], [x_buf, table, self._batch["enc"]],
                           np.uint32(rows_pad).tobytes(), (groups, 1, 1))

    def _grid_gradient_dispatches(self, x_buf: vr.Buffer, n_rows: int) -> list[vr.Dispatch]:
        """The tables' gradients (x loss scale) into ``_ggrad`` from ``din``, which the backward
        wrote for the whole batch. Atomic: per grid part, its values zeroed, then every read of
        the batch added with atomicAdd. Sorted: per grid part and row chunk, the chunk's table reads (keys),
        their bitonic sort by table row (passes of distance below SORT_BLOCK in shared memory, a
        dispatch per merge size; the longer ones a dispatch each) and the gather, which sets the
        sums on the first chunk and adds them after."""
        b, p = self._batch, self._pipelines
        u32 = lambda *v: np.array(v, np.uint32).tobytes()  # noqa: E731
        dispatches = []
        if self.grid_gradient == "atomic":
            for part in self.geo.grid.parts:
                dispatches.append(vr.Dispatch(p["grid_zero"], [self._ggrad], u32(part.index),
                                              (min(65535, math.ceil(part.entries * part.features / 256)), 1, 1)))
                items = n_rows * len(part.levels)  # a (row, level) an invocation: its cell once, every corner
                dispatches.append(vr.Dispatch(p["grid_scatter"], [x_buf, b["din"], self._ggrad],
                                              u32(0, n_rows, part.index), (min(65535, math.ceil(items / 256)), 1, 1)))
            return dispatches
        for part in self.geo.grid.parts:
            for c, (row_base, rows) in enumerate(self._grid_chunks(n_rows)):
                items = sort_items(rows * part.lookups)
                dispatches.append(vr.Dispatch(p["grid_keys"], [x_buf, b["skey"], b["sid"], b["gweight"]],
                                              u32(row_base, rows, items, part.index),
                                              (min(65535, math.ceil(items / 256)), 1, 1)))
                pairs = (min(65535, math.ceil(items // 2 / 256)), 1, 1)
                blocks = (items // SORT_BLOCK, 1, 1)
                sort = [b["skey"], b["sid"]]
                dispatches.append(vr.Dispatch(p["grid_sort_block"], sort, u32(items, 0, 0), blocks))
                size = 2 * SORT_BLOCK
                while size <= items:
                    distance = size // 2
                    while distance >= SORT_BLOCK:
                        dispatches.append(vr.Dispatch(p["grid_sort"], sort, u32(items, distance, size), pairs))
                        distance //= 2
                    dispatches.append(vr.Dispatch(p["grid_sort_block"], sort, u32(items, 0, size), blocks))
                    size *= 2
                dispatches.append(vr.Dispatch(
                    p["grid_gather"], [b["skey"], b["sid"], b["gweight"], b["din"], self._ggrad],
                    u32(row_base, items, part.index, int(c == 0)), (min(65535, math.ceil(part.entries / 256)), 1, 1)))
        return dispatches

    def _training_program(self, x_buf: vr.Buffer, y_buf: vr.Buffer, n_rows: int, rows_pad: int,
                          update: bool, input_f16: bool = False) -> vr.Program:
        """forward → backward → weight gradients for each chunk of the batch, then the loss
        and the optimizer (or the gradient export) once over every chunk's partial sums."""
        key = ("train" if update else "grads", id(x_buf), id(y_buf), n_rows, rows_pad, input_f16)
        program = self._programs.get(key)
        if program is None:
            program = vr.Program(self.device,
                                 self._training_dispatches(x_buf, y_buf, n_rows, rows_pad, update, input_f16),
                                 timestamps=self.gpu_timestamps)
            self._programs[key] = program
        self._last_run["train"] = program
        return program

    def _training_dispatches(self, x_buf: vr.Buffer, y_buf: vr.Buffer, n_rows: int, rows_pad: int,
                             update: bool, input_f16: bool = False) -> list[vr.Dispatch]:
        """The dispatches of one training step (``_training_program``'s, and the tail of the
        program ``train_epochs`` records after its gather); ``input_f16``: ``x_buf`` holds fp16 rows."""
        geo = self.geo
        b = self._ensure_batch(rows_pad, training=True)
        p = self._pipelines
        u32 = lambda *v: np.array(v, np.uint32).tobytes()  # noqa: E731
        hidden, output = self._acts
        n_out = self.spec.n_output_dims
        dispatches = []
        split_base = 0
        raw_x = x_buf
        if geo.grid is not None:  # the forward and layer 0's weight gradient read the encoded input
            dispatches.append(self._encode_dispatch(raw_x, self._table, rows_pad))
            x_buf = b["enc"]
        for row_base, rows in self._chunks(rows_pad):
            tiles = rows // geo.rows_per_tile
            grid = self._grid(tiles)
            splits, per_split = self._splits(rows)
            valid = max(0, min(rows, n_rows - row_base))
            loss_push = (u32(rows, grid[0], valid, n_out, hidden, output, LOSS_CODES[self.spec.loss])
                         + np.float32(self.spec.huber_delta).tobytes()
                         + u32(row_base, row_base // geo.rows_per_tile, n_rows))
            if self.variant in COOPERATIVE:  # + the fp16 hidden activations; wgrad reads those
                forward = self._pipeline_for("forward_train", input_f16)
                fwd = [x_buf, self._mma_weights, self._bias, b["out"], b["z"], b["h"]]
                bwd = [y_buf, self._mma_weights, b["z"], b["h"], b["d"], b["loss"]]
                wgrad = [x_buf, b["h"], b["d"], b["part"]]
            else:
                forward = self._pipeline_for("forward", input_f16)
                fwd = [x_buf, self._mma_weights, self._bias, b["out"], b["z"]]
                bwd = [y_buf, self._mma_weights, b["z"], b["d"], b["loss"]]
                wgrad = [x_buf, b["z"], b["d"], b["part"]]
            if geo.grid is not None:  # the backward runs on into d loss / d encoded input
                bwd.append(b["din"])
            dispatches += [
                vr.Dispatch(forward, fwd, u32(rows, grid[0], 1, hidden, output, row_base), grid),
                vr.Dispatch(p["backward"], bwd, loss_push, grid),
            ]
            tile_n, tile_k = geo.wgrad_tile
            for layer in range(geo.n_layers):
                wgrid = (math.ceil(geo.n[layer] / tile_n), math.ceil(geo.k[layer] / tile_k), splits)
                # the layers' gradients are independent (disjoint partial sums): no barriers
                # between them, so their dispatches overlap
                dispatches.append(vr.Dispatch(
                    self._pipeline_for("wgrad", input_f16 and layer == 0), wgrad,
                    u32(rows, layer, per_split, geo.grad_floats, hidden, row_base, split_base), wgrid,
                    barrier=layer == 0))
            split_base += splits
        if geo.grid is not None:
            dispatches += self._grid_gradient_dispatches(raw_x, n_rows)
        dispatches.append(vr.Dispatch(p["finalize"], [b["loss"], self._ctrl],
                                      u32(rows_pad // geo.rows_per_tile, n_rows, n_out, int(update)), (1, 1, 1)))
        groups = math.ceil(self.n_params / 256)
        opt_grid = (min(groups, 32768), math.ceil(groups / 32768), 1)  # grid tables: past 65535 groups
        unused = self._unused
        ema = [unused] * 4 if self._ema is None else [
            self._ema, unused if self.variant in COOPERATIVE else self._ewall, self._ebias,
            self._ewall if self.variant in COOPERATIVE else unused]
        if geo.grid is not None:
            ema += [self._ggrad, self._gsteps, self._table, self._etable if self._etable is not None else unused]
        dispatches.append(vr.Dispatch(
            p["optimizer"], [b["part"], self._master, self._slot_a, self._slot_b, self._wall, self._bias,
                             self._grad, self._ctrl, self._wall16 if self._wall16 is not None else unused, *ema],
            u32(self.n_params, split_base, geo.grad_floats, int(update), opt_grid[0]), opt_grid))
        return dispatches

    def _pipeline_for(self, name: str, input_f16: bool = False, output_f16: bool = False) -> vr.Pipeline:
        """Kernel ``name``, reading fp16 input rows (``input_f16``) or writing an fp16 output
        (``output_f16``) where asked: its pipeline specialised with INPUT_F16 / OUTPUT_F16."""
        extra = {c: 1 for c, on in ((INPUT_F16_CONSTANT, input_f16), (OUTPUT_F16_CONSTANT, output_f16)) if on}
        if not extra:
            return self._pipelines[name]
        key = (name, *sorted(extra))
        if key not in self._io_pipelines:
            if self._make_pipeline is None:
                raise LaunchError("this vulkan model was built without its fp16 I/O kernels")
            self._io_pipelines[key] = self._make_pipeline(name, extra)
        return self._io_pipelines[key]

    def set_gpu_timestamps(self, on: bool) -> None:
        """Record GPU timestamps around every dispatch of the programs run from now on (the
        ones recorded so far are dropped). Timestamps may serialise dispatches that would
        otherwise overlap, so time the wall clock without them."""
        with self._lock:
            self.gpu_timestamps = on
            for program in self._programs.values():
                program.destroy()
            self._programs.clear()
            self._last_run.clear()

    def gpu_times(self, kind: str) -> list[tuple[str, float]]:
        """(kernel, GPU seconds) of each dispatch of the last ``kind`` ("forward" or "train")
        program run, recorded after ``set_gpu_timestamps(True)``."""
        with self._lock:
            program = self._last_run.get(kind)
            if program is None or program.cb is None:
                raise InvalidInput(f"no {kind} program has run on this model")
            return [(d.pipeline.name, t) for d, t in zip(program.dispatches, program.gpu_seconds())]

    def pipeline_statistics(self) -> dict[str, Any]:
        """The driver's compiler statistics of each kernel (with MMAD_VULKAN_PIPELINE_STATS=1), the
        fp16 I/O kernels made so far too (``forward+in16+out16``, ...)."""
        stats = {name: p.statistics() for name, p in self._pipelines.items()}
        for (name, *constants), p in self._io_pipelines.items():
            tags = {INPUT_F16_CONSTANT: "in16", OUTPUT_F16_CONSTANT: "out16"}
            stats["+".join([name, *(tags[c] for c in constants)])] = p.statistics()
        return stats

    def _evict_programs(self) -> None:
        # bounded: recorded programs hold descriptor pools and command buffers
        if len(self._programs) > 16:
            for key in list(self._programs)[:-8]:
                self._programs.pop(key).destroy()

    # -- compute --------------------------------------------------------------------------
    def forward(self, x: Any, out_dtype: Any = np.float32) -> Any:
        dtype = output_dtype(out_dtype)
        with self._lock:
            self._check_open()
            self._evict_programs()
            if isinstance(x, VulkanArray):
                if x.owner is not self or x.kind != "input":
                    raise InvalidInput("forward takes an input array uploaded by this model")
                out = self._alloc(x.rows_pad * self.geo.out_pad * dtype.itemsize)
                self._forward_program(x.buffer, out, x.rows_pad, self._unused, x.half, dtype == np.float16).run()
                return VulkanArray(out, x.rows, self.spec.n_output_dims, self.geo.out_pad, "output", self, dtype)
            x = self.check_input(x)
            rows_pad = _round_up(max(x.shape[0], 1), ROW_ALIGN)
            b = self._ensure_batch(rows_pad)
            b["x"].write(self._encode(x, rows_pad))
            self._forward_program(b["x"], b["out"], rows_pad, self._unused).run()
            raw = b["out"].read(x.shape[0] * self.geo.out_pad * 4)
            out = np.frombuffer(raw, np.float32).reshape(x.shape[0], self.geo.out_pad)
            return out[:, :self.spec.n_output_dims].astype(dtype)

    def forward_to_host(self, x: np.ndarray, out: np.ndarray, executor: Any = None,
                        check_finite: bool = False) -> None:
        """``forward`` of host rows into the host array ``out`` with no intermediate arrays: the
        rows are converted (FP16 by the cpu backend's exact routines, chunks on ``executor``'s
        threads) straight into the mapped staging memory, and the output from it into ``out``.
        Through ``forward``'s host path (NumPy casts, an encoded and padded copy, a read into
        ``bytes``, a sliced cast) 65,536 FP16 rows of model M take 29-34 ms on an H100, of
        which the device work is 0.6 ms. Encoded models take that path."""
        out = check_host_output(out, np.shape(x)[0], self.spec.n_output_dims)
        if not self.spec.encoding.passthrough or not isinstance(x, np.ndarray) or \
                x.dtype not in (np.float16, np.float32):
            super().forward_to_host(x, out, executor, check_finite)
            return
        x = check_rows_shape(x, self.spec.n_input_dims, "input")
        if check_finite:
            check_finite_rows(x)
        rows, n_in, n_out = x.shape[0], self.spec.n_input_dims, self.spec.n_output_dims
        in_pad, out_pad = self.geo.in_pad, self.geo.out_pad

        def fill(raw: np.ndarray) -> None:
            staged = raw.view(np.float32).reshape(rows_pad, in_pad)
            copy_rows(x, staged[:rows, :n_in], executor)
            staged[:rows, n_in:] = 0  # the padding columns, and the rows up to the tile
            staged[rows:] = 0

        def take(raw: np.ndarray) -> None:
            copy_rows(raw.view(np.float32).reshape(rows, out_pad)[:, :n_out], out, executor)

        with self._lock:
            self._check_open()
            self._evict_programs()
            rows_pad = _round_up(max(rows, 1), ROW_ALIGN)
            b = self._ensure_batch(rows_pad)
            b["x"].write_with(fill, rows_pad * in_pad * 4)
            self._forward_program(b["x"], b["out"], rows_pad, self._unused).run()
            b["out"].read_with(take, rows * out_pad * 4)

    def forward_into(self, x: VulkanArray, out: VulkanArray, run: bool = True) -> vr.Program:
        """Forward of a device input into an existing device output (no allocation); returns
        the recorded program, which benchmarks re-submit with ``program.run(times=n)``."""
        with self._lock:
            self._check_open()
            if x.owner is not self or x.kind != "input" or out.owner is not self or out.rows != x.rows:
                raise InvalidInput("forward_into takes an input and an output array of this model with equal rows")
            program = self._forward_program(x.buffer, out.buffer, x.rows_pad, self._unused, x.half, out.half)
            if run:
                program.run()
            return program

    def _stage_batch(self, x: Any, y: Any) -> tuple[vr.Buffer, vr.Buffer, int, int, bool]:
        """(input buffer, target buffer, rows, padded rows, whether the input rows are fp16)."""
        if isinstance(x, VulkanArray):
            if x.owner is not self or x.kind != "input":
                raise InvalidInput("training takes an input array uploaded by this model")
            rows = x.rows
        else:
            x = self.check_input(x)
            rows = x.shape[0]
        if rows < 1:
            raise InvalidInput("training needs at least one row")
        if isinstance(y, VulkanArray):
            if y.owner is not self or y.kind != "target" or y.rows != rows:
                raise InvalidInput(f"the target array must come from upload_target with {rows} rows")
        else:
            y = self.check_target(y, rows)
        rows_pad = _round_up(rows, ROW_ALIGN)
        b = self._ensure_batch(rows_pad, training=True)
        if isinstance(x, VulkanArray):
            x_buf = x.buffer
        else:
            b["x"].write(self._encode(x, rows_pad))
            x_buf = b["x"]
        if isinstance(y, VulkanArray):
            y_buf = y.buffer
        else:
            b["y"].write(self._pad_target(y, rows_pad))
            y_buf = b["y"]
        return x_buf, y_buf, rows, rows_pad, isinstance(x, VulkanArray) and x.half

    def _write_step_tables(self, steps: int) -> None:
        """The control block's per-step tables of the next ``steps`` steps (one submission):
        learning rates, and with EMA its (keep, take) factors."""
        self._ctrl.write(self.step_rates(steps), offset=16 + HIST_CAP * 4)
        if self._ema is not None:
            table = nm.ema_factor_table(self.spec.optimizer.ema, self.step_count + 1, steps)
            self._ctrl.write(table, offset=16 + 2 * HIST_CAP * 4)
        if self._grid_adam:  # the grid tables' Adam applies each value's own bias correction
            first = self.step_count + 1
            base = np.array([nm.step_base_rate(self.spec.optimizer, first + k) for k in range(steps)], np.float32)
            self._ctrl.write(base, offset=16 + 4 * HIST_CAP * 4)

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        with self._lock:
            self._check_open()
            self._evict_programs()
            x_buf, y_buf, rows, rows_pad, half = self._stage_batch(x, y)
            program = self._training_program(x_buf, y_buf, rows, rows_pad, update=True, input_f16=half)
            losses = []
            done = 0
            while done < steps:
                chunk = min(HIST_CAP, steps - done)
                self._ctrl.write(np.array([self.step_count, self.step_count], np.uint32))
                self._write_step_tables(chunk)
                program.run(times=chunk)
                hist = np.frombuffer(self._ctrl.read(16 + chunk * 4), np.float32)
                self.step_count = int(np.frombuffer(self._ctrl.read(4), np.uint32)[0])
                losses.append(hist[4:4 + chunk].copy())
                done += chunk
            return np.concatenate(losses)

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        with self._lock:
            self._check_open()
            self._evict_programs()
            x_buf, y_buf, rows, rows_pad, half = self._stage_batch(x, y)
            self._training_program(x_buf, y_buf, rows, rows_pad, update=False, input_f16=half).run()
            loss = float(np.frombuffer(self._ctrl.read(4, offset=16), np.float32)[0])
            flat = np.frombuffer(self._grad.read(self.n_params * 4), np.float32)
            return loss, self._unflatten(flat)

    # -- training from a dataset held on the device ----------------------------------------------
    def _dataset_dtypes(self, x_dtype: Any, y_dtype: Any) -> tuple[np.dtype, np.dtype]:
        """The dtypes ``put_dataset`` stores: as sent (float16 or float32; float64 as float32),
        except encoded inputs, which are float32 (the encoding's output, as ``train_step`` uses it)."""
        def stored(dtype: Any, name: str) -> np.dtype:
            dt = np.dtype(dtype)
            if dt == np.float64:
                return np.dtype(np.float32)
            if dt not in (np.float16, np.float32):
                raise InvalidInput(f"a dataset's {name} must be float16 or float32; got {dt}")
            return dt
        xd = stored(x_dtype, "inputs")
        return (xd if self.spec.encoding.passthrough else np.dtype(np.float32)), stored(y_dtype, "targets")

    def dataset_bytes(self, rows: int, x_dtype: Any, y_dtype: Any) -> int:
        """Bytes ``put_dataset`` asks for: encoded inputs (``n_encoded_dims`` float32 columns, or
        the raw columns as sent without an encoding) and targets, unpadded, each buffer rounded up
        to 4 bytes (the driver may round each allocation up further to its alignment;
        ``Dataset.nbytes`` is what was allocated)."""
        xd, yd = self._dataset_dtypes(x_dtype, y_dtype)
        return (_dataset_buffer_bytes(rows, self._kernel_input_cols, xd)
                + _dataset_buffer_bytes(rows, self.spec.n_output_dims, yd))

    def free_device_bytes(self) -> int | None:
        """Device-local memory still free by VK_EXT_memory_budget (budget minus usage), or None
        where the device lacks that extension: core Vulkan tells heap sizes, not their use."""
        with self._lock:
            self._check_open()
            return self.device.free_device_local_bytes()

    def put_dataset(self, chunks, rows: int, x_dtype: Any, y_dtype: Any) -> Dataset:
        """The dataset in two device-local buffers, allocated once and filled chunk by chunk
        (each chunk encoded on the host first where the model has an encoding). Stored compact,
        ``rows`` x columns without the batch buffers' padding (the gather shader pads): inputs as
        sent (float16 or float32; float32 once encoded), targets as sent. Freed when the
        returned Dataset (its ``x``/``y``) is dropped or the model closes."""
        if not 0 < rows < 2**31:
            raise InvalidInput(f"a dataset holds 1 to {2**31 - 1} rows; got {rows}")
        xd, yd = self._dataset_dtypes(x_dtype, y_dtype)
        x_cols, y_cols = self._kernel_input_cols, self.spec.n_output_dims
        limit = self.device.info.max_storage_range
        for cols, dt, what in ((x_cols, xd, "inputs"), (y_cols, yd, "targets")):
            if rows * cols * dt.itemsize > limit:
                raise InvalidInput(f"a dataset of {rows} rows needs a {rows * cols * dt.itemsize}-byte buffer for its "
                                   f"{what}, over this device's maxStorageBufferRange ({limit}); at most "
                                   f"{limit // (cols * dt.itemsize)} rows fit")
        with self._lock:
            self._check_open()
            bx = self._alloc(_dataset_buffer_bytes(rows, x_cols, xd))
            try:
                by = self._alloc(_dataset_buffer_bytes(rows, y_cols, yd))
            except BaseException:
                self._untrack(bx)
                bx.free()
                raise
        x = VulkanDatasetArray(bx, rows, x_cols, xd, self)
        y = VulkanDatasetArray(by, rows, y_cols, yd, self)
        encoded = not self.spec.encoding.passthrough

        def write(at: int, cx: Any, cy: Any) -> None:
            cx = check_rows(cx, self.spec.n_input_dims, "input", keep_half=xd == np.float16)
            cy = check_rows(cy, y_cols, "target", keep_half=yd == np.float16)
            hx = self._kernel_input(cx) if encoded else cx.astype(xd, copy=False)
            with self._lock:
                self._check_open()
                bx.write(hx, offset=at * x_cols * xd.itemsize)
                by.write(cy.astype(yd, copy=False), offset=at * y_cols * yd.itemsize)

        try:
            fill_dataset(chunks, rows, write)
        except BaseException:
            x.free()
            y.free()
            raise
        return Dataset(x, y, rows, bx.allocated + by.allocated, on_device=True)

    def take_rows(self, a: Any, rows: np.ndarray) -> Any:
        """Rows of a held dataset array, copied to the host (the span from the first to the last
        row asked for is read back) in its stored dtype; host arrays are indexed as they are."""
        if not isinstance(a, VulkanDatasetArray):
            return a[rows]
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size == 0:
            return np.empty((0, a.cols), a.dtype)
        lo, hi = int(rows.min()), int(rows.max()) + 1
        if lo < 0 or hi > a.rows:
            raise InvalidInput(f"rows {lo}..{hi - 1} are outside the dataset's {a.rows} rows")
        row_bytes = a.cols * a.dtype.itemsize
        with self._lock:
            self._check_open()
            raw = a.buffer.read((hi - lo) * row_bytes, offset=lo * row_bytes)
        return np.frombuffer(raw, a.dtype).reshape(hi - lo, a.cols)[rows - lo]

    def _epochs_program(self, data: Dataset, batch: int, rows_pad: int, seed: int) -> vr.Program:
        """The gather of a batch of ``data`` (``gather_batch.comp``) into the batch buffers, then
        one training step on them: identical every step, the control block says which batch."""
        x, y = data.x, data.y
        key = ("epochs", id(x.buffer), id(y.buffer), data.rows, batch, rows_pad, seed)
        program = self._programs.get(key)
        if program is None:
            b = self._ensure_batch(rows_pad, training=True)
            grid = self._grid(rows_pad)  # a workgroup per batch row
            push = np.array([data.rows, epoch_half_bits(data.rows), batch, batches_per_epoch(data.rows, batch),
                             seed & 0xFFFFFFFF, x.cols, int(x.dtype == np.float16), self.geo.x_pad,
                             y.cols, int(y.dtype == np.float16), self.geo.out_pad, grid[0]], np.uint32).tobytes()
            gather = vr.Dispatch(self._pipelines["gather"], [x.buffer, y.buffer, b["x"], b["y"], self._ctrl],
                                 push, grid)
            dispatches = [gather] + self._training_dispatches(b["x"], b["y"], batch, rows_pad, update=True)
            program = vr.Program(self.device, dispatches, timestamps=self.gpu_timestamps)
            self._programs[key] = program
        self._last_run["train"] = program
        return program

    def train_epochs(self, data: Dataset, batch: int, steps: int, position: EpochPosition) -> np.ndarray:
        """See ``CompiledModel.train_epochs``: each step gathers its batch of the epoch's order on
        the device (``gather_batch.comp``) and trains on it, in one recorded program submitted
        up to ``HIST_CAP`` times at once. The position is device state: the host writes the
        submission's first (epoch, cursor) into the control block next to the step counter, and
        step k of the submission takes the k-th batch from there."""
        check_epoch_run(data, batch, steps)
        if not (data.on_device and isinstance(data.x, VulkanDatasetArray) and isinstance(data.y, VulkanDatasetArray)
                and data.x.owner is self and data.y.owner is self):
            raise InvalidInput("this dataset is not held on this model's vulkan device (put_dataset of this "
                               "model keeps it there)")
        if position.cursor % batch or position.cursor + batch > data.rows:
            raise InvalidInput(f"the epoch position's cursor {position.cursor} is not the start of a batch of "
                               f"{batch} of the dataset's {data.rows} rows")
        with self._lock:
            self._check_open()
            if data.x.buffer.handle is None or data.y.buffer.handle is None:
                raise InvalidInput("this dataset was freed")
            self._evict_programs()
            rows_pad = _round_up(batch, ROW_ALIGN)
            self._ensure_batch(rows_pad, training=True)
            program = self._epochs_program(data, batch, rows_pad, position.seed)
            at = EpochPosition(position.seed, position.epoch, position.cursor)
            losses = []
            done = 0
            while done < steps:
                chunk = min(HIST_CAP, steps - done)
                self._ctrl.write(np.array([self.step_count, self.step_count, at.epoch & 0xFFFFFFFF,
                                           at.cursor // batch], np.uint32))
                self._write_step_tables(chunk)
                program.run(times=chunk)
                hist = np.frombuffer(self._ctrl.read(16 + chunk * 4), np.float32)
                self.step_count = int(np.frombuffer(self._ctrl.read(4), np.uint32)[0])
                losses.append(hist[4:4 + chunk].copy())
                at.advance(data.rows, batch, chunk)
                done += chunk
            position.epoch, position.cursor = at.epoch, at.cursor
            return np.concatenate(losses)

    # -- parameters -----------------------------------------------------------------------
    def _unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        out, pos = {}, 0
        for name, shape in param_shapes(self.spec).items():
            size = int(np.prod(shape))
            out[name] = flat[pos:pos + size].reshape(shape).copy()
            pos += size
        return out

    def _flatten(self, params: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([params[name].reshape(-1) for name in param_shapes(self.spec)]).astype(np.float32)

    def get_params(self) -> dict[str, np.ndarray]:
        with self._lock:
            self._check_open()
            return self._unflatten(np.frombuffer(self._master.read(self.n_params * 4), np.float32))

    def _weight_images(self, params: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(weights in both padded layouts, rounded as the kernels multiply them; the biases
        row-replicated) as the kernels read them."""
        geo = self.geo
        off = geo.offsets()
        wall = np.zeros(geo.weight_floats, np.float32)
        bias = np.zeros(geo.bias_floats, np.float32)
        precision = "fp16" if self.spec.precision != "fp32" else "fp32"
        for i, (ki, ni) in enumerate(zip(geo.k, geo.n)):
            w = np.zeros((ni, ki), np.float32)
            fan_in, fan_out = self.spec.layer_dims[i]
            w[:fan_out, :fan_in] = nm.round_to(precision, params[f"W{i}"])
            wall[off["WT_OFF"][i]:off["WT_OFF"][i] + ki * ni] = w.T.reshape(-1)
            wall[off["WR_OFF"][i]:off["WR_OFF"][i] + ki * ni] = w.reshape(-1)
            bias[off["B_OFF"][i]:off["B_OFF"][i] + fan_out] = params[f"b{i}"]
        return wall, np.tile(bias, BIAS_ROWS)

    def _table_image(self, params: dict[str, np.ndarray]) -> np.ndarray:
        """The grid tables as grid.comp interpolates them: rounded to the compute precision (tcnn
        keeps them in the network's type), one after the other."""
        precision = "fp16" if self.spec.precision != "fp32" else "fp32"
        return np.concatenate([nm.round_to(precision, np.asarray(params[f"grid{g.index}"], np.float32)).reshape(-1)
                               for g in self._grid_layout.parts]).astype(np.float32)

    def _write_inference_images(self, wall: np.ndarray, bias: np.ndarray,
                                params: dict[str, np.ndarray] | None = None) -> None:
        # an EMA model's inference copy: the forward layout (the first half) in its storage type
        half = wall[:self.geo.weight_floats // 2]
        self._ewall.write(half.astype(np.float16) if self.variant in COOPERATIVE else half)
        self._ebias.write(bias)
        if self._etable is not None and params is not None:
            self._etable.write(self._table_image(params))

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        params = check_params(self.spec, params)
        wall, bias = self._weight_images(params)
        with self._lock:
            self._check_open()
            self._master.write(self._flatten(params))
            self._wall.write(wall)
            if self._wall16 is not None:
                self._wall16.write(wall.astype(np.float16))
            self._bias.write(bias)
            if self._table is not None:
                self._table.write(self._table_image(params))
            if self._ema is not None:  # inference serves the weights just set, as on cpu
                self._ema.write(self._flatten(params))
                self._write_inference_images(wall, bias, params)

    def _slot_buffer(self, slot: int) -> vr.Buffer:
        moments = (self._slot_a, self._slot_b) if self.spec.optimizer.otype == "Adam" else (self._slot_a,)
        return (*moments, self._ema)[slot]

    def _read_slot(self, slot: int) -> dict[str, np.ndarray]:
        with self._lock:
            self._check_open()
            return self._unflatten(np.frombuffer(self._slot_buffer(slot).read(self.n_params * 4), np.float32))

    def _write_slots(self, slots: list[dict[str, np.ndarray]], step: int) -> None:
        if step >= 2**32 - HIST_CAP:  # the device counts steps in 32 bits
            raise InvalidInput(f"optimizer step {step} is out of range")
        with self._lock:
            self._check_open()
            for j, values in enumerate(slots):
                self._slot_buffer(j).write(self._flatten(values))
                if optimizer_slots(self.spec)[j] == "ema":  # a restored average is what inference serves
                    self._write_inference_images(*self._weight_images(values), values)
            self._ctrl.write(np.array([step, step], np.uint32))

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        """The contract's state plus, for grid tables under Adam, ``steps.grid{k}``: each value's
        own step count (uint32), as the cpu backend keeps it."""
        state = super().get_optimizer_state()
        if self._grid_adam:
            with self._lock:
                self._check_open()
                steps = np.frombuffer(self._gsteps.read(self._grid_layout.table_values * 4), np.uint32)
            for g in self._grid_layout.parts:
                state[f"steps.grid{g.index}"] = steps[g.offset:g.offset + g.entries * g.features].reshape(
                    g.entries, g.features).copy()
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what ``get_optimizer_state`` returned. A state without ``steps.grid{k}`` (written
        by a backend that keeps none) counts the optimizer's steps for every value Adam has moved
        (v != 0), as the cpu backend does."""
        super().set_optimizer_state(state)
        if not self._grid_adam:
            return
        steps = np.zeros(self._grid_layout.table_values, np.uint32)
        for g in self._grid_layout.parts:
            values = nm.grid_steps_from_state(state, f"grid{g.index}", (g.entries, g.features), self.step_count)
            steps[g.offset:g.offset + values.size] = values.reshape(-1)
        with self._lock:
            self._check_open()
            self._gsteps.write(steps)

    def device_bytes(self) -> int:
        return sum(b.allocated for b in self._buffers if b.handle is not None)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self.device.closed:
                self.device.wait_idle()
            for program in self._programs.values():
                program.destroy()
            self._programs.clear()
            for buf in self._buffers:
                buf.free()
            self._buffers.clear()


# -- backend -------------------------------------------------------------------------------
class VulkanBackend(Backend):
    name = "vulkan"

    def __init__(self) -> None:
        self._infos: list[vr.DeviceInfo] | None = None
        self._probe_error = ""
        self._devices: dict[int, vr.Device] = {}  # open logical devices by index (``devices()``)
        self._pipelines: dict[tuple, vr.Pipeline] = {}  # by (device index, SPIR-V hash, constants)
        self._models: weakref.WeakSet[VulkanModel] = weakref.WeakSet()
        self._announced: set[tuple] = set()  # (variant, shape, coopmat2 plan) already logged
        self._coopmat2_refused: dict[int, str] = {}  # device index -> the driver's answer to coopmat2
        self._convert_rne: dict[int, bool] = {}  # id(device) -> fp16_conversion_is_rne
        self._lock = threading.Lock()

    def _survey(self) -> list[vr.DeviceInfo]:
        if self._infos is None:
            try:
                self._infos = vr.probe_devices()
            except (BackendUnavailable, LaunchError) as exc:
                self._infos, self._probe_error = [], str(exc)
            except Exception as exc:  # noqa: BLE001 - a probe never raises
                self._infos, self._probe_error = [], f"{type(exc).__name__}: {exc}"
        return self._infos

    def probe(self) -> list[ProbeRow]:
        infos = self._survey()
        if not infos:
            reason = self._probe_error or "no Vulkan physical device found"
            return [ProbeRow("vulkan", v, False, reason=reason) for v in VARIANTS]
        dev = infos[0]
        try:
            from mmad.backends.vulkan.glsl import compiler_version
            compiler = compiler_version()
            compiler_error = ""
        except Exception as exc:  # noqa: BLE001
            compiler, compiler_error = "", f"no GLSL compiler: {exc}"
        details = {"device_type": dev.device_type, "subgroup_size": dev.subgroup_size,
                   "max_shared_bytes": dev.max_shared_bytes, "shader_float16": dev.shader_float16,
                   "storage_16bit": dev.storage_16bit, "compiler": compiler,
                   "fp16_storage": "fp32 storage with exact fp16 rounding (r16)",
                   "devices": [f"{d.name} ({d.device_type})" for d in infos]}
        try:
            details["grid_gradient"] = grid_gradient(dev)
        except MMADError as exc:  # a probe never raises: a setting this device cannot run, said here
            details["grid_gradient"] = f"unusable: {exc}"
        common = dict(device=dev.name, api_version=dev.api_version, software=dev.software)
        major, minor = (int(p) for p in dev.api_version.split(".")[:2])
        simt_reason = compiler_error or ("" if (major, minor) >= (1, 2) else f"Vulkan {dev.api_version} < 1.2")
        simt = ProbeRow("vulkan", "simt", not simt_reason, reason=simt_reason, details=dict(details), **common)
        shapes = [MMAShape(s["m"], s["n"], s["k"], s["a"], s["b"], s["c"], s["result"], s["scope"])
                  for s in dev.coopmat_shapes]
        usable = usable_coopmat_shapes(dev.coopmat_shapes)
        if os.environ.get(COOPMAT_ENV, "1").strip() == "0":
            reason = f"disabled by {COOPMAT_ENV}=0"
        elif vr.COOPMAT_EXT not in dev.extensions:
            reason = f"{dev.name} does not offer {vr.COOPMAT_EXT}"
        elif not usable:
            reason = ("no fp16*fp16+fp32 subgroup shape among " + ", ".join(map(str, shapes))
                      + " matches a kernel family (" + ", ".join("x".join(map(str, f)) for f in COOPMAT_FAMILIES) + ")")
        elif not (dev.shader_float16 and dev.vulkan_memory_model and dev.storage_16bit):
            reason = (f"{dev.name} lacks shaderFloat16, storageBuffer16BitAccess or vulkanMemoryModel, "
                      "which the coopmat kernels need")
        else:
            reason = compiler_error
        coop_details = dict(details)
        coop_details["fp16_storage"] = "float16_t buffers (training's activations and deltas), rounded to nearest even"
        if usable and not reason:
            coop_details["tile_shape"] = "x".join(map(str, usable[0]))
            coop_details["cooperative_matrix"] = (f"{vr.COOPMAT_EXT}: f16*f16+f32 {coop_details['tile_shape']}, "
                                                  "subgroup scope")
        coop_details["subgroup_size_control"] = (
            f"required {dev.subgroup_size} ({vr.SUBGROUP_SIZE_EXT})" if dev.subgroup_size_range is not None
            else f"the driver's ({dev.name} cannot require one); the kernels count subgroups of {dev.subgroup_size}")
        coop2 = self._coopmat2_row(dev, {**details, "fp16_storage": coop_details["fp16_storage"]}, common,
                                   compiler_error)
        coop_details.update(self._nv_extension_notes(dev, coop2))
        coop = ProbeRow("vulkan", "coopmat", not reason, reason=reason, mma_shapes=shapes,
                        details=coop_details, **common)
        return [coop2, coop, simt]

    @staticmethod
    def _coopmat2_row(dev: vr.DeviceInfo, details: dict[str, Any], common: dict[str, Any],
                      compiler_error: str) -> ProbeRow:
        """vulkan:coopmat2: VK_NV_cooperative_matrix2 with the features the kernels use, an fp16*fp16+fp32
        workgroup-scope flexible-dimension shape, what the coopmat kernels need of the device, the
        glslang that knows GL_NV_cooperative_matrix2 (slangpy's) and cmeel's (the shared kernels)."""
        from mmad.backends.vulkan.glsl import SLANG_GLSLANG, compiler_version, knows_extension

        shapes = [MMAShape(s["m"], s["n"], s["k"], s["a"], s["b"], s["c"], s["result"], s["scope"])
                  for s in dev.coopmat2_shapes]
        usable = usable_coopmat2_shapes(dev.coopmat2_shapes)
        missing = [f for f in COOPMAT2_FEATURES if not dev.coopmat2_features.get(f)]
        row_details = dict(details)
        try:
            row_details["compiler"] = compiler_version(SLANG_GLSLANG)
            compiler_reason = "" if knows_extension(COOPMAT2_GLSL, SLANG_GLSLANG) else (
                f"the GLSL compiler here ({row_details['compiler']}) does not support {COOPMAT2_GLSL}")
        except Exception as exc:  # noqa: BLE001 - a probe never raises
            row_details["compiler"] = ""
            compiler_reason = f"no GLSL compiler for {COOPMAT2_GLSL}: {exc}"
        if os.environ.get(COOPMAT2_ENV, "1").strip() == "0":
            reason = f"disabled by {COOPMAT2_ENV}=0"
        elif vr.COOPMAT2_EXT not in dev.extensions:
            reason = f"{dev.name} does not offer {vr.COOPMAT2_EXT}"
        elif vr.COOPMAT_EXT not in dev.extensions:
            reason = f"{dev.name} offers {vr.COOPMAT2_EXT} without {vr.COOPMAT_EXT}, which it builds on"
        elif missing:
            reason = f"{dev.name}'s {vr.COOPMAT2_EXT} lacks the feature(s) {', '.join(missing)}, which the kernels use"
        elif not usable:
            reason = ("no fp16*fp16+fp32 workgroup-scope flexible-dimension shape among "
                      + (", ".join(f"{s} {e['workgroup_invocations']} invocations"
                                   for s, e in zip(shapes, dev.coopmat2_shapes)) or "none listed"))
        elif not (dev.shader_float16 and dev.vulkan_memory_model and dev.storage_16bit):
            reason = (f"{dev.name} lacks shaderFloat16, storageBuffer16BitAccess or vulkanMemoryModel, "
                      "which the coopmat2 kernels need")
        else:
            reason = compiler_error or compiler_reason
        props = dev.coopmat2_properties
        if dev.coopmat2_features:
            row_details["coopmat2_features"] = [f for f, on in dev.coopmat2_features.items() if on]
            row_details["coopmat2_properties"] = dict(props)
            row_details["flexible_shapes"] = [f"{s} {e['scope']} {e['workgroup_invocations']} invocations"
                                              + (" saturating" if e.get("saturating") else "")
                                              for s, e in zip(shapes, dev.coopmat2_shapes)]
        if usable and not reason:
            best = usable[0]
            row_details["cooperative_matrix"] = (
                f"{vr.COOPMAT2_EXT}: f16*f16+f32 workgroup scope, {best['workgroup_invocations']} invocations, "
                f"dimensions in steps of {best['m']}x{best['n']}x{best['k']} up to "
                f"{props.get('cooperativeMatrixFlexibleDimensionsMaxDimension', 0)}; tiles per model (coopmat2_plan)")
        return ProbeRow("vulkan", "coopmat2", not reason, reason=reason, mma_shapes=shapes, details=row_details, **common)

    @staticmethod
    def _nv_extension_notes(dev: vr.DeviceInfo, coop2: ProbeRow) -> dict[str, str]:
        """Per NVIDIA cooperative extension (workgroup-scope matrices, cooperative vectors): not
        offered, used by a variant, or offered and why no variant uses it."""
        from mmad.backends.vulkan.glsl import SLANG_GLSLANG, compiler_version, knows_extension

        notes = {}
        for ext, glsl_ext in NV_COOPERATIVE_EXTENSIONS.items():
            if ext not in dev.extensions:
                notes[ext] = f"not offered by {dev.name}"
            elif ext == vr.COOPMAT2_EXT:
                notes[ext] = "offered, used by vulkan:coopmat2" if coop2.available else f"offered, not used: {coop2.reason}"
            else:
                try:
                    known = knows_extension(glsl_ext, SLANG_GLSLANG)
                    missing = "" if known else f"the GLSL compiler here ({compiler_version(SLANG_GLSLANG)}) does not support {glsl_ext}"
                except Exception as exc:  # noqa: BLE001 - a probe never raises
                    missing = f"no GLSL compiler for {glsl_ext}: {exc}"
                notes[ext] = f"offered, not used: {missing or 'no vulkan variant has kernels for it'}"
        if dev.coopvec_features:  # what a cooperative-vector variant would have to work with
            fp16 = [c for c in dev.coopvec_combinations if c["matrixInterpretation"] == "f16"]
            notes["cooperative_vector"] = (
                f"features {', '.join(f for f, on in dev.coopvec_features.items() if on) or 'none'}; "
                + ", ".join(f"{k} {v}" for k, v in dev.coopvec_properties.items()) + "; fp16 matrices: "
                + ("; ".join(f"{c['inputType']} input as {c['inputInterpretation']}, bias {c['biasInterpretation']}, "
                             f"{c['resultType']} result{', transposed' if c['transpose'] else ''}" for c in fp16)
                   or "none"))
        return notes

    def _placeable(self) -> list[vr.DeviceInfo]:
        """The physical devices models can be placed on: the best one (the probe's) and every
        other of its type (all discrete GPUs, say; never a software device beside a GPU)."""
        infos = self._survey()
        return [d for d in infos if d.device_type == infos[0].device_type] if infos else []

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(i, d.name) for i, d in enumerate(self._placeable())]

    def _open_device(self, index: int) -> vr.Device:
        """The logical device ``index`` (opened once), with VK_NV_cooperative_matrix2 enabled where the
        device offers it with the features the coopmat2 kernels use. Should the driver refuse the
        device with it, it is opened without (a warning; coopmat2 is then refused with the driver's
        answer, ``_coopmat2_refused``), so that the other variants still run."""
        with self._lock:
            device = self._devices.get(index)
            if device is None or device.closed:
                infos = self._placeable()
                if not infos:
                    raise BackendUnavailable("vulkan", self._probe_error or "no Vulkan physical device found")
                check_device_index(index, len(infos), "vulkan")
                info = infos[index]
                stats = os.environ.get(PIPELINE_STATS_ENV, "") == "1"
                coopmat = vr.COOPMAT_EXT in info.extensions
                coopmat2 = (coopmat and vr.COOPMAT2_EXT in info.extensions
                            and all(info.coopmat2_features.get(f) for f in COOPMAT2_FEATURES))
                try:
                    device = vr.Device(info, enable_coopmat=coopmat, pipeline_stats=stats, enable_coopmat2=coopmat2)
                except LaunchError as exc:
                    if not coopmat2:
                        raise
                    log.warning("vulkan backend: %s refused a device with %s (%s); opened without it",
                                info.name, vr.COOPMAT2_EXT, exc)
                    self._coopmat2_refused[index] = str(exc)
                    device = vr.Device(info, enable_coopmat=coopmat, pipeline_stats=stats)
                self._devices[index] = device
            return device

    def _coopmat2_geometry(self, spec: MLPSpec, device: vr.Device, index: int) -> Geometry:
        """The coopmat2 geometry of ``spec`` on an open device (BackendUnavailable where the device
        was opened without the extension; SpecError where the model does not fit its shapes)."""
        if not device.coopmat2:
            raise BackendUnavailable("vulkan:coopmat2", self._coopmat2_refused.get(index) or
                                     f"device {index} ({device.info.name}) was opened without {vr.COOPMAT2_EXT}")
        info = device.info
        plan = coopmat2_plan(spec, info.coopmat2_shapes, info.coopmat2_properties, info.max_shared_bytes,
                             info.max_workgroup_invocations, grid=bool(spec.grid_shapes))
        return Geometry.build(spec, info.max_shared_bytes, coopmat2=plan)

    def compile(self, spec: MLPSpec, variant: str | None = None, cache: Any = None,
                device: int = 0, batch_rows: int | None = None) -> VulkanModel:
        """A model on ``variant``, or on the best available for ``spec`` (variant_choices): coopmat2
        where the model fits its shapes, else coopmat (the reason logged), else simt."""
        rows = {r.variant: r for r in self.probe()}
        if variant is None:
            choices = [v for v in AUTOMATIC if v in variant_choices(spec)]
            variant = next((v for v in choices if rows[v].available), None)
            if variant is None:
                raise BackendUnavailable("vulkan", "; ".join(f"{v}: {rows[v].reason}" for v in choices))
        if variant not in VARIANTS:
            raise SpecError("variant", f"the vulkan backend has variants {', '.join(VARIANTS)}; got {variant!r}")
        if variant not in variant_choices(spec):
            raise SpecError("precision", f"vulkan:{variant} multiplies fp16 operands; a precision fp32 model runs on "
                                         "vulkan:simt (or leave the variant to the backend)")
        if not rows[variant].available:
            raise BackendUnavailable(f"vulkan:{variant}", rows[variant].reason)
        if spec.precision == "bf16":
            raise SpecError("precision", "the vulkan backend runs fp16 and fp32; bf16 is not supported")
        index = device
        device = self._open_device(index)
        geometry = None
        if variant == "coopmat2":
            geometry = self._coopmat2_geometry(spec, device, index)
        if variant == "coopmat" and vr.COOPMAT_EXT not in device.info.extensions:
            raise BackendUnavailable("vulkan:coopmat", f"device {index} ({device.info.name}) does not offer "
                                     f"{vr.COOPMAT_EXT}")
        shape = usable_coopmat_shapes(device.info.coopmat_shapes)[0] if variant == "coopmat" else None
        if geometry is None or variant != "coopmat2":
            geometry = Geometry.build(spec, device.info.max_shared_bytes, shape, device.info.subgroup_size,
                                      min(512, device.info.max_workgroup_invocations), coopmat_subgroups_cap())
        shape = geometry.coopmat
        check_tables_fit(spec, geometry, device.info.max_storage_range)
        cache = cache if cache is not None else KernelCache()
        sources = kernel_sources(spec, geometry, variant,
                                 grid_gradient(device.info) if geometry.grid is not None else "sorted")
        forced = os.environ.get(SPECIALIZE_ENV, "").strip()
        consts = specialization(spec, forced == "1" if forced in ("0", "1") else not device.info.software)
        if variant in COOPERATIVE:
            consts[13] = int(self._conversion_rounds_to_nearest_even(device, cache))
        # glslang (a subprocess) and the driver's pipeline compiler (cffi calls, without the GIL)
        # work on the kernels of a model side by side
        spirvs = build_all({name: (lambda name=name, src=src: build_spirv(
            src, f"vulkan {variant} {name} kernel", cache, device.info.name,
            SLANG_GLSLANG if variant == "coopmat2" and name in COOPMAT2_KERNELS else GLSLANG))
            for name, src in sources.items()})
        interface = pipeline_interface(variant, geometry.grid is not None)

        def pipeline(name: str, extra: dict[int, int] | None = None) -> vr.Pipeline:
            """Kernel ``name``'s pipeline with its specialization constants (and ``extra``), shared
            by every model of the same SPIR-V and constants."""
            used = {k: v for k, v in consts.items() if name == "optimizer" or k < 6 or k == 13}
            if name == "gather" or name.startswith("grid_"):  # no specialization constants
                used = {}
            if name == "forward_train":
                used[TRAINING_CONSTANT] = 1
            used.update(extra or {})
            # the cooperative-matrix kernels count subgroups (gl_SubgroupID) of the probed size
            subgroup = device.info.subgroup_size if name in SUBGROUP_SIZED.get(variant, ()) else None
            key = (index, hashlib.sha256(spirvs[name]).hexdigest(), tuple(sorted(used.items())), subgroup)
            with self._lock:
                if key in self._pipelines:
                    return self._pipelines[key]
            n_bind, push = interface[name]
            made = vr.Pipeline(device, spirvs[name], n_bind, push, used, name=f"{variant}/{name}", subgroup_size=subgroup)
            with self._lock:
                if key in self._pipelines:  # made by another compile meanwhile
                    made.destroy()
                else:
                    self._pipelines[key] = made
                return self._pipelines[key]

        pipelines = build_all({name: (lambda name=name: pipeline(name)) for name in sources})
        model = VulkanModel(spec, device, variant, pipelines, geometry, shape, make_pipeline=pipeline)
        model.device_index = index
        self._models.add(model)
        plan = geometry.coopmat2
        if (variant, shape, plan) not in self._announced:
            self._announced.add((variant, shape, plan))
            if plan is not None:
                log.info("vulkan backend: variant coopmat2 on %s: workgroup-scope f16*f16+f32 matrices, tiles of %d "
                         "rows over %d invocations, weight gradients %s (set %s=0 to disable coopmat2)",
                         device.info.name, plan.rows, plan.threads, "x".join(map(str, plan.wgrad)), COOPMAT2_ENV)
            else:
                log.info("vulkan backend: variant %s%s on %s (%s)", variant,
                         f", cooperative-matrix tile {'x'.join(map(str, shape))} f16*f16+f32" if shape else "",
                         device.info.name, f"set {COOPMAT_ENV}=0 to disable coopmat" if shape else
                         "no matrix hardware used")
        return model

    def _conversion_rounds_to_nearest_even(self, device: vr.Device, cache: Any) -> bool:
        """Whether this device's fp32 -> fp16 conversion rounds to nearest even (measured once
        per device); Vulkan leaves the direction to the implementation."""
        with self._lock:
            known = self._convert_rne.get(id(device))
        if known is None:
            known = fp16_conversion_is_rne(device, cache)
            log.info("vulkan backend: fp32->fp16 conversion on %s %s", device.info.name,
                     "rounds to nearest even: fp16 stores convert directly" if known
                     else "does not round to nearest even: values are rounded (r16) before conversion")
            with self._lock:
                self._convert_rne[id(device)] = known
        return known

    def close(self) -> None:
        """Close every model compiled here, then the pipelines and the device."""
        for model in list(self._models):
            model.close()
        with self._lock:
            for pipeline in self._pipelines.values():
                pipeline.destroy()
            self._pipelines.clear()
            for device in self._devices.values():
                device.close()
            self._devices.clear()


CONVERT_PROBE = """#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer In { float X[]; };
layout(std430, binding = 1) writeonly buffer Out { float16_t H[]; };
layout(push_constant) uniform Push { uint n; } pc;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < pc.n) H[i] = float16_t(X[i]);
}
"""


def conversion_probe_values() -> np.ndarray:
    """fp32 values that tell round-to-nearest-even from every other rounding: exact ties
    between neighbouring fp16 values (normal and subnormal, both signs), one fp32 ulp either
    side of them, the overflow boundary, and random values across the fp16 range."""
    rng = np.random.default_rng(16)
    h = rng.integers(0, 0x7bff, 4096, dtype=np.uint16).view(np.float16)  # finite, below the max
    lo = h.astype(np.float32)
    hi = (h.view(np.uint16) + 1).view(np.float16).astype(np.float32)
    ties = (lo.astype(np.float64) + hi) / 2  # exact in fp32: one more mantissa bit
    ties = ties.astype(np.float32)
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(0))])
    edge = np.array([65504.0, 65519.996, 65520.0, 1e5, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26], np.float32)
    spread = (rng.standard_normal(4096) * 10.0 ** rng.uniform(-7, 4.8, 4096)).astype(np.float32)
    values = np.concatenate([ties, near, edge, spread])
    return np.concatenate([values, -values]).astype(np.float32)


def fp16_conversion_is_rne(device: vr.Device, cache: Any) -> bool:
    """Convert :func:`conversion_probe_values` with ``float16_t(x)`` into a 16-bit storage
    buffer on ``device`` and compare bit for bit with round-to-nearest-even (numpy's)."""
    x = conversion_probe_values()
    spirv = build_spirv(CONVERT_PROBE, "vulkan fp16 conversion probe", cache, device.info.name)
    pipeline = vr.Pipeline(device, spirv, 2, 4, name="fp16-conversion-probe")
    src = device.buffer(x.nbytes)
    dst = device.buffer(x.size * 2)
    program = None
    try:
        src.write(x)
        program = vr.Program(device, [vr.Dispatch(pipeline, [src, dst], np.uint32(x.size).tobytes(),
                                                  (math.ceil(x.size / 64), 1, 1))])
        program.run()
        got = np.frombuffer(dst.read(x.size * 2), np.uint16)
    finally:
        if program is not None:
            program.destroy()
        src.free()
        dst.free()
        pipeline.destroy()
    with np.errstate(over="ignore"):  # the overflow boundary values become inf, as they should
        want = x.astype(np.float16).view(np.uint16)
    return bool(np.array_equal(got, want))


def kernel_sources(spec: MLPSpec, geometry: Geometry, variant: str, table_gradient: str = "sorted") -> dict[str, str]:
    """GLSL of every kernel a model needs, specialised for its geometry (and coopmat shape);
    a grid model's table gradient summed as ``table_gradient`` says (GRID_GRADIENTS)."""
    header = geometry.header()
    param_header = geometry.header(with_params=True)
    files = {"forward": "glsl/simt_forward.comp", "backward": "glsl/simt_backward.comp",
             "wgrad": "glsl/simt_wgrad.comp", "optimizer": "glsl/optimizer.comp",
             "finalize": "glsl/loss_finalize.comp"}
    if variant == "coopmat":
        if geometry.coopmat is None:
            raise CompileError("vulkan coopmat kernels", "the geometry has no cooperative-matrix shape")
        files["forward"] = "glsl/coopmat_forward.comp"
        files["backward"] = "glsl/coopmat_backward.comp"
        files["wgrad"] = "glsl/coopmat_wgrad.comp"
        files["forward_train"] = files["forward"]  # one SPIR-V, specialised (TRAINING_CONSTANT)
    elif variant == "coopmat2":
        if geometry.coopmat2 is None:
            raise CompileError("vulkan coopmat2 kernels", "the geometry has no coopmat2 plan")
        files.update(forward="glsl/coopmat2_forward.comp", backward="glsl/coopmat2_backward.comp",
                     wgrad="glsl/coopmat2_wgrad.comp", forward_train="glsl/coopmat2_forward.comp")
    headers = {"optimizer": param_header}
    if geometry.grid is not None:
        grid_header = geometry.grid.header(geometry.n_params, geometry.in_pad)
        headers = {"optimizer": param_header + grid_header, "backward": header + grid_header}
        stages = {"atomic": (("grid_encode", 0), ("grid_scatter", 3), ("grid_zero", 4)),
                  "sorted": (("grid_encode", 0), ("grid_keys", 1), ("grid_gather", 2))}[table_gradient]
        for name, stage in stages:
            files[name] = "glsl/grid.comp"
            headers[name] = header + grid_header + f"#define GRID_STAGE {stage}\n"
    sources = {name: shader_source(path, headers.get(name, header)) for name, path in files.items()}
    sources["gather"] = read_source("glsl/gather_batch.comp")  # train_epochs: the batch drawn on the device
    if geometry.grid is not None and table_gradient == "sorted":  # no model header: shared by every grid model
        sources["grid_sort"] = shader_source("glsl/grid_sort.comp", "#define SORT_STAGE 0\n")
        sources["grid_sort_block"] = shader_source("glsl/grid_sort.comp", "#define SORT_STAGE 1\n")
    return sources
