"""tiny-cuda-nn's parameter-free encodings on the cuda backend (``mmad/shaders/cuda/encodings.cu``).

Identity, Frequency, OneBlob, TriangleWave and SphericalHarmonics parts of a spec's encoding are
computed on the device from the raw input: forward into the pair-major fp16 input of the
``ENCODED_INPUT`` mma kernels (grid models and mmad.torch's, :mod:`.grids`) or into row-major
fp32 rows (what every other variant reads: ``CudaModel._device_input``), and backward from
d loss / d encoded output to d loss / d input (tcnn's ``*_backward`` kernels; the input gradients
of :func:`mmad.backends.numerics.encode_input_gradient`). Each part gets a generated wrapper
(``enc_forward_<k>`` / ``enc_backward_<k>``) with its dims, columns and constants as literals; the
spherical harmonics' polynomials are generated from the oracle's own formula
(:func:`mmad.backends.encodings.spherical_harmonics`), once over ``float`` and once over
``Dual3`` (value and gradient), so there is one definition of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mmad.backends.encodings import spherical_harmonics
from mmad.errors import LaunchError
from mmad.shaders import read_source
from mmad.spec import EncodingSpec, MLPSpec, kernel_code_defines

ENCODE_THREADS = 256
LAYOUTS = {"pairs": 0, "rows_f32": 1, "rows_f16": 2}  # encodings.cu's ENC_PAIRS, ENC_ROWS_F32, ENC_ROWS_F16
NVRTC_OPTIONS = ("-std=c++17",)


def f32_literal(v: float) -> str:
    """A float as the CUDA fp32 literal of its fp32 value."""
    return f"{float(np.float32(v))!r}f"


@dataclass(frozen=True)
class FreePart:
    """A parameter-free part of an encoding as the device computes it: input dims ``begin`` …
    ``begin + dims − 1`` to encoded columns ``column`` … ``column + width − 1``; ``index`` names
    its kernels."""

    index: int
    encoding: EncodingSpec
    begin: int
    dims: int
    column: int
    width: int

    @property
    def per_row(self) -> bool:
        """A thread per row (SphericalHarmonics reads all three dims), else per (row, dim)."""
        return self.encoding.otype == "SphericalHarmonics"

    def threads(self, rows: int) -> int:
        return rows if self.per_row else rows * self.dims


def free_parts(spec: MLPSpec) -> tuple[FreePart, ...]:
    """Every parameter-free part of ``spec``'s encoding, in output order."""
    out, column = [], 0
    for part, begin, dims in spec.encoding.parts(spec.n_input_dims):
        width = part.n_output_dims(dims)
        if not part.is_grid:
            out.append(FreePart(len(out), part, begin, dims, column, width))
        column += width
    return tuple(out)


def free_kernels(parts: tuple[FreePart, ...]) -> tuple[str, ...]:
    return tuple(f"enc_{kind}_{p.index}" for p in parts for kind in ("forward", "backward"))


class _Emitter:
    """Statements of a generated function, one temporary per operation (no expression is repeated)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def temp(self, code: str) -> "_Expr":
        name = f"t{len(self.lines)}"
        self.lines.append(f"    const T {name} = {code};")
        return _Expr(self, name)


class _Expr:
    """A value of the generated CUDA function with the arithmetic the spherical harmonics'
    formula uses; Python numbers become fp32 literals (the oracle multiplies float32 arrays by
    them, rounded to float32 first). ``full_like`` and ``stack`` make it the formula's namespace."""

    def __init__(self, emitter: _Emitter, name: str, columns: tuple[str, ...] = ()):
        self.e, self.name, self.columns = emitter, name, columns

    def _code(self, other: Any) -> str:
        return other.name if isinstance(other, _Expr) else f32_literal(other)

    def _op(self, a: str, op: str, b: str) -> "_Expr":
        return self.e.temp(f"{a} {op} {b}")

    def _vector(self, fn) -> "_Expr":  # an operation on the input vector: per column
        return _Expr(self.e, "", tuple(fn(_Expr(self.e, c)).name for c in self.columns))

    def __add__(self, o):
        return self._vector(lambda c: c + o) if self.columns else self._op(self.name, "+", self._code(o))

    def __radd__(self, o):
        return self._op(self._code(o), "+", self.name)

    def __sub__(self, o):
        return self._vector(lambda c: c - o) if self.columns else self._op(self.name, "-", self._code(o))

    def __rsub__(self, o):
        return self._op(self._code(o), "-", self.name)

    def __mul__(self, o):
        return self._vector(lambda c: c * o) if self.columns else self._op(self.name, "*", self._code(o))

    def __rmul__(self, o):
        return self._op(self._code(o), "*", self.name)

    def __neg__(self):
        return self.e.temp(f"-{self.name}")

    def __getitem__(self, key: tuple[slice, int]) -> "_Expr":
        return _Expr(self.e, self.columns[key[1]])

    @staticmethod
    def full_like(v: "_Expr", value: float) -> "_Expr":
        return v.e.temp(f"sh_const<T>({f32_literal(value)})")

    @staticmethod
    def stack(values: list["_Expr"], axis: int) -> list[str]:
        return [v.name for v in values]


def spherical_harmonics_source(name: str, degree: int) -> str:
    """``template <typename T> void name(T x0, T x1, T x2, T* out)``: the degree² spherical
    harmonics of the raw input (in [0, 1]^3; the formula maps it to 2x − 1) over float or Dual3."""
    emitter = _Emitter()
    outputs = spherical_harmonics(degree, _Expr(emitter, "", ("x0", "x1", "x2")), _Expr)
    body = "\n".join(emitter.lines + [f"    out[{i}] = {v};" for i, v in enumerate(outputs)])
    return (f"template <typename T>\n__device__ __forceinline__ void {name}(T x0, T x1, T x2, T* out) {{\n"
            f"{body}\n}}\n")


def _forward_body(p: FreePart) -> str:
    enc, store = p.encoding, "out, layout, rows, out_cols, r"
    if enc.otype == "Identity":
        return (f"enc_store({store}, {p.column} + d, xv * {f32_literal(enc.scale)} + {f32_literal(enc.offset)});")
    if enc.otype == "Frequency":
        return f"frequency_forward<{enc.n_frequencies}>(xv, {store}, {p.column} + d * {2 * enc.n_frequencies});"
    if enc.otype == "OneBlob":
        return f"one_blob_forward<{enc.n_bins}>(xv, {store}, {p.column} + d * {enc.n_bins});"
    if enc.otype == "TriangleWave":
        return f"triangle_forward<{enc.n_frequencies}>(xv, {store}, {p.column} + d * {enc.n_frequencies});"
    raise ValueError(f"no device encoding {enc.otype!r}")


def _backward_body(p: FreePart) -> str:
    enc, args = p.encoding, "din, din_half, din_cols, r"
    if enc.otype == "Identity":
        return f"{f32_literal(enc.scale)} * enc_din({args}, {p.column} + d)"
    if enc.otype == "Frequency":
        return f"frequency_backward<{enc.n_frequencies}>(xv, {args}, {p.column} + d * {2 * enc.n_frequencies})"
    if enc.otype == "OneBlob":
        return f"one_blob_backward<{enc.n_bins}>(xv, {args}, {p.column} + d * {enc.n_bins})"
    if enc.otype == "TriangleWave":
        return f"triangle_backward<{enc.n_frequencies}>(xv, {args}, {p.column} + d * {enc.n_frequencies})"
    raise ValueError(f"no device encoding {enc.otype!r}")


FORWARD_ARGS = ("const float* __restrict__ x, const int* __restrict__ row_map, i64 rows, int x_cols, void* out, "
                "int layout, int out_cols")
BACKWARD_ARGS = ("const float* __restrict__ x, i64 rows, int x_cols, const void* __restrict__ din, int din_half, "
                 "int din_cols, float inv_scale, float* __restrict__ dx")


def part_source(p: FreePart) -> str:
    """The forward and backward wrappers of one parameter-free part."""
    k = p.index
    if p.per_row:
        n = p.width
        return spherical_harmonics_source(f"sh_poly_{k}", p.encoding.degree) + f"""
extern "C" __global__ void __launch_bounds__({ENCODE_THREADS}) enc_forward_{k}({FORWARD_ARGS}) {{
    const i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float v[{n}];
    sh_poly_{k}<float>(enc_x(x, row_map, x_cols, r, {p.begin}), enc_x(x, row_map, x_cols, r, {p.begin + 1}),
                       enc_x(x, row_map, x_cols, r, {p.begin + 2}), v);
#pragma unroll
    for (int c = 0; c < {n}; ++c) enc_store(out, layout, rows, out_cols, r, {p.column} + c, v[c]);
}}

extern "C" __global__ void __launch_bounds__({ENCODE_THREADS}) enc_backward_{k}({BACKWARD_ARGS}) {{
    const i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* xr = x + r * x_cols + {p.begin};
    Dual3 v[{n}];
    sh_poly_{k}<Dual3>(Dual3{{__ldg(xr), 1.f, 0.f, 0.f}}, Dual3{{__ldg(xr + 1), 0.f, 1.f, 0.f}},
                       Dual3{{__ldg(xr + 2), 0.f, 0.f, 1.f}}, v);
    float g0 = 0.f, g1 = 0.f, g2 = 0.f;
#pragma unroll
    for (int c = 0; c < {n}; ++c) {{
        const float g = enc_din(din, din_half, din_cols, r, {p.column} + c);
        g0 = fmaf(g, v[c].d0, g0);
        g1 = fmaf(g, v[c].d1, g1);
        g2 = fmaf(g, v[c].d2, g2);
    }}
    float* o = dx + r * x_cols + {p.begin};
    o[0] += g0 * inv_scale;
    o[1] += g1 * inv_scale;
    o[2] += g2 * inv_scale;
}}
"""
    return f"""
extern "C" __global__ void __launch_bounds__({ENCODE_THREADS}) enc_forward_{k}({FORWARD_ARGS}) {{
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * {p.dims}) return;
    const i64 r = i % rows;  // consecutive threads: consecutive rows of one dim
    const int d = (int)(i / rows);
    const float xv = enc_x(x, row_map, x_cols, r, {p.begin} + d);
    {_forward_body(p)}
}}

extern "C" __global__ void __launch_bounds__({ENCODE_THREADS}) enc_backward_{k}({BACKWARD_ARGS}) {{
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * {p.dims}) return;
    const i64 r = i % rows;
    const int d = (int)(i / rows);
    const float xv = __ldg(x + r * x_cols + {p.begin} + d);
    dx[r * x_cols + {p.begin} + d] += ({_backward_body(p)}) * inv_scale;
}}
"""


def encodings_source(parts: tuple[FreePart, ...]) -> str:
    """encodings.cu and every part's wrappers (mlp_common.cuh must come before)."""
    return read_source("cuda/encodings.cu") + "".join(part_source(p) for p in parts)


def encoder_source(parts: tuple[FreePart, ...]) -> str:
    """The whole source of :class:`DeviceEncoder`'s module (NVRTC's input)."""
    head = kernel_code_defines() + "#define ACT 0\n#define LOSS 0\n#define HUBER_DELTA 0.f\n"
    return head + read_source("cuda/mlp_common.cuh") + encodings_source(parts)


Launch = Callable[[str, tuple, tuple, tuple], None]


def launch_forward(launch: Launch, parts: tuple[FreePart, ...], x: Any, row_map: Any, rows: int, x_cols: int,
                   out: Any, layout: str, out_cols: int) -> None:
    """Enqueue every part's forward into ``out`` (``layout``: pairs, rows_f32 or rows_f16)."""
    for p in parts:
        n = p.threads(rows)
        if n:
            launch(f"enc_forward_{p.index}", (math.ceil(n / ENCODE_THREADS),), (ENCODE_THREADS,),
                   (x, 0 if row_map is None else row_map, np.int64(rows), np.int32(x_cols), out,
                    np.int32(LAYOUTS[layout]), np.int32(out_cols)))


def launch_backward(launch: Launch, parts: tuple[FreePart, ...], x: Any, rows: int, x_cols: int, din: Any,
                    din_cols: int, inv_scale: float, dx: Any) -> None:
    """Enqueue every part's d loss / d input, added into ``dx`` (rows × x_cols fp32), from ``din``
    (row-major fp16 or fp32, ``din_cols`` a row, times ``inv_scale``)."""
    half = np.int32(din.dtype.itemsize == 2)
    for p in parts:
        n = p.threads(rows)
        if n:
            launch(f"enc_backward_{p.index}", (math.ceil(n / ENCODE_THREADS),), (ENCODE_THREADS,),
                   (x, np.int64(rows), np.int32(x_cols), din, half, np.int32(din_cols), np.float32(inv_scale), dx))


class DeviceEncoder:
    """The parameter-free encoding of a spec without grids, on the device: the row-major fp32
    encoded input every non-pair variant reads (``encode_rows``), and its input gradient."""

    def __init__(self, spec: MLPSpec, cp, arch_digits: str, cache: Any = None):
        from mmad.backends.cache import KernelCache
        from mmad.backends.cuda.toolchain import LoadedModule, cached_cubin, device_errors, nvrtc_compile, nvrtc_version

        self.spec, self.cp = spec, cp
        self.parts = free_parts(spec)
        source = encoder_source(self.parts)
        cache = KernelCache() if cache is None else cache
        what = f"the encoding kernels of model {spec.content_hash()}"
        cubin = cached_cubin(cache, lambda: nvrtc_compile(source, arch_digits, NVRTC_OPTIONS, what),
                             backend="cuda-encoding", device=f"sm_{arch_digits}", compiler=f"nvrtc-{nvrtc_version()}",
                             options=NVRTC_OPTIONS, source=source)
        self._errors = device_errors(cp)
        try:
            self.module = LoadedModule(cp, cubin, free_kernels(self.parts))
        except self._errors as exc:
            raise LaunchError(f"loading {what} failed: {exc}") from exc

    def _launch(self, name: str, grid: tuple, block: tuple, args: tuple) -> None:
        try:
            self.module.kernel(name)(grid, block, args)
        except self._errors as exc:
            raise LaunchError(f"launching {name} failed: {exc}") from exc

    def encode_rows(self, x: Any) -> Any:
        """The encoded input (rows × n_encoded_dims, fp32, row-major) of device rows ``x`` (fp32,
        C-contiguous, rows × n_input_dims)."""
        rows = x.shape[0]
        try:
            out = self.cp.empty((rows, self.spec.n_encoded_dims), dtype=self.cp.float32)
        except self._errors as exc:
            raise LaunchError(f"allocating the encoded input of {rows} rows failed: {exc}") from exc
        launch_forward(self._launch, self.parts, x, None, rows, x.shape[1], out, "rows_f32", out.shape[1])
        return out


__all__ = ["DeviceEncoder", "FreePart", "encoder_source", "encodings_source", "free_kernels", "free_parts", "launch_backward",
           "launch_forward", "spherical_harmonics_source"]
