"""tiny-cuda-nn's grid encodings, spherical harmonics and triangle wave, in NumPy.

Written from tiny-cuda-nn's sources (``encodings/grid.h``, ``spherical_harmonics.h``,
``triangle_wave.h`` and the helpers of ``common_device.h``) and kept in their arithmetic order, so
that with float32 inputs the cpu backend computes what tcnn's fp32 kernels compute and with float64
the same formulas in float64 (the oracle). :func:`mmad.backends.numerics.encode` dispatches here.

A grid level maps an input ``x`` (one value per dim, nominally in [0, 1]) to ``pos = x·scale +
0.5`` (tcnn's fmaf), its cell ``floor(pos)`` and the fraction inside it (through smoothstep for
``Smoothstep``), and interpolates the 2^dims corner rows of the level's table (``Linear``,
``Smoothstep``) or takes the cell's own row (``Nearest``). A corner's row is its dense index
Σ corner_d·resolution^d where that fits 32 bits, else (and for a HashGrid whose level holds fewer
rows than the dense grid) tcnn's coherent prime hash; either modulo the level's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import numpy as np

from mmad.spec import EncodingSpec, GridLevel, MLPSpec

# tcnn's coherent_prime_hash factors (the first is 1: neighbouring cells along x stay neighbours)
HASH_PRIMES = (1, 2654435761, 805459861, 3674653429, 2097192037, 1434869437, 2165219737)
# grid_index's largest resolution per dim count whose dense index cannot overflow 32 bits
_MAX_DENSE_BASE = {1: 0xFFFFFFFF, 2: 0xFFFF, 3: 0x659, 4: 0xFF}
_U32 = np.uint64(0xFFFFFFFF)
GRID_OTYPES = ("HashGrid", "DenseGrid", "TiledGrid")  # the encodings with trainable tables

# -- grids -----------------------------------------------------------------------------------
@dataclass
class GridLookup:
    """Where one grid part's rows read the table: ``rows`` (rows × levels × corners, into the
    whole table) and the interpolation ``weights`` (same shape, the working dtype); for the input
    gradient, each level's ``fractions`` (rows × levels × dims, after smoothstep where it
    applies), d fraction / d position (``slopes``, same shape) and ``scales`` (tcnn's scale per
    level: d position / d input)."""

    rows: np.ndarray
    weights: np.ndarray
    fractions: np.ndarray | None = None
    slopes: np.ndarray | None = None
    scales: tuple[float, ...] = ()
    interpolation: str = "Linear"


def _positions(x: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(cell as uint32 values in uint64, fraction in x's dtype) of ``x·scale + 0.5`` per value."""
    if x.dtype == np.float32:  # tcnn's fmaf: the product is exact in float64, one rounding after the add
        pos = (x.astype(np.float64) * scale + 0.5).astype(np.float32)
    else:
        pos = x * scale + 0.5
    cell = np.floor(pos)
    with np.errstate(invalid="ignore"):  # NaN or huge inputs: any cell; their output is NaN anyway
        grid = (cell.astype(np.int64) & 0xFFFFFFFF).astype(np.uint64)  # tcnn's (uint32_t)(int)floorf
    return grid, pos - cell


def grid_index_modes(part: EncodingSpec, dims: int) -> list[str]:
    """How each level of a grid part of ``dims`` dims turns a corner into a row (tcnn's
    grid_index): "dense" (Σ corner_d·resolution^d, wrapping at 32 bits) where the dense index fits
    32 bits, else "zero" (tcnn's stride 2^32 − 1 leaves index 0), both replaced by "hash" in a
    HashGrid level holding fewer rows than that stride; the row is then taken modulo the level's
    rows. The device backends' kernels follow the same list."""
    modes = []
    for info in part.grid_levels(dims):
        fits = info.resolution <= _MAX_DENSE_BASE[dims]
        if part.grid_type == "Hash" and (not fits or info.entries < info.resolution**dims):
            modes.append("hash")
        else:
            modes.append("dense" if fits else "zero")
    return modes


def grid_lookup(part: EncodingSpec, x: np.ndarray) -> GridLookup:
    """The table rows and weights every level of a grid part reads for the rows of ``x``
    (rows × dims, float32 or float64)."""
    rows, dims = x.shape
    corners = 1 if part.interpolation == "Nearest" else 1 << dims
    levels = part.grid_levels(dims)
    modes = grid_index_modes(part, dims)
    index = np.empty((rows, len(levels), corners), np.int64)
    weights = np.empty((rows, len(levels), corners), x.dtype)
    fractions = np.empty((rows, len(levels), dims), x.dtype)
    slopes = np.ones((rows, len(levels), dims), x.dtype)
    one = x.dtype.type(1)
    for level, info in enumerate(levels):
        cell, frac = _positions(x, info.scale)
        if part.interpolation == "Smoothstep":  # tcnn's smoothstep and smoothstep_derivative
            slopes[:, level] = x.dtype.type(6) * frac * (one - frac)
            frac = frac * frac * (x.dtype.type(3) - x.dtype.type(2) * frac)
        fractions[:, level] = frac
        mode = modes[level]
        hashed, fits = mode == "hash", mode == "dense"
        for corner in range(corners):
            offsets = [(corner >> d) & 1 for d in range(dims)]
            local = [cell[:, d] + np.uint64(offsets[d]) if offsets[d] else cell[:, d] for d in range(dims)]
            if hashed:
                idx = np.zeros(rows, np.uint64)
                for d in range(dims):
                    idx ^= (local[d] * np.uint64(HASH_PRIMES[d])) & _U32
            else:  # the dense index, wrapping at 32 bits where a corner lies past the grid's edge
                idx, stride = np.zeros(rows, np.uint64), 1
                for d in range(dims if fits else 0):
                    idx = (idx + local[d] * np.uint64(stride)) & _U32
                    stride *= info.resolution
            index[:, level, corner] = (idx % np.uint64(info.entries)).astype(np.int64) + info.offset
            if corners > 1:  # tcnn multiplies the dims' factors in dim order
                w = np.ones(rows, x.dtype)
                for d in range(dims):
                    w = w * (frac[:, d] if offsets[d] else one - frac[:, d])
                weights[:, level, corner] = w
            else:
                weights[:, level, corner] = one
    return GridLookup(index, weights, fractions, slopes, tuple(info.scale for info in levels), part.interpolation)


def grid_forward(lookup: GridLookup, table: np.ndarray) -> np.ndarray:
    """Rows × (levels · features): level l's features at columns l·F … l·F + F − 1 (tcnn's order)."""
    values = table[lookup.rows]  # rows × levels × corners × features
    out = np.einsum("rlc,rlcf->rlf", lookup.weights, values)
    return out.reshape(out.shape[0], -1)


def grid_backward(lookup: GridLookup, d_out: np.ndarray, entries: int) -> np.ndarray:
    """d loss / d table (entries × features) from d loss / d output (rows × levels·features): each
    output's gradient times each corner's weight, added into the corner's row (tcnn's atomic
    scatter-add; here a bincount, summed in float64)."""
    rows, levels, corners = lookup.rows.shape
    features = d_out.shape[1] // levels
    d = d_out.reshape(rows, levels, 1, features)
    flat = lookup.rows.reshape(-1)
    grad = np.empty((entries, features), d_out.dtype)
    for f in range(features):
        grad[:, f] = np.bincount(flat, weights=(lookup.weights * d[..., f]).reshape(-1), minlength=entries)
    return grad


def grid_input_gradient(lookup: GridLookup, d_out: np.ndarray, table: np.ndarray) -> np.ndarray:
    """d loss / d input (rows × dims) of one grid part from d loss / d its output (rows ×
    levels·features), as tcnn's kernel_grid computes dy_dx and kernel_grid_backward_input sums it:
    per level and dim, scale · Σ over the corner pairs along the dim of the other dims' weights ·
    (right value − left value) · d fraction / d position. Nearest interpolation has none (0)."""
    rows, levels, corners = lookup.rows.shape
    dims = lookup.fractions.shape[2]
    out = np.zeros((rows, dims), d_out.dtype)
    if lookup.interpolation == "Nearest":
        return out
    features = d_out.shape[1] // levels
    values = table[lookup.rows]  # rows × levels × corners × features
    d = d_out.reshape(rows, levels, features)
    frac = lookup.fractions
    one = frac.dtype.type(1)
    for dim in range(dims):
        slope = np.zeros((rows, levels, features), d_out.dtype)
        for corner in range(corners):
            if not (corner >> dim) & 1:
                continue
            weight = np.ones((rows, levels), frac.dtype)
            for other in range(dims):
                if other != dim:
                    weight = weight * (frac[:, :, other] if (corner >> other) & 1 else one - frac[:, :, other])
            left = corner & ~(1 << dim)
            slope += weight[:, :, None] * (values[:, :, corner] - values[:, :, left])
        scale = np.asarray(lookup.scales, d_out.dtype)[None, :, None]
        per_level = scale * slope * lookup.slopes[:, :, dim, None]
        out[:, dim] = (per_level * d).sum(axis=(1, 2))
    return out


@dataclass(frozen=True)
class GridPart:
    """One grid part of an encoding as the device backends' kernels compute it (tcnn's grid.h, as
    :func:`grid_lookup`): it reads raw input dims ``begin`` … ``begin + dims − 1`` of the kernel
    input and fills encoded columns ``column`` … ``column + width − 1``; its table, the parameter
    ``grid{index}``, starts at value ``offset`` of the backend's flat table values."""

    index: int
    begin: int
    dims: int
    column: int
    levels: tuple[GridLevel, ...]
    modes: tuple[str, ...]  # per level: "dense", "hash" or "zero" (grid_index_modes)
    features: int
    interpolation: str
    offset: int

    @property
    def corners(self) -> int:
        return 1 if self.interpolation == "Nearest" else 1 << self.dims

    @property
    def width(self) -> int:
        return len(self.levels) * self.features

    @property
    def lookups(self) -> int:
        """Table reads per input row: levels × corners."""
        return len(self.levels) * self.corners

    @property
    def entries(self) -> int:
        """Rows of the whole table (all levels)."""
        return self.levels[-1].offset + self.levels[-1].entries


def grid_input_layout(spec: MLPSpec, first_offset: int = 0
                      ) -> tuple[tuple[GridPart, ...], tuple[tuple[int, int, int], ...], int]:
    """How a device backend's kernels read a grid model's input: (the grid parts, their tables
    from value ``first_offset`` on, back to back; the host-encoded parts as (first encoded
    column, width, column in the kernel input); the kernel input's columns). The kernel input is
    the raw input followed by the host-encoded columns of the parameter-free parts; the kernels
    compute the grid columns from the raw dims."""
    grids, host, column, host_column, offset = [], [], 0, spec.n_input_dims, first_offset
    for part, begin, dims in spec.encoding.parts(spec.n_input_dims):
        width = part.n_output_dims(dims)
        if part.is_grid:
            grid = GridPart(len(grids), begin, dims, column, part.grid_levels(dims), tuple(grid_index_modes(part, dims)),
                            part.n_features_per_level, part.interpolation, offset)
            grids.append(grid)
            offset += grid.entries * grid.features
        else:
            host.append((column, width, host_column))
            host_column += width
        column += width
    return tuple(grids), tuple(host), host_column


# -- spherical harmonics -------------------------------------------------------------------------
def spherical_harmonics(degree: int, x: Any, xp: Any = np) -> Any:
    """tcnn's ``sh_enc``: inputs in [0, 1]^3 mapped to directions 2x − 1, then the real spherical
    harmonics of bands 0 … degree − 1 (degree² columns), with tcnn's constants and expressions
    (scripts/gen_sh.py there). Exact only for unit directions, like tcnn's. ``xp``: the array
    namespace (``full_like`` and ``stack``) of ``x``: NumPy here, torch or an ONNX graph's values
    for ``mmad.export``; Python scalars keep x's dtype in each."""
    d = x * 2.0 - 1.0
    x, y, z = d[:, 0], d[:, 1], d[:, 2]
    xy, xz, yz, x2, y2, z2 = x * y, x * z, y * z, x * x, y * y, z * z
    x4, y4, z4 = x2 * x2, y2 * y2, z2 * z2
    x6, y6, z6 = x4 * x2, y4 * y2, z4 * z2
    c = [xp.full_like(x, 0.28209479177387814)]
    if degree > 1:
        c += [-0.48860251190291987 * y, 0.48860251190291987 * z, -0.48860251190291987 * x]
    if degree > 2:
        c += [1.0925484305920792 * xy, -1.0925484305920792 * yz, 0.94617469575755997 * z2 - 0.31539156525251999,
              -1.0925484305920792 * xz, 0.54627421529603959 * x2 - 0.54627421529603959 * y2]
    if degree > 3:
        c += [0.59004358992664352 * y * (-3.0 * x2 + y2), 2.8906114426405538 * xy * z,
              0.45704579946446572 * y * (1.0 - 5.0 * z2), 0.3731763325901154 * z * (5.0 * z2 - 3.0),
              0.45704579946446572 * x * (1.0 - 5.0 * z2), 1.4453057213202769 * z * (x2 - y2),
              0.59004358992664352 * x * (-x2 + 3.0 * y2)]
    if degree > 4:
        c += [2.5033429417967046 * xy * (x2 - y2), 1.7701307697799304 * yz * (-3.0 * x2 + y2),
              0.94617469575756008 * xy * (7.0 * z2 - 1.0), 0.66904654355728921 * yz * (3.0 - 7.0 * z2),
              -3.1735664074561294 * z2 + 3.7024941420321507 * z4 + 0.31735664074561293,
              0.66904654355728921 * xz * (3.0 - 7.0 * z2), 0.47308734787878004 * (x2 - y2) * (7.0 * z2 - 1.0),
              1.7701307697799304 * xz * (-x2 + 3.0 * y2),
              -3.7550144126950569 * x2 * y2 + 0.62583573544917614 * x4 + 0.62583573544917614 * y4]
    if degree > 5:
        c += [0.65638205684017015 * y * (10.0 * x2 * y2 - 5.0 * x4 - y4), 8.3026492595241645 * xy * z * (x2 - y2),
              -0.48923829943525038 * y * (3.0 * x2 - y2) * (9.0 * z2 - 1.0),
              4.7935367849733241 * xy * z * (3.0 * z2 - 1.0), 0.45294665119569694 * y * (14.0 * z2 - 21.0 * z4 - 1.0),
              0.1169503224534236 * z * (-70.0 * z2 + 63.0 * z4 + 15.0),
              0.45294665119569694 * x * (14.0 * z2 - 21.0 * z4 - 1.0),
              2.3967683924866621 * z * (x2 - y2) * (3.0 * z2 - 1.0),
              -0.48923829943525038 * x * (x2 - 3.0 * y2) * (9.0 * z2 - 1.0),
              2.0756623148810411 * z * (-6.0 * x2 * y2 + x4 + y4), 0.65638205684017015 * x * (10.0 * x2 * y2 - x4 - 5.0 * y4)]
    if degree > 6:
        c += [1.3663682103838286 * xy * (-10.0 * x2 * y2 + 3.0 * x4 + 3.0 * y4),
              2.3666191622317521 * yz * (10.0 * x2 * y2 - 5.0 * x4 - y4),
              2.0182596029148963 * xy * (x2 - y2) * (11.0 * z2 - 1.0),
              -0.92120525951492349 * yz * (3.0 * x2 - y2) * (11.0 * z2 - 3.0),
              0.92120525951492349 * xy * (-18.0 * z2 + 33.0 * z4 + 1.0),
              0.58262136251873131 * yz * (30.0 * z2 - 33.0 * z4 - 5.0),
              6.6747662381009842 * z2 - 20.024298714302954 * z4 + 14.684485723822165 * z6 - 0.31784601133814211,
              0.58262136251873131 * xz * (30.0 * z2 - 33.0 * z4 - 5.0),
              0.46060262975746175 * (x2 - y2) * (11.0 * z2 * (3.0 * z2 - 1.0) - 7.0 * z2 + 1.0),
              -0.92120525951492349 * xz * (x2 - 3.0 * y2) * (11.0 * z2 - 3.0),
              0.50456490072872406 * (11.0 * z2 - 1.0) * (-6.0 * x2 * y2 + x4 + y4),
              2.3666191622317521 * xz * (10.0 * x2 * y2 - x4 - 5.0 * y4),
              10.247761577878714 * x2 * y4 - 10.247761577878714 * x4 * y2 + 0.6831841051919143 * x6
              - 0.6831841051919143 * y6]
    if degree > 7:
        c += [0.70716273252459627 * y * (-21.0 * x2 * y4 + 35.0 * x4 * y2 - 7.0 * x6 + y6),
              5.2919213236038001 * xy * z * (-10.0 * x2 * y2 + 3.0 * x4 + 3.0 * y4),
              -0.51891557872026028 * y * (13.0 * z2 - 1.0) * (-10.0 * x2 * y2 + 5.0 * x4 + y4),
              4.1513246297620823 * xy * z * (x2 - y2) * (13.0 * z2 - 3.0),
              -0.15645893386229404 * y * (3.0 * x2 - y2) * (13.0 * z2 * (11.0 * z2 - 3.0) - 27.0 * z2 + 3.0),
              0.44253269244498261 * xy * z * (-110.0 * z2 + 143.0 * z4 + 15.0),
              0.090331607582517306 * y * (-135.0 * z2 + 495.0 * z4 - 429.0 * z6 + 5.0),
              0.068284276912004949 * z * (315.0 * z2 - 693.0 * z4 + 429.0 * z6 - 35.0),
              0.090331607582517306 * x * (-135.0 * z2 + 495.0 * z4 - 429.0 * z6 + 5.0),
              0.07375544874083044 * z * (x2 - y2) * (143.0 * z2 * (3.0 * z2 - 1.0) - 187.0 * z2 + 45.0),
              -0.15645893386229404 * x * (x2 - 3.0 * y2) * (13.0 * z2 * (11.0 * z2 - 3.0) - 27.0 * z2 + 3.0),
              1.0378311574405206 * z * (13.0 * z2 - 3.0) * (-6.0 * x2 * y2 + x4 + y4),
              -0.51891557872026028 * x * (13.0 * z2 - 1.0) * (-10.0 * x2 * y2 + x4 + 5.0 * y4),
              2.6459606618019 * z * (15.0 * x2 * y4 - 15.0 * x4 * y2 + x6 - y6),
              0.70716273252459627 * x * (-35.0 * x2 * y4 + 21.0 * x4 * y2 - x6 + 7.0 * y6)]
    out = xp.stack(c, 1)
    return out.astype(x.dtype, copy=False) if xp is np else out


# -- triangle wave ---------------------------------------------------------------------------------
def triangle_wave(n_frequencies: int, x: np.ndarray) -> np.ndarray:
    """tcnn's ``TriangleWave``: for dim j and frequency k (column j·n + k), v = x_j·2^(k−1) + k/4
    (the phase shift tells the frequencies apart), out = 4·|v − floor(v) − 1/2| − 1."""
    t = x.dtype.type
    k = np.arange(n_frequencies)
    v = np.ldexp(x[:, :, None], (k - 1).astype(np.int32)) + (k * 0.25).astype(x.dtype)
    out = np.abs(v - np.floor(v) - t(0.5)) * t(4) - t(1)
    return out.reshape(x.shape[0], -1)


def triangle_wave_input_gradient(n_frequencies: int, x: np.ndarray, d_out: np.ndarray) -> np.ndarray:
    """d loss / d input of ``triangle_wave`` (tcnn's triangle_wave_encoding dy_dx): ±2^(k+1) per
    frequency, negative where floor(2v) is even (the falling half of the wave)."""
    k = np.arange(n_frequencies)
    v = np.ldexp(x[:, :, None], (k - 1).astype(np.int32)) + (k * 0.25).astype(x.dtype)
    sign = np.where(np.fmod(np.floor(v * x.dtype.type(2)), 2) == 0, x.dtype.type(-1), x.dtype.type(1))
    dy_dx = np.ldexp(sign, (k + 1).astype(np.int32))
    return (d_out.reshape(x.shape[0], x.shape[1], n_frequencies) * dy_dx).sum(axis=2)


class _Dual:
    """A value and its derivative along one input direction, with the arithmetic the spherical
    harmonics' formula uses: the formula evaluated on these gives its exact derivative (tcnn's
    sh_enc_grad is the same polynomials differentiated)."""

    def __init__(self, value, slope):
        self.value, self.slope = value, slope

    def __add__(self, o):
        return _Dual(self.value + o.value, self.slope + o.slope) if isinstance(o, _Dual) else _Dual(self.value + o, self.slope)

    __radd__ = __add__

    def __sub__(self, o):
        return _Dual(self.value - o.value, self.slope - o.slope) if isinstance(o, _Dual) else _Dual(self.value - o, self.slope)

    def __rsub__(self, o):
        return _Dual(o - self.value, -self.slope)

    def __mul__(self, o):
        if isinstance(o, _Dual):
            return _Dual(self.value * o.value, self.slope * o.value + self.value * o.slope)
        return _Dual(self.value * o, self.slope * o)

    __rmul__ = __mul__

    def __neg__(self):
        return _Dual(-self.value, -self.slope)

    def __getitem__(self, key):
        return _Dual(self.value[key], self.slope[key])

    @property
    def dtype(self):
        return self.value.dtype

    @staticmethod
    def full_like(v: "_Dual", value: float) -> "_Dual":
        return _Dual(np.full_like(v.value, value), np.zeros_like(v.slope))

    @staticmethod
    def stack(values: list["_Dual"], axis: int) -> "_Dual":
        return _Dual(np.stack([v.value for v in values], axis), np.stack([v.slope for v in values], axis))


def spherical_harmonics_input_gradient(degree: int, x: np.ndarray, d_out: np.ndarray) -> np.ndarray:
    """d loss / d input of ``spherical_harmonics`` (tcnn's kernel_sh_backward): the gradient of
    the polynomials in the direction 2x − 1, times 2 for that map."""
    out = np.empty((x.shape[0], 3), d_out.dtype)
    for dim in range(3):
        seed = np.zeros_like(x)
        seed[:, dim] = 1
        jac = spherical_harmonics(degree, _Dual(x, seed), _Dual).slope  # rows × degree², d/dx_dim (2x − 1 inside)
        out[:, dim] = (jac * d_out).sum(axis=1)
    return out


__all__ = ["GRID_OTYPES", "GridLookup", "GridPart", "HASH_PRIMES", "grid_backward", "grid_forward",
           "grid_index_modes", "grid_input_gradient", "grid_input_layout", "grid_lookup", "spherical_harmonics",
           "spherical_harmonics_input_gradient", "triangle_wave", "triangle_wave_input_gradient"]
