"""Element-by-element definitions of the MMA layouts, written from the PTX ISA, not from the
layout code (tests/test_layouts.py checks backends/layouts.py against these).

Sources (PTX ISA 8.x/9.x, "Warp-level matrix fragment" and "Asynchronous warpgroup level
matrix" sections):

- mma.m16n8k16 .f16/.bf16 fragments: the row/col formulas quoted verbatim in each function.
- wgmma.mma_async.m64nNk16: Figure "register fragment layout for accumulator matrix D" and
  "... for matrix A": warp w of the warpgroup owns rows 16w..16w+15; inside it the layout is
  the m16n8k16 pattern (groupID = row within an 8-row half, threadID_in_group = column pair),
  repeated every 8 columns for D (d4j..d4j+3 cover columns 8j..8j+7).
- wgmma shared-memory operands: Table "Canonical Layouts" in CuTe notation, evaluated by the
  small CuTe evaluator below, plus ``Swizzle<B,4,3>`` applied to byte addresses, with LBO/SBO
  as the descriptor carries them.
- A second, independent statement of the register fragments: CUTLASS's CuTe thread-value
  layouts (``SM80_16x8x16_F32F16F16F32_TN`` and the SM90 ``ALayout_64x16`` / ``CLayout_64xN``),
  which map (thread, value) to a column-major index ``m + M * n``.
"""

from __future__ import annotations


# --------------------------------------------------------------- mma.sync m16n8k16 (PTX)
def _group(lane: int) -> tuple[int, int]:
    # groupID = %laneid >> 2 ; threadID_in_group = %laneid % 4
    return lane >> 2, lane % 4


def mma_m16n8k16_a(lane: int, i: int) -> tuple[int, int]:
    """row =  groupID      for ai where 0 <= i < 2 || 4 <= i < 6 ; groupID + 8 otherwise
    col =  (threadID_in_group * 2) + (i & 0x1)      for ai where i < 4
           (threadID_in_group * 2) + (i & 0x1) + 8  for ai where i >= 4"""
    group_id, tid = _group(lane)
    row = group_id if (0 <= i < 2 or 4 <= i < 6) else group_id + 8
    col = tid * 2 + (i & 0x1) if i < 4 else tid * 2 + (i & 0x1) + 8
    return row, col


def mma_m16n8k16_b(lane: int, i: int) -> tuple[int, int]:
    """row = (threadID_in_group * 2) + (i & 0x1)      for bi where i < 2
             (threadID_in_group * 2) + (i & 0x1) + 8  for bi where i >= 2
    col = groupID"""
    group_id, tid = _group(lane)
    row = tid * 2 + (i & 0x1) if i < 2 else tid * 2 + (i & 0x1) + 8
    return row, group_id


def mma_m16n8k16_c(lane: int, i: int) -> tuple[int, int]:
    """row = groupID for c0, c1 ; groupID + 8 for c2, c3
    col = (threadID_in_group * 2) + (i & 0x1)  for ci where i = {0,..,3}"""
    group_id, tid = _group(lane)
    row = group_id if i < 2 else group_id + 8
    return row, tid * 2 + (i & 0x1)


# ----------------------------------------------------------------- wgmma m64nNk16 (PTX)
def wgmma_d(thread: int, i: int) -> tuple[int, int]:
    """Accumulator D of m64nNk16 (f32: N/2 registers; f16: the same elements, two per
    .f16x2 register). Thread = 32 * warp + lane within the warpgroup."""
    warp, lane = divmod(thread, 32)
    group_id, tid = _group(lane)
    chunk, j = divmod(i, 4)  # d(4*chunk + j) lies in columns 8*chunk .. 8*chunk + 7
    row = 16 * warp + group_id + (8 if j >= 2 else 0)
    col = 8 * chunk + tid * 2 + (j & 0x1)
    return row, col


def wgmma_a(thread: int, i: int) -> tuple[int, int]:
    """A from registers, m64k16 f16/bf16 (a0..a7): the m16n8k16 A pattern in each warp's rows."""
    warp, lane = divmod(thread, 32)
    row, col = mma_m16n8k16_a(lane, i)
    return 16 * warp + row, col


# ---------------------------------------------------------------------- CuTe evaluator
def cute_eval(shape, stride, coord: int) -> int:
    """Offset of a 1-D coordinate in a (possibly nested) CuTe layout, colexicographic."""
    if isinstance(shape, tuple):
        offset = 0
        for sub_shape, sub_stride in zip(shape, stride):
            size = cute_size(sub_shape)
            offset += cute_eval(sub_shape, sub_stride, coord % size)
            coord //= size
        return offset
    return coord * stride


def cute_size(shape) -> int:
    if isinstance(shape, tuple):
        size = 1
        for sub in shape:
            size *= cute_size(sub)
        return size
    return shape


def cute_eval_2d(shape, stride, row: int, col: int) -> int:
    """Offset of (row, col) in a rank-2 CuTe layout ``(shape0, shape1):(stride0, stride1)``."""
    return cute_eval(shape[0], stride[0], row) + cute_eval(shape[1], stride[1], col)


# CUTLASS CuTe thread-value layouts: (thread, value) -> m + M * n (column-major index).
SM80_16X8X16_A = (((4, 8), (2, 2, 2)), ((32, 1), (16, 8, 128)))  # 16x16 (M x K)
SM80_16X8X16_B = (((4, 8), (2, 2)), ((16, 1), (8, 64)))  # 8x16 (N x K)
SM80_16X8X16_C = (((4, 8), (2, 2)), ((32, 1), (16, 8)))  # 16x8 (M x N)
SM90_A_64X16 = (((4, 8, 4), (2, 2, 2)), ((128, 1, 16), (64, 8, 512)))  # 64x16 (M x K)


def sm90_c_64xn(n: int):
    return (((4, 8, 4), (2, 2, n // 8)), ((128, 1, 16), (64, 8, 512)))


def cute_tv(tv_layout, thread: int, value: int, m: int) -> tuple[int, int]:
    """(thread, value) -> (first coordinate, second coordinate) of an M-row column-major tile."""
    shape, stride = tv_layout
    index = cute_eval(shape[0], stride[0], thread) + cute_eval(shape[1], stride[1], value)
    return index % m, index // m


# ------------------------------------------------------- wgmma shared memory (PTX table)
def canonical_layout(major: str, swizzle_bytes: int, elem_bytes: int, mn: int, k: int, lbo: int, sbo: int):
    """The PTX "Canonical Layouts" entry for an ``mn x k`` operand, in elements.

    T = 128 / sizeof_bits(element); LBO/SBO are given in bytes and converted to elements.
    MN-major: ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO))   no swizzle
              ((T,n,m),(8,k)):((1,T,LBO),(nT,SBO))   n = 2, 4, 8 for 32/64/128-byte swizzle
    K-major:  ((8,m),(T,2k)):((1T,SBO),(1,LBO))      no swizzle
              ((8,m),(T,2k)):((nT,SBO),(1,T))        n = 2, 4, 8
    """
    t = 16 // elem_bytes
    lbo_e, sbo_e = lbo // elem_bytes, sbo // elem_bytes
    n = swizzle_bytes // 16
    if major == "MN":
        if swizzle_bytes == 0:
            return ((t, 1, mn // t), (8, k // 8)), ((1, t, sbo_e), (t, lbo_e))
        return ((t, n, mn // (t * n)), (8, k // 8)), ((1, t, lbo_e), (n * t, sbo_e))
    if swizzle_bytes == 0:
        return ((8, mn // 8), (t, k // t)), ((t, sbo_e), (1, lbo_e))
    return ((8, mn // 8), (t, k // t)), ((n * t, sbo_e), (1, t))


def swizzle_bytes_address(address: int, swizzle_bytes: int) -> int:
    """Swizzle<B,4,3> on a byte address: bits [4, 4+B) ^= bits [7, 7+B), B = log2(bytes/16)."""
    b = {0: 0, 32: 1, 64: 2, 128: 3}[swizzle_bytes]
    mask = ((1 << b) - 1) << 7
    return address ^ ((address & mask) >> 3)


def wgmma_smem_byte_address(
    major: str, swizzle_bytes: int, elem_bytes: int, mn_extent: int, start: int, lbo: int, sbo: int, mn: int, k: int
) -> int:
    """Byte address (from a swizzle-aligned base) the wgmma unit reads for element (mn, k) of
    one instruction's operand (``mn_extent`` x 16 K elements) given its descriptor fields."""
    shape, stride = canonical_layout(major, swizzle_bytes, elem_bytes, mn_extent, 16, lbo, sbo)
    return swizzle_bytes_address(start + cute_eval_2d(shape, stride, mn, k) * elem_bytes, swizzle_bytes)


# The PTX ISA's worked examples ("Exact layout" strings), as (major, swizzle_bytes, elem_bytes,
# rows (MN), cols (K), shape, stride) in elements.
PTX_EXACT_EXAMPLES = [
    ("K", 0, 4, 16, 16, ((8, 2), (4, 4)), ((4, 32), (1, 64))),  # K-major, no swizzle, tf32
    ("MN", 0, 2, 16, 16, ((8, 1, 2), (8, 2)), ((1, 8, 64), (8, 128))),  # MN-major, none, bf16
    ("MN", 32, 2, 32, 16, ((8, 2, 2), (8, 2)), ((1, 8, 128), (16, 256))),  # MN-major, 32B, bf16
    ("MN", 64, 2, 64, 16, ((8, 4, 2), (8, 2)), ((1, 8, 256), (32, 512))),  # MN-major, 64B, bf16
]
