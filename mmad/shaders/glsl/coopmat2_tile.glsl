// Types and tensor addressing of the coopmat2 kernels (GL_NV_cooperative_matrix2): workgroup-scope
// matrices of a whole tile (BM rows) and a whole layer, so that a layer is one coopMatMulAdd and the
// driver chooses how the workgroup's subgroups share it (and stages operands through the shared
// memory it reserves). A layer's result becomes the next layer's A operand by conversion
// (accumulator -> fp16 accumulator, which rounds to nearest even, -> use A), never through a shared
// tile of ours. Every buffer region is addressed by a tensor layout: (rows, columns) of a row-major
// block, sliced to the tile; the element offset of a block is a multiple of 16 bytes (the
// extension's rule: blocks start at multiples of 16 columns x rows_pad rows).
// Needs: BM, THREADS, IN_PAD, NN (the hidden width), OUT_PAD, Z_COLS, a readonly float16_t buffer
// WALL16[] and, where LOAD_BIAS is used, a readonly float buffer BIAS[].

#define ACC(n) coopmat<float, gl_ScopeWorkgroup, BM, n, gl_MatrixUseAccumulator>
#define ACC16(n) coopmat<float16_t, gl_ScopeWorkgroup, BM, n, gl_MatrixUseAccumulator>
#define OPA(k) coopmat<float16_t, gl_ScopeWorkgroup, BM, k, gl_MatrixUseA>
#define OPB(k, n) coopmat<float16_t, gl_ScopeWorkgroup, k, n, gl_MatrixUseB>

// rows x cols, row-major
tensorLayoutNV<2> block_layout(uint rows, uint cols) {
    tensorLayoutNV<2> t = createTensorLayoutNV(2);
    return setTensorLayoutDimensionNV(t, rows, cols);
}

// the BM rows of this tile (from row `row0` on) of a row-major block `cols` wide
tensorLayoutNV<2> tile_rows(uint rows, uint cols, uint row0) {
    return sliceTensorLayoutNV(block_layout(rows, cols), int(row0), BM, 0, cols);
}

// One layer's weights as the B operand (k x n, row-major at `off` in the fp16 copy: the
// transposed layout WT for the forward, the plain layout WR for the backward).
#define LOAD_WEIGHTS(b, off, k, n) coopMatLoadTensorNV(b, WALL16, uint(off), block_layout(k, n))

// Layer l's bias in every row of an accumulator: row 0 of the bias block, every row clamped to it.
#define LOAD_BIAS(acc, l, n) { \
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeClampToEdgeNV> bias_ = \
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeClampToEdgeNV); \
    bias_ = setTensorLayoutDimensionNV(bias_, 1, Z_COLS); \
    coopMatLoadTensorNV(acc, BIAS, 0, sliceTensorLayoutNV(bias_, 0, BM, B_OFF[l], n)); }
