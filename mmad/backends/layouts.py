"""Linear layouts over GF(2): the layout engine every MMA kernel relies on.

A :class:`LinearLayout` maps labelled *input* dimensions (hardware indices such as
``register``, ``lane``, ``warp``, or ``offset`` for memory), each a number of bits, to labelled
*output* dimensions (tensor coordinates such as ``row`` and ``col``), each a power-of-two size,
by a matrix over GF(2): every input bit has an image (one value per output dimension), and the
image of an index is the XOR of the images of its set bits. This is the representation of the
"Linear Layouts" paper (arXiv 2505.23819) behind Triton's layout engine. Composition is a matrix
product, inversion is Gaussian elimination, swizzles are XORs.

Conventions (shared with the kernels that code against this module):

- The first input dimension is the least significant part of the *flattened input index*
  (``register + n_registers * (lane + 32 * warp)``); :func:`pack` orders its output by it.
- The ``register`` dimension of fragment layouts counts *elements* in the PTX ISA's order
  (``a0, a1, ...``, ``d0, d1, ...``). For 16-bit types two elements share a 32-bit register:
  element ``i`` is the ``i & 1`` half (low half first) of 32-bit register ``i >> 1``.
- ``row``/``col`` are element coordinates. For shared-memory operands ``row`` is the M (or N)
  index and ``col`` the K index, whatever the major-ness; ``offset`` counts elements.

Constructors cover what our kernels use: row/column-major blocks, CUTLASS ``Swizzle<B,M,S>``,
the mma.sync m16n8k16 A/B/C fragments, the wgmma m64nNk16 accumulator and A-from-registers
fragments, and the wgmma shared-memory operand layouts (K- or MN-major, no swizzle or
32/64/128-byte swizzle). Uses: :func:`pack`/:func:`unpack` (host-side images of what a kernel
holds), :func:`register_permutation` (is an accumulator -> A-operand conversion a per-thread
register shuffle?) and :func:`index_expression` (XOR/shift expressions for CUDA or GLSL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from mmad.errors import MMADError

__all__ = [
    "LayoutError",
    "LinearLayout",
    "LaneCrossing",
    "WgmmaDescriptor",
    "swizzle",
    "row_major",
    "col_major",
    "mma_m16n8k16_a",
    "mma_m16n8k16_b",
    "mma_m16n8k16_c",
    "wgmma_accumulator",
    "wgmma_a_registers",
    "wgmma_smem_operand",
    "wgmma_smem_descriptor",
    "pack",
    "unpack",
    "register_permutation",
    "first_lane_crossing",
    "explain_register_permutation",
    "index_expression",
]


class LayoutError(MMADError, ValueError):
    """A layout is malformed, or an operation does not apply to the layouts given."""


def _log2_exact(size: int, what: str) -> int:
    if not isinstance(size, (int, np.integer)) or size < 1 or size & (size - 1):
        raise LayoutError(f"{what} must be a positive power of two, got {size!r}")
    return int(size).bit_length() - 1


class LinearLayout:
    """A linear map over GF(2) from named input bit-spaces to named output dimensions.

    ``bases[in_dim][j]`` is the image of input bit ``j`` of ``in_dim``: a tuple with one value
    per output dimension, in ``out_dims`` order. Layouts are immutable values.
    """

    __slots__ = ("_in_bits", "_out_bits", "_bases", "_columns")

    def __init__(
        self,
        bases: Mapping[str, Sequence[Sequence[int]]],
        out_dims: Mapping[str, int] | Sequence[tuple[str, int]],
    ):
        out_items = list(out_dims.items()) if isinstance(out_dims, Mapping) else list(out_dims)
        out_names = [name for name, _ in out_items]
        if len(set(out_names)) != len(out_names):
            raise LayoutError(f"duplicate output dimension in {out_names}")
        self._out_bits = {name: _log2_exact(size, f"size of output dim {name!r}") for name, size in out_items}
        self._in_bits: dict[str, int] = {}
        self._bases: dict[str, tuple[tuple[int, ...], ...]] = {}
        for in_dim, images in bases.items():
            rows = []
            for j, image in enumerate(images):
                image = tuple(int(v) for v in image)
                if len(image) != len(out_items):
                    raise LayoutError(
                        f"basis {in_dim}[{j}] = {image} has {len(image)} values, expected one per "
                        f"output dimension {out_names}"
                    )
                for (name, size), value in zip(out_items, image):
                    if not 0 <= value < size:
                        raise LayoutError(f"basis {in_dim}[{j}]: {name}={value} is outside [0, {size})")
                rows.append(image)
            self._in_bits[in_dim] = len(rows)
            self._bases[in_dim] = tuple(rows)
        self._columns = self._flatten_columns()

    # ----------------------------------------------------------------- construction helpers
    @classmethod
    def from_bases(
        cls,
        bases: Mapping[str, Sequence[Sequence[int] | Mapping[str, int]]],
        out_dims: Mapping[str, int] | Sequence[tuple[str, int]] | Sequence[str],
    ) -> "LinearLayout":
        """Build a layout from basis images.

        ``bases`` maps each input dim to the images of its bits, lowest bit first; an image is a
        sequence (one value per output dim) or a mapping ``{out_dim: value}`` (missing dims are 0).
        ``out_dims`` is ``{name: size}``, a sequence of ``(name, size)``, or just names, in which
        case each size is the smallest power of two holding every value.
        """
        out_seq = list(out_dims.items()) if isinstance(out_dims, Mapping) else list(out_dims)
        names = [item if isinstance(item, str) else item[0] for item in out_seq]
        normalized: dict[str, list[tuple[int, ...]]] = {}
        for in_dim, images in bases.items():
            rows = []
            for image in images:
                if isinstance(image, Mapping):
                    unknown = set(image) - set(names)
                    if unknown:
                        raise LayoutError(f"basis of {in_dim!r} names unknown output dims {sorted(unknown)}")
                    rows.append(tuple(int(image.get(name, 0)) for name in names))
                else:
                    rows.append(tuple(int(v) for v in image))
            normalized[in_dim] = rows
        if all(isinstance(item, str) for item in out_seq):
            sizes = []
            for index, name in enumerate(names):
                largest = max((row[index] for rows in normalized.values() for row in rows if len(row) == len(names)), default=0)
                sizes.append(1 << int(largest).bit_length())
            out_seq = list(zip(names, sizes))
        return cls(normalized, out_seq)

    @classmethod
    def identity_1d(cls, size: int, in_dim: str, out_dim: str) -> "LinearLayout":
        """``in_dim = i -> out_dim = i`` for ``i < size``."""
        bits = _log2_exact(size, "identity size")
        return cls({in_dim: [(1 << j,) for j in range(bits)]}, [(out_dim, size)])

    @classmethod
    def zeros_1d(cls, size: int, in_dim: str, out_dim: str, out_size: int = 1) -> "LinearLayout":
        """Every ``in_dim`` index maps to ``out_dim = 0`` (a broadcast)."""
        bits = _log2_exact(size, "zeros size")
        return cls({in_dim: [(0,) for _ in range(bits)]}, [(out_dim, out_size)])

    @classmethod
    def empty(cls) -> "LinearLayout":
        """The layout with no dimensions; the unit of :meth:`product`."""
        return cls({}, [])

    # ----------------------------------------------------------------------- properties
    @property
    def in_dims(self) -> dict[str, int]:
        """Input dimension name -> size (``2 ** bits``), in flattening order (first is minor)."""
        return {name: 1 << bits for name, bits in self._in_bits.items()}

    @property
    def out_dims(self) -> dict[str, int]:
        """Output dimension name -> size, in order (first is minor in the flattened output)."""
        return {name: 1 << bits for name, bits in self._out_bits.items()}

    @property
    def in_dim_bits(self) -> dict[str, int]:
        return dict(self._in_bits)

    @property
    def out_dim_bits(self) -> dict[str, int]:
        return dict(self._out_bits)

    @property
    def bases(self) -> dict[str, list[tuple[int, ...]]]:
        """Input dim -> images of its bits (each a tuple in ``out_dims`` order)."""
        return {name: list(rows) for name, rows in self._bases.items()}

    @property
    def total_in_bits(self) -> int:
        return sum(self._in_bits.values())

    @property
    def total_out_bits(self) -> int:
        return sum(self._out_bits.values())

    @property
    def in_size(self) -> int:
        return 1 << self.total_in_bits

    @property
    def out_size(self) -> int:
        return 1 << self.total_out_bits

    # ----------------------------------------------------------------- matrix view (flat)
    def _out_offsets(self) -> dict[str, int]:
        offsets, at = {}, 0
        for name, bits in self._out_bits.items():
            offsets[name] = at
            at += bits
        return offsets

    def _flatten_columns(self) -> list[int]:
        """One int per input bit (flattening order): its image as a flat output bitmask."""
        offsets = list(self._out_offsets().values())
        return [
            sum(value << offset for value, offset in zip(image, offsets))
            for rows in self._bases.values()
            for image in rows
        ]

    def _unflatten_out(self, flat: int) -> dict[str, int]:
        result = {}
        for name, bits in self._out_bits.items():
            result[name] = flat & ((1 << bits) - 1)
            flat >>= bits
        return result

    def _flatten_in(self, inputs: Mapping[str, int]) -> int:
        unknown = set(inputs) - set(self._in_bits)
        if unknown:
            raise LayoutError(f"unknown input dims {sorted(unknown)}; this layout has {list(self._in_bits)}")
        flat, at = 0, 0
        for name, bits in self._in_bits.items():
            if name not in inputs:
                raise LayoutError(f"missing input dim {name!r}; this layout needs {list(self._in_bits)}")
            value = int(inputs[name])
            if not 0 <= value < (1 << bits):
                raise LayoutError(f"input {name}={value} is outside [0, {1 << bits})")
            flat |= value << at
            at += bits
        return flat

    def _apply_flat(self, flat: int) -> int:
        out, j = 0, 0
        while flat:
            if flat & 1:
                out ^= self._columns[j]
            flat >>= 1
            j += 1
        return out

    @classmethod
    def _from_columns(
        cls, columns: Sequence[int], in_bits: Mapping[str, int], out_bits: Mapping[str, int]
    ) -> "LinearLayout":
        bases: dict[str, list[tuple[int, ...]]] = {}
        it = iter(columns)
        for name, bits in in_bits.items():
            rows = []
            for _ in range(bits):
                flat = next(it)
                image = []
                for out_bits_of_dim in out_bits.values():
                    image.append(flat & ((1 << out_bits_of_dim) - 1))
                    flat >>= out_bits_of_dim
                rows.append(tuple(image))
            bases[name] = rows
        return cls(bases, [(name, 1 << bits) for name, bits in out_bits.items()])

    # ------------------------------------------------------------------------ evaluation
    def apply(self, **inputs: int) -> dict[str, int]:
        """Image of one hardware index: ``apply(register=3, lane=5) -> {"row": .., "col": ..}``."""
        return self._unflatten_out(self._apply_flat(self._flatten_in(inputs)))

    def flat_images(self) -> np.ndarray:
        """Flattened output index of every flattened input index (length ``in_size``)."""
        images = np.zeros(1, dtype=np.int64)
        for column in self._columns:
            images = np.concatenate([images, images ^ column])
        return images

    def coordinates(self) -> dict[str, np.ndarray]:
        """Output dim -> its value for every flattened input index."""
        images = self.flat_images()
        result = {}
        for name, bits in self._out_bits.items():
            result[name] = images & ((1 << bits) - 1)
            images = images >> bits
        return result

    # ------------------------------------------------------------------------ structure
    def rank(self) -> int:
        return len(_reduce(self._columns))

    def is_surjective(self) -> bool:
        return self.rank() == self.total_out_bits

    def is_injective(self) -> bool:
        return self.rank() == self.total_in_bits

    def is_invertible(self) -> bool:
        return self.is_surjective() and self.is_injective()

    # ------------------------------------------------------------------------ operations
    def compose(self, other: "LinearLayout") -> "LinearLayout":
        """``self`` first, then ``other``: the result maps ``x`` to ``other(self(x))``.

        ``other``'s input dims must be ``self``'s output dims (same names); each of ``self``'s
        output sizes must fit in the matching input of ``other``.
        """
        if set(self._out_bits) != set(other._in_bits):
            raise LayoutError(
                f"cannot compose: outputs {list(self._out_bits)} are not the inputs {list(other._in_bits)}"
            )
        for name, bits in self._out_bits.items():
            if bits > other._in_bits[name]:
                raise LayoutError(
                    f"cannot compose: output {name!r} has size {1 << bits} but the next layout "
                    f"only takes {1 << other._in_bits[name]}"
                )
        bases = {
            in_dim: [tuple(other.apply(**dict(zip(self._out_bits, image)))[o] for o in other._out_bits) for image in rows]
            for in_dim, rows in self._bases.items()
        }
        return LinearLayout(bases, list(other.out_dims.items()))

    def product(self, other: "LinearLayout") -> "LinearLayout":
        """Direct product (Triton's ``operator*``): ``self``'s bits are the low bits.

        Input dims in both get ``other``'s bits appended above ``self``'s; output dims in both
        multiply in size, ``other``'s values shifted above ``self``'s. Dims only in one layout
        are kept as they are (``self``'s dims first).
        """
        in_bits = dict(self._in_bits)
        for name, bits in other._in_bits.items():
            in_bits[name] = in_bits.get(name, 0) + bits
        out_bits = dict(self._out_bits)
        for name, bits in other._out_bits.items():
            out_bits[name] = out_bits.get(name, 0) + bits
        out_names = list(out_bits)

        def lift(layout: "LinearLayout", image: tuple[int, ...], shift: Mapping[str, int]) -> tuple[int, ...]:
            values = dict(zip(layout._out_bits, image))
            return tuple(values.get(name, 0) << shift.get(name, 0) for name in out_names)

        other_shift = {name: self._out_bits.get(name, 0) for name in other._out_bits}
        bases: dict[str, list[tuple[int, ...]]] = {name: [] for name in in_bits}
        for name, rows in self._bases.items():
            bases[name].extend(lift(self, image, {}) for image in rows)
        for name, rows in other._bases.items():
            bases[name].extend(lift(other, image, other_shift) for image in rows)
        return LinearLayout(bases, [(name, 1 << bits) for name, bits in out_bits.items()])

    __mul__ = product

    def inverse(self) -> "LinearLayout":
        """The inverse of a bijective layout: output dims become input dims and vice versa."""
        if self.total_in_bits != self.total_out_bits or not self.is_invertible():
            raise LayoutError(
                f"layout is not invertible (in bits {self.total_in_bits}, out bits "
                f"{self.total_out_bits}, rank {self.rank()})"
            )
        return self.right_inverse()

    def right_inverse(self) -> "LinearLayout":
        """A layout ``R`` from this layout's outputs to its inputs with ``self(R(y)) == y``.

        Exists when the layout is surjective; among the solutions, ``R`` uses only the lowest
        input bits that span the output (Gaussian elimination picks the first pivots).
        """
        reduced = _reduce(self._columns)
        if len(reduced) != self.total_out_bits:
            raise LayoutError(
                f"layout is not surjective (rank {len(reduced)} < {self.total_out_bits} output bits); "
                "no right inverse"
            )
        by_out_bit = {image.bit_length() - 1: combo for image, combo in reduced}
        solution = [by_out_bit[k] for k in range(self.total_out_bits)]
        return LinearLayout._from_columns(solution, self._out_bits, self._in_bits)

    def divide_left(self, divisor: "LinearLayout") -> "LinearLayout | None":
        """``C`` with ``self == divisor * C`` (``divisor`` occupies the low bits), or ``None``.

        Answers "does ``divisor`` factor out of this layout": e.g. whether the first 3 ``offset``
        bits move 8 consecutive columns (a 16-byte vector of fp16), or whether register pairs
        hold adjacent columns (one 32-bit register).
        """
        for name, bits in divisor._in_bits.items():
            if bits > self._in_bits.get(name, -1):
                return None
        for name, bits in divisor._out_bits.items():
            if bits > self._out_bits.get(name, -1):
                return None
        bases: dict[str, list[tuple[int, ...]]] = {}
        for name, rows in self._bases.items():
            low = divisor._in_bits.get(name, 0)
            for j in range(low):
                expected = dict(zip(divisor._out_bits, divisor._bases[name][j]))
                actual = dict(zip(self._out_bits, rows[j]))
                if any(actual[o] != expected.get(o, 0) for o in self._out_bits):
                    return None
            quotient_rows = []
            for image in rows[low:]:
                values = []
                for out_name, value in zip(self._out_bits, image):
                    shift = divisor._out_bits.get(out_name, 0)
                    if value & ((1 << shift) - 1):
                        return None
                    values.append(value >> shift)
                quotient_rows.append(tuple(values))
            bases[name] = quotient_rows
        out_sizes = [(name, 1 << (bits - divisor._out_bits.get(name, 0))) for name, bits in self._out_bits.items()]
        quotient = LinearLayout(bases, out_sizes)
        return quotient if (divisor * quotient).same_function(self) else None

    # ------------------------------------------------------------------- reshaping dims
    def rename(self, ins: Mapping[str, str] | None = None, outs: Mapping[str, str] | None = None) -> "LinearLayout":
        """Rename input and/or output dims (e.g. swap ``row``/``col`` to transpose a layout)."""
        ins, outs = dict(ins or {}), dict(outs or {})
        bases = {ins.get(name, name): rows for name, rows in self._bases.items()}
        return LinearLayout(bases, [(outs.get(name, name), 1 << bits) for name, bits in self._out_bits.items()])

    def transpose_outs(self, order: Sequence[str]) -> "LinearLayout":
        """The same map with output dims listed in ``order``."""
        if sorted(order) != sorted(self._out_bits):
            raise LayoutError(f"order {list(order)} is not a permutation of {list(self._out_bits)}")
        index = [list(self._out_bits).index(name) for name in order]
        bases = {name: [tuple(image[i] for i in index) for image in rows] for name, rows in self._bases.items()}
        return LinearLayout(bases, [(name, 1 << self._out_bits[name]) for name in order])

    def transpose_ins(self, order: Sequence[str]) -> "LinearLayout":
        """The same map with input dims listed (and flattened) in ``order``."""
        if sorted(order) != sorted(self._in_bits):
            raise LayoutError(f"order {list(order)} is not a permutation of {list(self._in_bits)}")
        return LinearLayout({name: self._bases[name] for name in order}, list(self.out_dims.items()))

    def same_function(self, other: "LinearLayout") -> bool:
        """Equal up to the order in which dims are listed (same names, sizes and images)."""
        if self._in_bits != other._in_bits or self._out_bits != other._out_bits:
            return False
        return self.transpose_ins(list(other._in_bits)).transpose_outs(list(other._out_bits)) == other

    # ------------------------------------------------------------------------- dunders
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LinearLayout):
            return NotImplemented
        return (
            list(self._in_bits.items()) == list(other._in_bits.items())
            and list(self._out_bits.items()) == list(other._out_bits.items())
            and self._bases == other._bases
        )

    def __hash__(self) -> int:
        return hash((tuple(self._in_bits.items()), tuple(self._out_bits.items()), tuple(self._bases.items())))

    def __str__(self) -> str:
        out_names = list(self._out_bits)
        lines = []
        for name, rows in self._bases.items():
            if not rows:
                lines.append(f" - {name} (no bits)")
            for j, image in enumerate(rows):
                target = ", ".join(f"{o}={v}" for o, v in zip(out_names, image))
                lines.append(f" {'-' if j == 0 else ' '} {name}={1 << j} -> ({target})")
        dims = ", ".join(f"{name} (size {1 << bits})" for name, bits in self._out_bits.items())
        lines.append(f"where out dims are: [{dims}]")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"LinearLayout.from_bases({self.bases!r}, {self.out_dims!r})"


# --------------------------------------------------------------------- GF(2) elimination
def _reduce(columns: Sequence[int]) -> list[tuple[int, int]]:
    """Reduced echelon form of the column images, earlier columns first.

    Returns ``(image, combo)`` pairs: ``combo`` is the flat mask of input bits whose images XOR
    to ``image``. Each image's lowest set bit (its pivot) appears in no other image, so with
    full output rank every image is a single output bit.
    """
    reduced: list[tuple[int, int]] = []
    for j, column in enumerate(columns):
        image, combo = column, 1 << j
        for pivot_image, pivot_combo in reduced:
            if image & (pivot_image & -pivot_image):
                image ^= pivot_image
                combo ^= pivot_combo
        if image:
            pivot = image & -image
            reduced = [(ri ^ image, rc ^ combo) if ri & pivot else (ri, rc) for ri, rc in reduced]
            reduced.append((image, combo))
    return reduced


# ------------------------------------------------------------------------- constructors
def swizzle(bits: int, base: int, shift: int, *, size: int | None = None, dim: str = "offset") -> LinearLayout:
    """CUTLASS ``Swizzle<B=bits, M=base, S=shift>`` as an ``offset -> offset`` layout.

    ``y = x ^ ((x & yyy_mask) >> S)`` with ``yyy_mask = ((1 << B) - 1) << (M + S)``: bits
    ``[M+S, M+S+B)`` are XORed into bits ``[M, M+B)``. ``size`` (default ``2 ** (B+M+S)``) is
    the number of offsets covered; bits above the mask pass through.
    """
    if bits < 0 or base < 0 or shift < 0:
        raise LayoutError(f"Swizzle<{bits},{base},{shift}>: parameters must be non-negative")
    if bits and shift < bits:
        raise LayoutError(f"Swizzle<{bits},{base},{shift}>: shift must be >= bits (masks would overlap)")
    n_bits = bits + base + shift if size is None else _log2_exact(size, "swizzle size")
    if n_bits < bits + base + shift:
        raise LayoutError(f"Swizzle<{bits},{base},{shift}> needs size >= {1 << (bits + base + shift)}")
    images = []
    for j in range(n_bits):
        value = 1 << j
        if bits and base + shift <= j < base + shift + bits:
            value |= 1 << (j - shift)
        images.append((value,))
    return LinearLayout({dim: images}, [(dim, 1 << n_bits)])


def row_major(rows: int, cols: int, in_dim: str = "offset") -> LinearLayout:
    """``offset = row * cols + col`` as ``offset -> (row, col)``."""
    return LinearLayout.identity_1d(cols, in_dim, "col") * LinearLayout.identity_1d(rows, in_dim, "row")


def col_major(rows: int, cols: int, in_dim: str = "offset") -> LinearLayout:
    """``offset = col * rows + row`` as ``offset -> (row, col)``."""
    return LinearLayout.identity_1d(rows, in_dim, "row") * LinearLayout.identity_1d(cols, in_dim, "col")


def _fragment(register: list, lane: list, warp: list | None, rows: int, cols: int) -> LinearLayout:
    bases = {"register": register, "lane": lane}
    if warp is not None:
        bases["warp"] = warp
    return LinearLayout(bases, [("row", rows), ("col", cols)])


# Within a warp, every m16n8k16 / m64nNk16 fragment splits the lane as groupID = lane >> 2
# (row) and threadID_in_group = lane & 3 (a pair of columns).
_LANE_ROW_COL_PAIRS = [(0, 2), (0, 4), (1, 0), (2, 0), (4, 0)]


def mma_m16n8k16_a() -> LinearLayout:
    """mma.sync m16n8k16 A (16x16, f16/bf16): a0..a7 of each lane -> (row, col)."""
    return _fragment([(0, 1), (8, 0), (0, 8)], _LANE_ROW_COL_PAIRS, None, 16, 16)


def mma_m16n8k16_b() -> LinearLayout:
    """mma.sync m16n8k16 B (16x8 = K x N, f16/bf16): b0..b3 -> (row=k, col=n)."""
    return _fragment([(1, 0), (8, 0)], [(2, 0), (4, 0), (0, 1), (0, 2), (0, 4)], None, 16, 8)


def mma_m16n8k16_c() -> LinearLayout:
    """mma.sync m16n8k16 C/D (16x8, f32 or f16): c0..c3 -> (row, col)."""
    return _fragment([(0, 1), (8, 0)], _LANE_ROW_COL_PAIRS, None, 16, 8)


_WGMMA_N = tuple(range(8, 257, 8))


def wgmma_accumulator(n: int, dtype: str = "f32") -> LinearLayout:
    """wgmma m64nNk16 accumulator D: (register=d_i, lane, warp in warpgroup) -> (row, col).

    f16 and f32 accumulators place elements identically (f16 packs d_{2j}, d_{2j+1} into one
    .f16x2 register). N must be a power of two here (8 .. 256).
    """
    if dtype not in ("f32", "f16"):
        raise LayoutError(f"wgmma accumulator dtype must be 'f32' or 'f16', got {dtype!r}")
    if n not in _WGMMA_N or n & (n - 1):
        raise LayoutError(f"wgmma m64nNk16 accumulator needs N a power of two in 8..256, got {n}")
    register = [(0, 1), (8, 0)] + [(0, 8 << j) for j in range((n // 8).bit_length() - 1)]
    return _fragment(register, _LANE_ROW_COL_PAIRS, [(16, 0), (32, 0)], 64, n)


def wgmma_a_registers(k: int = 16) -> LinearLayout:
    """wgmma m64nNk16 A from registers (f16/bf16): (register, lane, warp) -> (row, col).

    ``k=16`` is one instruction's fragment (a0..a7). A larger power-of-two ``k`` stacks the
    k16 slices along registers: slice ``s`` holds registers ``8s .. 8s+7``.
    """
    _log2_exact(k, "k")
    if k < 16:
        raise LayoutError(f"wgmma A fragment covers k=16 per instruction; got k={k}")
    register = [(0, 1), (8, 0), (0, 8)] + [(0, 16 << j) for j in range((k // 16).bit_length() - 1)]
    return _fragment(register, _LANE_ROW_COL_PAIRS, [(16, 0), (32, 0)], 64, k)


_SWIZZLE_MODES = {0: 0, 128: 1, 64: 2, 32: 3}  # swizzle bytes -> descriptor layout type


def _smem_geometry(rows: int, cols: int, major: str, swizzle_bytes: int, elem_bytes: int) -> tuple[int, int]:
    """Validate a wgmma smem operand request; returns (T elements per 16 B, atom width W)."""
    if major not in ("K", "MN"):
        raise LayoutError(f"major must be 'K' or 'MN', got {major!r}")
    if swizzle_bytes not in _SWIZZLE_MODES:
        raise LayoutError(f"swizzle_bytes must be one of 0, 32, 64, 128, got {swizzle_bytes!r}")
    if elem_bytes not in (1, 2, 4):
        raise LayoutError(f"elem_bytes must be 1, 2 or 4 (wgmma operand types), got {elem_bytes!r}")
    _log2_exact(rows, "rows")
    _log2_exact(cols, "cols")
    t = 16 // elem_bytes
    width = (swizzle_bytes or 16) // elem_bytes  # elements along the contiguous dim of one atom
    contiguous, strided = (cols, rows) if major == "K" else (rows, cols)
    contiguous_name, strided_name = ("cols (K)", "rows (MN)") if major == "K" else ("rows (MN)", "cols (K)")
    if contiguous % width:
        raise LayoutError(
            f"{major}-major with {swizzle_bytes or 'no'}-byte swizzle needs {contiguous_name} to be a "
            f"multiple of {width} elements ({swizzle_bytes or 16} bytes); got {contiguous}"
        )
    if strided % 8:
        raise LayoutError(f"{major}-major layouts need {strided_name} to be a multiple of 8; got {strided}")
    return t, width


def _smem_forward(rows: int, cols: int, major: str, width: int) -> LinearLayout:
    """(row, col) -> unswizzled element offset: atoms of 8 x ``width``, tiled MN first."""
    # CUTLASS tile_to_shape(GMMA atom, (rows, cols)): atoms walk the MN dim first, then K.
    if major == "K":
        row_strides = [width << j for j in range(3)] + [8 * width << j for j in range((rows // 8).bit_length() - 1)]
        col_strides = [1 << j for j in range(width.bit_length() - 1)] + [
            rows * width << j for j in range((cols // width).bit_length() - 1)
        ]
    else:
        row_strides = [1 << j for j in range(width.bit_length() - 1)] + [
            8 * width << j for j in range((rows // width).bit_length() - 1)
        ]
        col_strides = [width << j for j in range(3)] + [rows * 8 << j for j in range((cols // 8).bit_length() - 1)]
    return LinearLayout({"row": [(s,) for s in row_strides], "col": [(s,) for s in col_strides]}, [("offset", rows * cols)])


def wgmma_smem_operand(rows: int, cols: int, major: str, swizzle_bytes: int, elem_bytes: int = 2) -> LinearLayout:
    """Shared-memory image of a wgmma operand tile: ``offset`` (elements) -> (row, col).

    ``rows`` is the M (A operand) or N (B operand) extent, ``cols`` the K extent; ``major`` says
    which is contiguous in 16-byte core-matrix rows. Swizzle atoms (8 x ``swizzle_bytes``, or
    8 x 16 bytes without swizzle) are laid out as CUTLASS's canonical GMMA layouts: contiguous
    atoms, tiled along MN first, then K, with ``Swizzle<log2(swizzle_bytes/16), 4, 3>`` applied
    to byte addresses. The buffer must start on a ``8 * swizzle_bytes``-byte boundary.
    Use :func:`wgmma_smem_descriptor` for the matching descriptor fields.
    """
    _, width = _smem_geometry(rows, cols, major, swizzle_bytes, elem_bytes)
    forward = _smem_forward(rows, cols, major, width)
    if swizzle_bytes:
        # Swizzle<B,4,3> on bytes is Swizzle<B, 4 - log2(elem_bytes), 3> on element offsets.
        element_swizzle = swizzle((swizzle_bytes // 16).bit_length() - 1, 4 - (elem_bytes.bit_length() - 1), 3, size=rows * cols)
        forward = forward.compose(element_swizzle)
    return forward.inverse().transpose_outs(["row", "col"])


@dataclass(frozen=True)
class WgmmaDescriptor:
    """Fields of a wgmma shared-memory matrix descriptor for one instruction's operand.

    ``start_byte_offset`` is relative to the start of the packed tile; ``lbo``/``sbo`` are the
    leading/stride dimension byte offsets as the PTX ISA defines them for this major-ness.
    """

    start_byte_offset: int
    lbo: int
    sbo: int
    swizzle_bytes: int

    @property
    def layout_type(self) -> int:
        """Descriptor bits 62-63: 0 none, 1 128B, 2 64B, 3 32B."""
        return _SWIZZLE_MODES[self.swizzle_bytes]

    def encode(self, smem_base_address: int) -> int:
        """The 64-bit descriptor for a tile packed at shared-memory address ``smem_base_address``."""
        repeat = 8 * (self.swizzle_bytes or 16)
        if smem_base_address % repeat:
            raise LayoutError(
                f"tile base 0x{smem_base_address:x} must be {repeat}-byte aligned so the swizzle "
                "pattern starts there (descriptor base offset 0)"
            )

        def field(x: int) -> int:
            return (x & 0x3FFFF) >> 4

        start = smem_base_address + self.start_byte_offset
        return field(start) | field(self.lbo) << 16 | field(self.sbo) << 32 | self.layout_type << 62


def wgmma_smem_descriptor(
    rows: int, cols: int, major: str, swizzle_bytes: int, elem_bytes: int = 2, *, row0: int = 0, col0: int = 0
) -> WgmmaDescriptor:
    """Descriptor fields for the instruction operand starting at element (``row0``, ``col0``)
    of a tile packed with :func:`wgmma_smem_operand` (same arguments).

    ``col0`` must be a multiple of 16 (one k16 step). ``row0`` must be a multiple of 8
    (K-major) or of the swizzle atom width in elements (MN-major).
    """
    _, width = _smem_geometry(rows, cols, major, swizzle_bytes, elem_bytes)
    row_step = 8 if major == "K" else width
    if col0 % 16 or not 0 <= col0 < cols or row0 % row_step or not 0 <= row0 < rows:
        raise LayoutError(
            f"operand origin ({row0}, {col0}) must lie in the {rows}x{cols} tile with col0 % 16 == 0 "
            f"and row0 % {row_step} == 0"
        )
    start = _smem_forward(rows, cols, major, width).apply(row=row0, col=col0)["offset"] * elem_bytes
    atom_bytes = 8 * (swizzle_bytes or 16)
    k_group_bytes = rows * 8 * elem_bytes  # next 8 K (MN-major) or next 16 B of K (K-major, no swizzle)
    if major == "K":
        lbo = 16 * rows if not swizzle_bytes else 16  # swizzled K-major: unused, encodes as 1
        sbo = atom_bytes
    elif not swizzle_bytes:
        lbo, sbo = k_group_bytes, atom_bytes
    else:
        lbo, sbo = atom_bytes, k_group_bytes
    return WgmmaDescriptor(start, lbo, sbo, swizzle_bytes)


# -------------------------------------------------------------------------- pack / unpack
def _out_shape(layout: LinearLayout) -> tuple[int, ...]:
    return tuple(layout.out_dims.values())


def pack(array: np.ndarray, layout: LinearLayout) -> np.ndarray:
    """The 1-D image ``buffer[i] = array[layout(i)]`` over the flattened input index ``i``.

    ``array`` has the layout's output shape (output dims in order, e.g. ``(rows, cols)``). For a
    shared-memory layout the result's bytes are what the kernel expects at the tile's base; for
    a fragment layout, ``buffer[thread * n_registers + r]`` is element ``r`` of that thread.
    """
    array = np.asarray(array)
    if array.shape != _out_shape(layout):
        raise LayoutError(f"array shape {array.shape} does not match the layout's output shape {_out_shape(layout)}")
    coords = layout.coordinates()
    return np.ascontiguousarray(array[tuple(coords[name] for name in layout.out_dims)])


def unpack(buffer: np.ndarray, layout: LinearLayout, shape: Sequence[int] | None = None) -> np.ndarray:
    """Inverse of :func:`pack`: rebuild the array from its image.

    The layout must reach every element; where it holds an element more than once, every copy
    must agree. ``shape`` (default: the layout's output shape) reshapes the result.
    """
    buffer = np.asarray(buffer)
    if buffer.ndim != 1 or buffer.shape[0] != layout.in_size:
        raise LayoutError(f"buffer must be 1-D with {layout.in_size} elements, got shape {buffer.shape}")
    if not layout.is_surjective():
        raise LayoutError("layout does not reach every element; unpack would leave holes")
    coords = layout.coordinates()
    index = tuple(coords[name] for name in layout.out_dims)
    result = np.empty(_out_shape(layout), dtype=buffer.dtype)
    result[index] = buffer
    if not layout.is_injective():
        stored = result.view(np.uint8).reshape(result.shape + (-1,))[index]
        given = np.ascontiguousarray(buffer).view(np.uint8).reshape(buffer.shape + (-1,))
        if not np.array_equal(stored, given):
            raise LayoutError("buffer holds different values for copies of the same element")
    if shape is not None:
        if int(np.prod(shape)) != result.size:
            raise LayoutError(f"shape {tuple(shape)} does not hold {result.size} elements")
        result = result.reshape(tuple(shape))
    return result


# ------------------------------------------------------- accumulator -> operand conversion
@dataclass(frozen=True)
class LaneCrossing:
    """An element that two fragment layouts place in different threads."""

    coordinate: dict
    src_location: dict
    dst_location: dict

    def __str__(self) -> str:
        def where(loc: dict) -> str:
            return ", ".join(f"{k}={v}" for k, v in loc.items())

        coord = ", ".join(f"{k}={v}" for k, v in self.coordinate.items())
        return (
            f"element ({coord}) is held at ({where(self.src_location)}) in the source but must be at "
            f"({where(self.dst_location)}) in the destination: it would have to cross threads"
        )


def _tile_registers(dst: LinearLayout, src: LinearLayout) -> LinearLayout:
    """Repeat ``dst`` over ``src``'s output shape along extra register bits (last dim first)."""
    if set(dst.out_dims) != set(src.out_dims):
        raise LayoutError(f"layouts cover different dims: {list(src.out_dims)} vs {list(dst.out_dims)}")
    tiled = dst
    for name in reversed(list(dst.out_dims)):
        ratio_bits = src.out_dim_bits[name] - dst.out_dim_bits[name]
        if ratio_bits < 0:
            raise LayoutError(f"destination covers more of {name!r} ({dst.out_dims[name]}) than the source ({src.out_dims[name]})")
        if ratio_bits:
            tiled = tiled * LinearLayout.identity_1d(1 << ratio_bits, "register", name)
    return tiled.transpose_ins(list(dst.in_dims)).transpose_outs(list(src.out_dims))


def _conversion(src: LinearLayout, dst: LinearLayout) -> tuple[LinearLayout, LinearLayout, LinearLayout]:
    if "register" not in src.in_dims or "register" not in dst.in_dims:
        raise LayoutError("both layouts need a 'register' input dim")
    if set(src.in_dims) != set(dst.in_dims):
        raise LayoutError(f"layouts have different hardware dims: {list(src.in_dims)} vs {list(dst.in_dims)}")
    if not src.is_invertible():
        raise LayoutError("source layout must hold each element exactly once")
    dst_full = _tile_registers(dst, src)
    if not dst_full.is_invertible():
        raise LayoutError("destination layout must hold each element exactly once")
    src_inverse = src.inverse()
    # dst hardware index -> (row, col) -> src hardware index
    return dst_full, src_inverse, dst_full.compose(src_inverse).transpose_outs(list(dst_full.in_dims))


def first_lane_crossing(src: LinearLayout, dst: LinearLayout) -> LaneCrossing | None:
    """An element ``src`` and ``dst`` place in different threads (lane/warp), or ``None``.

    Checks basis vectors only: the conversion is linear, so if every basis element stays in
    its thread, every element does.
    """
    dst_full, src_inverse, mapping = _conversion(src, dst)
    thread_dims = [d for d in dst_full.in_dims if d != "register"]
    for in_dim, rows in mapping.bases.items():
        for j, image in enumerate(rows):
            target = dict(zip(mapping.out_dims, image))
            expected = {d: (1 << j if d == in_dim else 0) for d in thread_dims}
            if any(target[d] != expected[d] for d in thread_dims):
                dst_location = {d: (1 << j if d == in_dim else 0) for d in dst_full.in_dims}
                coordinate = dst_full.apply(**dst_location)
                return LaneCrossing(coordinate, src_inverse.apply(**coordinate), dst_location)
    return None


def register_permutation(src: LinearLayout, dst: LinearLayout) -> list[int] | None:
    """If converting ``src`` (e.g. an accumulator) to ``dst`` (e.g. the next A operand) keeps
    every element in its thread, the permutation: ``dst`` register ``r`` takes ``src`` register
    ``perm[r]``. Otherwise ``None`` (see :func:`first_lane_crossing` for why).

    When ``dst`` covers a smaller tile than ``src`` (wgmma A is m64k16, the accumulator m64nN),
    ``dst`` is repeated over ``src``'s tile on extra register bits, last output dim first: for
    (row, col) the k16 slice ``s`` occupies ``dst`` registers ``8s .. 8s+7``.
    """
    if first_lane_crossing(src, dst) is not None:
        return None
    _, _, mapping = _conversion(src, dst)
    zeros = {d: 0 for d in mapping.in_dims if d != "register"}
    return [mapping.apply(register=r, **zeros)["register"] for r in range(mapping.in_dims["register"])]


def explain_register_permutation(src: LinearLayout, dst: LinearLayout) -> str:
    """One line: the permutation, or the element that would have to cross threads."""
    crossing = first_lane_crossing(src, dst)
    if crossing is not None:
        return f"not a register permutation: {crossing}"
    perm = register_permutation(src, dst)
    kind = "the identity" if perm == list(range(len(perm))) else f"{perm}"
    return f"register permutation within each thread ({len(perm)} registers): {kind}"


# ---------------------------------------------------------------------- code generation
# ``register`` is a C/C++ keyword; everything else keeps its dim name.
_DEFAULT_VARIABLE_NAMES = {"register": "reg"}
_RESERVED_WORDS = {"register", "int", "uint", "unsigned", "float", "double", "half", "in", "out", "inout", "const", "return"}


def index_expression(layout: LinearLayout, out_dim: str, lang: str = "cuda", names: Mapping[str, str] | None = None) -> str:
    """An XOR/shift expression computing ``out_dim`` from unsigned variables named after the
    input dims (``register`` becomes ``reg``, a C keyword otherwise; ``names`` renames), pasteable into CUDA (``lang="cuda"``) or GLSL
    (``lang="glsl"``, literals get the ``u`` suffix so ``uint`` variables type-check).

    Every input bit contributes its image's set bits; the (input bit -> output bit) pairs that
    share one shift become a single ``(var & mask) << shift`` term, and terms are XORed (linear
    over GF(2), so overlapping terms combine correctly, as in a swizzle).
    """
    if lang not in ("cuda", "glsl"):
        raise LayoutError(f"lang must be 'cuda' or 'glsl', got {lang!r}")
    if out_dim not in layout.out_dims:
        raise LayoutError(f"{out_dim!r} is not an output dim of this layout ({list(layout.out_dims)})")
    suffix = "u" if lang == "glsl" else ""
    names = {**_DEFAULT_VARIABLE_NAMES, **(names or {})}
    for in_dim in layout.in_dims:
        var = names.get(in_dim, in_dim)
        if not var.isidentifier() or var in _RESERVED_WORDS:
            raise LayoutError(f"{var!r} cannot be a CUDA/GLSL variable; pass names={{{in_dim!r}: ...}}")
    out_index = list(layout.out_dims).index(out_dim)

    def lit(value: int, hexadecimal: bool = False) -> str:
        return (f"0x{value:x}" if hexadecimal and value > 9 else str(value)) + suffix

    terms = []
    for in_dim, rows in layout.bases.items():
        var = names.get(in_dim, in_dim)
        mask_by_shift: dict[int, int] = {}
        for j, image in enumerate(rows):
            value = image[out_index]
            while value:
                out_bit = (value & -value).bit_length() - 1
                value &= value - 1
                mask_by_shift[out_bit - j] = mask_by_shift.get(out_bit - j, 0) | (1 << j)
        for shift, mask in sorted(mask_by_shift.items(), key=lambda item: -item[0]):
            masked = f"({var} & {lit(mask, True)})"
            if shift > 0:
                terms.append(f"({masked} << {lit(shift)})")
            elif shift < 0:
                terms.append(f"({masked} >> {lit(-shift)})")
            else:
                terms.append(masked)
    return " ^ ".join(terms) if terms else lit(0)
