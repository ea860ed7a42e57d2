// Fused MLP on mma.sync.m16n8k16 (fp16 x fp16 -> fp32), sm_80 and later.
//
// The host prepends the specialisation as #defines and mlp_common.cuh (backends/cuda.py, MmaPlan):
//   NIN KIN            encoded input dims, and padded to 16
//   WIDTH NHID         hidden width (multiple of 16, <= 128) and number of hidden layers
//   NOUT NOUT_PAD      output dims, and padded to 16
//   ACT OUT_ACT LOSS   activation / output activation / loss codes (ACT_* / LOSS_* below)
//   HUBER_DELTA        Huber's delta
//   MT_FWD MT_TRAIN    row tiles of 16 per warp in the forward / training kernel
//   MT_HALF            ... in the fp16-out forwards (MT_FWD unless FWD_ACC16)
//   WARPS              warps per block
//   W_SMEM_FWD W_SMEM_TRAIN  weights staged in shared memory (else read through L1)
//   STORE_DACT         the hidden activation's derivative is stored (not derivable from h)
//   OPT_ADAM BETA1 BETA2 EPS L2REG MOMENTUM      optimizer (the step's rate lr_t comes from the host)
//   FUSED_WGRAD        1: mlp_train_fused exists (weight gradients accumulated inside the
//                      training kernel; the plan sets it when the stash and accumulators fit)
//   FUSED_MIN_BLOCKS   blocks of mlp_train_fused an SM holds (its registers bounded to fit them)
//   GROUP_FORWARD      1: mlp_forward_group and mlp_forward_half_group exist (widths <= 128)
//   FWD_ACC16          1: the fp16-out forwards (mlp_forward_half, mlp_forward_half_group,
//                      mlp_forward_pairs_half) accumulate in fp16 (mlp_forward_acc16 below)
//   SERVE_KERNELS      1: the kernels a model serves with: the forwards, mlp_optimize (training's
//                      reduce + step, and set_params' repack), mlp_load_tcnn
//   TRAIN_KERNELS      1: the training kernels (forward + loss + backward, weight gradients, the
//                      epoch's batches, the step's end). The host builds the two sets as two
//                      modules, the training one on a thread of its own: a model serves while its
//                      training kernels compile (mma.py, CudaMmaModel)
//   ENCODED_INPUT      1: the input is an encoding made on the device (a grid's, grid.cu): fp16 in
//                      pair-major layout (the pair of columns 2p, 2p + 1 of row r at word p·rows + r;
//                      ``x_pairs``), read by mlp_forward_pairs(_half) and the plain training kernels,
//                      which also write d loss / d input (fp16, rows_pad x KIN, loss-scaled like the
//                      deltas) for the encoding's backward; layer 0's backward image follows the
//                      others (at WB0_OFF)
//
// Fragment layouts are the PTX ISA's for mma.m16n8k16 .f16 (g = lane / 4, t = lane % 4):
//   A (16x16, row): reg0 = A[g][2t..2t+1], reg1 = A[g+8][2t..], reg2 = A[g][8+2t..], reg3 = A[g+8][8+2t..]
//   B (16x8, col):  reg0 = B[2t..2t+1][g], reg1 = B[8+2t..8+2t+1][g]
//   C (16x8) f32:   c0,c1 = C[g][2t..2t+1], c2,c3 = C[g+8][2t..2t+1]
// so the accumulators of n-tiles 2j and 2j+1, packed to f16x2 in order (c0c1, c2c3), are the
// A fragment of k-chunk j of the next product: layers chain in registers.
//
// Packed weights ("B images"): the B fragments of a K x N operand, n-tile major, then k-chunk,
// then lane, 4 halves per lane (b0 b1 b2 b3): one conflict-free 8-byte load per lane per mma.
// The forward image of layer l packs B = W_l^T (K = fan_in, N = fan_out); the backward image
// packs B = W_l (K = fan_out, N = fan_in) for delta_l @ W_l.

#define NL (NHID + 1)
#define NTW (WIDTH / 8)
#define KCW (WIDTH / 16)
#define KC0 (KIN / 16)
#define KCO (NOUT_PAD / 16)
#define WF_TOTAL (KIN * WIDTH + (NHID - 1) * WIDTH * WIDTH + WIDTH * NOUT_PAD)
#define WB_TOTAL ((NHID - 1) * WIDTH * WIDTH + WIDTH * NOUT_PAD)
#define WB0_OFF (WF_TOTAL + WB_TOTAL)
#define WB_ALL (WB_TOTAL + (ENCODED_INPUT ? WIDTH * KIN : 0))  // backward images in the weight image
#if ENCODED_INPUT
#define TRAIN_XT u16
#else
#define TRAIN_XT float
#endif

// ---- layer geometry ------------------------------------------------------------------------
__device__ __forceinline__ int wf_off(int l) { return l == 0 ? 0 : KIN * WIDTH + (l - 1) * WIDTH * WIDTH; }
__device__ __forceinline__ int wb_off(int l) { return WF_TOTAL + (l - 1) * WIDTH * WIDTH; }   // l >= 1
__device__ __forceinline__ int bias_off(int l) { return l * WIDTH; }
// per-row activation buffers (halves): h_l is the input of layer l, d_l its output gradient
__device__ __forceinline__ i64 h_off(int l, i64 rows_pad) { return l == 0 ? 0 : rows_pad * (KIN + (i64)(l - 1) * WIDTH); }
__device__ __forceinline__ i64 d_off(int l, i64 rows_pad) { return rows_pad * (i64)l * WIDTH; }

// ---- fused training (FUSED_WGRAD): FW warps own 16 rows each of a 128-row super-tile; every
// layer's input h_l stays in a shared-memory stash, each layer's delta is staged in shared memory,
// and dW_l = delta_l^T @ h_l over the super-tile is accumulated in registers (mma.sync, operands
// through ldmatrix.trans), spread over the warps in 16 x 16 units: no h / delta round trip
// through global memory and no separate weight-gradient kernels.
#define FW 8
#define SUPER_ROWS (FW * 16)
#define SD_STRIDE ((WIDTH > NOUT_PAD ? WIDTH : NOUT_PAD) + 8)  // halves; +8: ldmatrix conflict-free
__host__ __device__ constexpr int layer_k(int l) { return l == 0 ? KIN : WIDTH; }
__host__ __device__ constexpr int layer_n(int l) { return l == NL - 1 ? NOUT_PAD : WIDTH; }
__host__ __device__ constexpr int stash_stride(int l) { return layer_k(l) + 8; }
__host__ __device__ constexpr int stash_off(int l) {  // halves from the stash base
    return l == 0 ? 0 : SUPER_ROWS * (KIN + 8) + (l - 1) * SUPER_ROWS * (WIDTH + 8);
}
__host__ __device__ constexpr int wunits(int l) { return (layer_n(l) / 16) * (layer_k(l) / 16); }
__host__ __device__ constexpr int wunits_per_warp(int l) { return (wunits(l) + FW - 1) / FW; }
// first accumulator fragment of layer l; closed form because a recursive one stays a call at run
// time, and an index the compiler cannot fold puts the accumulators in local memory
__host__ __device__ constexpr int acc_base(int l) {
    return l == 0 ? 0
         : 2 * wunits_per_warp(0) + (l < NL ? l - 1 : NL - 2) * 2 * wunits_per_warp(1)
           + (l < NL ? 0 : 2 * wunits_per_warp(NL - 1));
}
#define ACC_FRAGS acc_base(NL)
#define STASH_HALVES stash_off(NL)
// per-block partial sums, layer by layer: [blocks][N][K] weight sums, then [blocks][N] bias sums
__device__ __forceinline__ i64 partial_off(int l, int blocks) {
    i64 off = 0;
    for (int j = 0; j < l; ++j) off += (i64)blocks * (layer_n(j) * layer_k(j) + layer_n(j));
    return off;
}

__device__ __forceinline__ uint2 load_b(const uint2* w, int off_halves, int nt, int kc, int kcn, int lane) {
    return w[off_halves / 4 + (nt * kcn + kc) * 32 + lane];
}

// MAPPED (training from a held dataset, the *_rows kernels): batch row r is row row_map[r] of x
// and target; otherwise row r. A compile-time choice: the plain kernels stay as they were.
template <bool MAPPED>
__device__ __forceinline__ i64 source_row(const int* __restrict__ row_map, i64 row) {
    return MAPPED ? (i64)__ldg(row_map + row) : row;
}

// x's columns col, col + 1 of row `row` (zeros where !ok: the padding rows of the last tile);
// CHECK: `bad` set when either value is NaN or Inf (as given: an fp32 value beyond fp16's range
// is finite here, though it rounds to Inf)
template <bool CHECK>
__device__ __forceinline__ u32 load_x2(const float* __restrict__ x, i64 row, int col, bool ok, bool& bad) {
    float a = 0.f, b = 0.f;
    if (ok) {
        const float* p = x + row * NIN + col;
#if NIN % 2 == 0
        if (col < NIN) { float2 v = __ldg(reinterpret_cast<const float2*>(p)); a = v.x; b = v.y; }
#else
        if (col < NIN) a = __ldg(p);
        if (col + 1 < NIN) b = __ldg(p + 1);
#endif
    }
    if (CHECK) bad |= !(isfinite(a) && isfinite(b));
    return pack_h2(a, b);
}

// fp16 input (u16 bits, as the caller's float16 array holds them): the pair is already packed
template <bool CHECK>
__device__ __forceinline__ u32 load_x2(const u16* __restrict__ x, i64 row, int col, bool ok, bool& bad) {
    u32 v = 0u;
    if (ok) {
        const u16* p = x + row * NIN + col;
#if NIN % 2 == 0
        if (col < NIN) v = __ldg(reinterpret_cast<const u32*>(p));
#else
        if (col < NIN) v = __ldg(p);
        if (col + 1 < NIN) v |= (u32)__ldg(p + 1) << 16;
#endif
    }
    if (CHECK) bad |= (v & 0x7c00u) == 0x7c00u || (v & 0x7c000000u) == 0x7c000000u;  // exponent all ones
    return v;
}

// a pair-major fp16 input (ENCODED_INPUT): columns col, col + 1 of row `row` are word col / 2 of
// the column pair's run of `rows` words; the padding columns of KIN read as 0
__device__ __forceinline__ u32 load_pair(const u16* __restrict__ x, i64 rows, i64 row, int col, bool ok) {
    if (!ok || col >= NIN) return 0u;
    const u32 v = __ldg(reinterpret_cast<const u32*>(x) + (i64)(col >> 1) * rows + row);
    return col + 1 < NIN ? v : (v & 0xFFFFu);
}

// layer 0's A fragment of k16 slice kc for this lane: rows s0 and s1 (r and r + 8, or the dataset
// rows they map to), columns kc * 16 + 2t (+1) and + 8; from the pair-major encoded input (PAIRS)
// or row-major rows
template <bool GROUPED, bool PAIRS, typename XT>
__device__ __forceinline__ void load_a0(u32* a, const XT* x, i64 rows, i64 s0, i64 s1, int kc, int t,
                                        bool ok0, bool ok1, bool& bad) {
    if constexpr (PAIRS) {
        const u16* xh = reinterpret_cast<const u16*>(x);
        a[0] = load_pair(xh, rows, s0, kc * 16 + 2 * t, ok0);
        a[1] = load_pair(xh, rows, s1, kc * 16 + 2 * t, ok1);
        a[2] = load_pair(xh, rows, s0, kc * 16 + 8 + 2 * t, ok0);
        a[3] = load_pair(xh, rows, s1, kc * 16 + 8 + 2 * t, ok1);
    } else {
        a[0] = load_x2<GROUPED>(x, s0, kc * 16 + 2 * t, ok0, bad);
        a[1] = load_x2<GROUPED>(x, s1, kc * 16 + 2 * t, ok1, bad);
        a[2] = load_x2<GROUPED>(x, s0, kc * 16 + 8 + 2 * t, ok0, bad);
        a[3] = load_x2<GROUPED>(x, s1, kc * 16 + 8 + 2 * t, ok1, bad);
    }
}

// two adjacent output values, fp32 or (u16 output) rounded to fp16
__device__ __forceinline__ void store_out2(float* o, int col, float p0, float p1) {
#if NOUT % 2 == 0
    if (col < NOUT) *reinterpret_cast<float2*>(o) = make_float2(p0, p1);
#else
    if (col < NOUT) o[0] = p0;
    if (col + 1 < NOUT) o[1] = p1;
#endif
}

__device__ __forceinline__ void store_out_h2(u16* o, int col, u32 v) {  // the pair already rounded to fp16
#if NOUT % 2 == 0
    if (col < NOUT) *reinterpret_cast<u32*>(o) = v;
#else
    if (col < NOUT) o[0] = (u16)(v & 0xFFFFu);
    if (col + 1 < NOUT) o[1] = (u16)(v >> 16);
#endif
}

__device__ __forceinline__ void store_out2(u16* o, int col, float p0, float p1) { store_out_h2(o, col, pack_h2(p0, p1)); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{.reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t;}" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// dW_l += delta_l^T @ h_l over one super-tile (delta staged in sD, h_l in the stash), this warp's
// units; db_l: each thread sums one column over its segment of rows (combined at the end, in order)
__device__ __forceinline__ void fused_wgrad(int l, const u16* stash, const u16* sD,
                                            float (&acc)[ACC_FRAGS][4], float (&bacc)[NL], int warp, int lane) {
    const u16* sH = stash + stash_off(l);
    const int units_k = layer_k(l) / 16, j = lane >> 3, rr = lane & 7;
#pragma unroll
    for (int p = 0; p < wunits_per_warp(l); ++p) {
        const int u = warp + p * FW;
        if (u < wunits(l)) {
            const int n0 = (u / units_k) * 16, k0 = (u % units_k) * 16;
#pragma unroll
            for (int kk = 0; kk < SUPER_ROWS / 16; ++kk) {
                u32 a[4], b[4];
                ldmatrix_x4_trans(a, sD + (kk * 16 + (j >> 1) * 8 + rr) * SD_STRIDE + n0 + (j & 1) * 8);
                ldmatrix_x4_trans(b, sH + (kk * 16 + (j & 1) * 8 + rr) * stash_stride(l) + k0 + (j >> 1) * 8);
                mma16816(acc[acc_base(l) + 2 * p], a, make_uint2(b[0], b[1]));
                mma16816(acc[acc_base(l) + 2 * p + 1], a, make_uint2(b[2], b[3]));
            }
        }
    }
    const int n_cols = layer_n(l), segs = FW * 32 / n_cols, seg_rows = (SUPER_ROWS + segs - 1) / segs;
    const int tid = threadIdx.x;
    if (tid < segs * n_cols) {
        const int col = tid % n_cols, r0 = (tid / n_cols) * seg_rows;
        float sum = 0.f;
        for (int r = r0; r < r0 + seg_rows && r < SUPER_ROWS; ++r) sum += half_bits_to_float(sD[r * SD_STRIDE + col]);
        bacc[l] += sum;
    }
}

// the block's sums to its slot of the partial buffer (mlp_optimize adds the blocks in order)
__device__ __forceinline__ void fused_store_partials(float* __restrict__ partial, const float (&acc)[ACC_FRAGS][4],
                                                     const float (&bacc)[NL], float* sred, int warp, int lane) {
    const int g = lane >> 2, t = lane & 3, tid = threadIdx.x;
#pragma unroll
    for (int l = 0; l < NL; ++l) {
        const int n_dim = layer_n(l), k_dim = layer_k(l), units_k = k_dim / 16;
        float* pw = partial + partial_off(l, gridDim.x) + (i64)blockIdx.x * n_dim * k_dim;
        float* pb = partial + partial_off(l, gridDim.x) + (i64)gridDim.x * n_dim * k_dim + (i64)blockIdx.x * n_dim;
#pragma unroll
        for (int p = 0; p < wunits_per_warp(l); ++p) {
            const int u = warp + p * FW;
            if (u < wunits(l)) {
                const int o = (u / units_k) * 16 + g, k0 = (u % units_k) * 16;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const int k = k0 + nt * 8 + 2 * t, f = acc_base(l) + 2 * p + nt;
                    *reinterpret_cast<float2*>(pw + (i64)o * k_dim + k) = make_float2(acc[f][0], acc[f][1]);
                    *reinterpret_cast<float2*>(pw + (i64)(o + 8) * k_dim + k) = make_float2(acc[f][2], acc[f][3]);
                }
            }
        }
        const int segs = FW * 32 / n_dim;
        __syncthreads();
        if (tid < segs * n_dim) sred[tid] = bacc[l];
        __syncthreads();
        if (tid < n_dim) {
            float sum = 0.f;
            for (int sgi = 0; sgi < segs; ++sgi) sum += sred[sgi * n_dim + tid];
            pb[tid] = sum;
        }
    }
}

// One forward of a group (mlp_forward_group*): its rows and where they are read and written.
// Its tiles follow the previous forward's, from first_tile on; nonfinite (or null): the word set
// to 1 when the input holds NaN or Inf.
struct GroupForward {
    const void* x;
    void* out;
    i64 rows;
    i64 first_tile;
    u32* nonfinite;
};

// a group entry's input read NaN or Inf somewhere in this warp: its flag word set (one lane)
__device__ __forceinline__ void flag_nonfinite_input(const GroupForward& entry, bool bad, int lane) {
    u32* const flag = entry.nonfinite;
    if (flag != nullptr && __any_sync(0xffffffffu, bad) && lane == 0) atomicOr(flag, 1u);
}

// The weights the block's warps read: copied into shared memory (the first n16 16-byte words of
// the image) where ``staged``, else read through L1 from the global image.
__device__ __forceinline__ const uint2* block_weights(const uint2* __restrict__ wglobal, bool staged, int n16) {
    extern __shared__ uint4 smem_w[];
    if (!staged) return wglobal;
    const uint4* src = reinterpret_cast<const uint4*>(wglobal);
    for (int i = threadIdx.x; i < n16; i += blockDim.x) smem_w[i] = src[i];
    __syncthreads();
    return reinterpret_cast<const uint2*>(smem_w);
}

// GROUPED: the forward of the group that tile ``tile`` belongs to (``entry`` only grows along a
// warp's tiles): its input, output, rows and the tile's first row within it.
template <typename XP, typename OP>  // the caller's (restrict-qualified) input and output pointer types
__device__ __forceinline__ void group_tile(const GroupForward* __restrict__ group, int n_group, int& entry, i64 tile,
                                           int rows_per_warp, XP& x, OP& out, i64& rows, i64& row0) {
    while (entry + 1 < n_group && group[entry + 1].first_tile <= tile) ++entry;
    x = static_cast<XP>(group[entry].x);
    out = static_cast<OP>(group[entry].out);
    rows = group[entry].rows;
    row0 = (tile - group[entry].first_tile) * rows_per_warp;
}

// ---- the fused forward (and, with TRAIN, loss + backward; with FUSED, weight gradients too) -----
// XT / OT: float, or u16 for fp16 inputs / outputs (the forward's half I/O; training reads fp32)
// GROUPED (forward only): the tiles of several forwards in one launch, each with its own input,
// output and rows (`group`, n_group entries; rows_pad covers all their tiles), the finiteness of
// each input checked on the way in
template <bool TRAIN, int MT, bool FUSED = false, int NWARPS = WARPS, typename XT = float, typename OT = float,
          bool MAPPED = false, bool GROUPED = false, bool PAIRS = false>
__device__ __forceinline__ void mlp_tile_loop(
    const XT* __restrict__ x_all, i64 rows_all, i64 rows_pad, OT* __restrict__ out_all,
    const uint2* __restrict__ wglobal, const float* __restrict__ bias,
    const float* __restrict__ target, float grad_scale, u32* __restrict__ hbuf,
    u32* __restrict__ dbuf, u32* __restrict__ dactbuf, double* __restrict__ loss_partial,
    float* __restrict__ partial = nullptr, const int* __restrict__ row_map = nullptr,
    const GroupForward* __restrict__ group = nullptr, int n_group = 0, u32* __restrict__ din = nullptr) {
    static_assert(!GROUPED || (!TRAIN && !MAPPED), "a group is forwards only");
    static_assert(!FUSED || (MT == 1 && NWARPS == FW && W_SMEM_TRAIN && !STORE_DACT), "fused training geometry");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    extern __shared__ uint4 smem_w[];
    // FUSED: the h stash and the delta stage follow the weights in shared memory
    u16* const stash = reinterpret_cast<u16*>(smem_w) + (WF_TOTAL + WB_ALL);
    u16* const sD = stash + STASH_HALVES;
    float acc[FUSED ? ACC_FRAGS : 1][4];
    float bacc[NL];
    if (FUSED) {
#pragma unroll
        for (int i = 0; i < (FUSED ? ACC_FRAGS : 1); ++i)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][q] = 0.f;
#pragma unroll
        for (int l = 0; l < NL; ++l) bacc[l] = 0.f;
    }
    const uint2* w = block_weights(wglobal, TRAIN ? W_SMEM_TRAIN : W_SMEM_FWD, (WF_TOTAL + (TRAIN ? WB_ALL : 0)) / 8);
    double loss_sum = 0.0;
    constexpr int ROWS_PER_WARP = 16 * MT;
    const i64 n_tiles = rows_pad / ROWS_PER_WARP;
    // FUSED: every warp of a block takes the same number of tiles (rows_pad is a multiple of
    // SUPER_ROWS), so the block's barriers line up; rl: a row's index within the super-tile
    int entry = 0;  // GROUPED: the forward this tile belongs to (a warp's tiles only grow)
    for (i64 tile = (i64)blockIdx.x * NWARPS + warp; tile < n_tiles; tile += (i64)gridDim.x * NWARPS) {
        const XT* __restrict__ x = x_all;
        OT* __restrict__ out = out_all;
        i64 rows = rows_all, row0 = tile * ROWS_PER_WARP;
        if constexpr (GROUPED) group_tile(group, n_group, entry, tile, ROWS_PER_WARP, x, out, rows, row0);
        const int rl0 = warp * ROWS_PER_WARP;
        u32 A[MT][KCW][4];
        // layer 0: A straight from the fp32 input, rounded to fp16
        {
            float C[MT][NTW][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) C[mt][nt][q] = 0.f;
            // MAPPED: the dataset rows this lane reads, looked up once before the column loop
            i64 src[MAPPED ? MT : 1][2];
            if constexpr (MAPPED) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const i64 r = row0 + mt * 16 + g + h * 8;
                        src[mt][h] = r < rows ? source_row<MAPPED>(row_map, r) : 0;
                    }
            }
            bool bad = false;  // GROUPED: this lane read NaN or Inf
#pragma unroll 2
            for (int kc = 0; kc < KC0; ++kc) {
                u32 a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const i64 r = row0 + mt * 16 + g;
                    const i64 s0 = MAPPED ? src[MAPPED ? mt : 0][0] : r, s1 = MAPPED ? src[MAPPED ? mt : 0][1] : r + 8;
                    load_a0<GROUPED, PAIRS>(a[mt], x, rows, s0, s1, kc, t, r < rows, r + 8 < rows, bad);
                    if (FUSED) {
                        u32* h0 = reinterpret_cast<u32*>(stash + stash_off(0));
                        const int rl = rl0 + mt * 16 + g, c = kc * 16 + 2 * t;
                        h0[(rl * stash_stride(0) + c) / 2] = a[mt][0];
                        h0[((rl + 8) * stash_stride(0) + c) / 2] = a[mt][1];
                        h0[(rl * stash_stride(0) + c + 8) / 2] = a[mt][2];
                        h0[((rl + 8) * stash_stride(0) + c + 8) / 2] = a[mt][3];
                    } else if (TRAIN) {
                        u32* h0 = hbuf;  // h_0 = the rounded input, for W0's gradient
                        h0[(r * KIN + kc * 16 + 2 * t) / 2] = a[mt][0];
                        h0[((r + 8) * KIN + kc * 16 + 2 * t) / 2] = a[mt][1];
                        h0[(r * KIN + kc * 16 + 8 + 2 * t) / 2] = a[mt][2];
                        h0[((r + 8) * KIN + kc * 16 + 8 + 2 * t) / 2] = a[mt][3];
                    }
                }
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
                    uint2 b = load_b(w, wf_off(0), nt, kc, KC0, lane);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma16816(C[mt][nt], a[mt], b);
                }
            }
            if constexpr (GROUPED) flag_nonfinite_input(group[entry], bad, lane);
            // epilogue of every hidden layer: bias, activation, round, chain into A
#define HIDDEN_EPILOGUE(L)                                                                         \
            _Pragma("unroll") for (int mt = 0; mt < MT; ++mt) {                                     \
                const i64 r = row0 + mt * 16 + g;                                                   \
                const bool ok0 = r < rows, ok1 = r + 8 < rows;                                      \
                _Pragma("unroll") for (int nt = 0; nt < NTW; ++nt) {                                \
                    const int col = nt * 8 + 2 * t;                                                 \
                    const float2 bv = __ldg(reinterpret_cast<const float2*>(bias + bias_off(L) + col)); \
                    const float z0 = C[mt][nt][0] + bv.x, z1 = C[mt][nt][1] + bv.y;                 \
                    const float z2 = C[mt][nt][2] + bv.x, z3 = C[mt][nt][3] + bv.y;                 \
                    u32 h01 = pack_h2(activate(ACT, z0), activate(ACT, z1));                        \
                    u32 h23 = pack_h2(activate(ACT, z2), activate(ACT, z3));                        \
                    if (FUSED) {                                                                    \
                        if (!ok0) h01 = 0u;                                                         \
                        if (!ok1) h23 = 0u;                                                         \
                        u32* hn = reinterpret_cast<u32*>(stash + stash_off((L) + 1));               \
                        const int rl = rl0 + mt * 16 + g;                                           \
                        hn[(rl * stash_stride((L) + 1) + col) / 2] = h01;                           \
                        hn[((rl + 8) * stash_stride((L) + 1) + col) / 2] = h23;                     \
                    } else if (TRAIN) {                                                             \
                        if (!ok0) h01 = 0u;                                                         \
                        if (!ok1) h23 = 0u;                                                         \
                        u32* hn = hbuf + h_off((L) + 1, rows_pad) / 2;                              \
                        hn[(r * WIDTH + col) / 2] = h01;                                            \
                        hn[((r + 8) * WIDTH + col) / 2] = h23;                                      \
                        if (STORE_DACT) {                                                           \
                            u32* dn = dactbuf + (i64)(L) * rows_pad * WIDTH / 2;                    \
                            dn[(r * WIDTH + col) / 2] = ok0 ? pack_h2(activation_grad(ACT, z0), activation_grad(ACT, z1)) : 0u; \
                            dn[((r + 8) * WIDTH + col) / 2] = ok1 ? pack_h2(activation_grad(ACT, z2), activation_grad(ACT, z3)) : 0u; \
                        }                                                                           \
                    }                                                                               \
                    A[mt][nt >> 1][(nt & 1) * 2 + 0] = h01;                                         \
                    A[mt][nt >> 1][(nt & 1) * 2 + 1] = h23;                                         \
                }                                                                                   \
            }
            HIDDEN_EPILOGUE(0)
        }
        // hidden layers 1 .. NHID-1: A from the previous layer's registers
#pragma unroll 1
        for (int l = 1; l < NHID; ++l) {
            float C[MT][NTW][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) C[mt][nt][q] = 0.f;
#pragma unroll
            for (int kc = 0; kc < KCW; ++kc)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
                    uint2 b = load_b(w, wf_off(l), nt, kc, KCW, lane);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma16816(C[mt][nt], A[mt][kc], b);
                }
            HIDDEN_EPILOGUE(l)
        }
#undef HIDDEN_EPILOGUE

        // output layer, 16 columns at a time; with TRAIN also loss, delta and delta @ W_out
        float G[MT][NTW][4];
        if (TRAIN) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) G[mt][nt][q] = 0.f;
        }
#if LOSS == LOSS_REL_L2_LUM
        float lum[MT][2];
#endif
#pragma unroll 1
        for (int og = 0; og < KCO; ++og) {
            float Z[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) Z[mt][j][q] = 0.f;
#pragma unroll
            for (int kc = 0; kc < KCW; ++kc)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    uint2 b = load_b(w, wf_off(NL - 1), og * 2 + j, kc, KCW, lane);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma16816(Z[mt][j], A[mt][kc], b);
                }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int col = og * 16 + j * 8 + 2 * t;
                    const float2 bv = __ldg(reinterpret_cast<const float2*>(bias + bias_off(NL - 1) + col));
                    Z[mt][j][0] += bv.x; Z[mt][j][1] += bv.y; Z[mt][j][2] += bv.x; Z[mt][j][3] += bv.y;
                }
            if (!TRAIN) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < 2; ++j)
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const i64 r = row0 + mt * 16 + g + half * 8;
                            const int col = og * 16 + j * 8 + 2 * t;
                            const float p0 = activate(OUT_ACT, Z[mt][j][half * 2]);
                            const float p1 = activate(OUT_ACT, Z[mt][j][half * 2 + 1]);
                            if (r < rows) store_out2(out + r * NOUT + col, col, p0, p1);
                        }
                continue;
            }
            // ---- loss and output delta
            float P[MT][2][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int q = 0; q < 4; ++q) P[mt][j][q] = activate(OUT_ACT, Z[mt][j][q]);
#if LOSS == LOSS_REL_L2_LUM
            if (og == 0) {
                const int base = lane & ~3;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const float q0 = __shfl_sync(0xffffffffu, P[mt][0][half * 2], base);
                        const float q1 = __shfl_sync(0xffffffffu, P[mt][0][half * 2 + 1], base);
                        const float q2 = __shfl_sync(0xffffffffu, P[mt][0][half * 2], base + 1);
#if NOUT >= 3
                        lum[mt][half] = 0.299f * q0 + 0.587f * q1 + 0.114f * q2;
#elif NOUT == 2
                        lum[mt][half] = 0.5f * (fabsf(q0) + fabsf(q1));
#else
                        lum[mt][half] = fabsf(q0);
#endif
                    }
            }
#endif
            u32 Ad[MT][4];
            u32* dout = dbuf + d_off(NL - 1, rows_pad) / 2;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < 2; ++j)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const i64 r = row0 + mt * 16 + g + half * 8;
                        const int col = og * 16 + j * 8 + 2 * t;
                        float y0 = 0.f, y1 = 0.f;
                        const bool rok = r < rows;
                        if (rok) {
                            const float* yp = target + source_row<MAPPED>(row_map, r) * NOUT + col;
#if NOUT % 2 == 0
                            if (col < NOUT) { float2 v = __ldg(reinterpret_cast<const float2*>(yp)); y0 = v.x; y1 = v.y; }
#else
                            if (col < NOUT) y0 = __ldg(yp);
                            if (col + 1 < NOUT) y1 = __ldg(yp + 1);
#endif
                        }
                        float l_lum = 0.f;
#if LOSS == LOSS_REL_L2_LUM
                        l_lum = lum[mt][half];
#endif
                        float gr0, gr1;
                        const float v0 = loss_term(P[mt][j][half * 2], y0, l_lum, &gr0);
                        const float v1 = loss_term(P[mt][j][half * 2 + 1], y1, l_lum, &gr1);
                        const bool ok0 = rok && col < NOUT, ok1 = rok && col + 1 < NOUT;
                        if (ok0) loss_sum += (double)v0;
                        if (ok1) loss_sum += (double)v1;
                        const float d0 = ok0 ? gr0 * grad_scale * activation_grad(OUT_ACT, Z[mt][j][half * 2]) : 0.f;
                        const float d1 = ok1 ? gr1 * grad_scale * activation_grad(OUT_ACT, Z[mt][j][half * 2 + 1]) : 0.f;
                        const u32 dh = pack_h2(d0, d1);
                        Ad[mt][j * 2 + half] = dh;
                        if (FUSED) reinterpret_cast<u32*>(sD)[((rl0 + mt * 16 + g + half * 8) * SD_STRIDE + col) / 2] = dh;
                        else dout[(r * NOUT_PAD + col) / 2] = dh;
                    }
            // G += delta_out[:, og*16 .. +16] @ W_out[og*16 .. +16, :]
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                uint2 b = load_b(w, wb_off(NL - 1), nt, og, KCO, lane);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma16816(G[mt][nt], Ad[mt], b);
            }
        }
        if (!TRAIN) continue;
        if constexpr (FUSED) {  // the output layer's weight gradient, once every warp staged its delta
            __syncthreads();
            fused_wgrad(NL - 1, stash, sD, acc, bacc, warp, lane);
            __syncthreads();
        }
        // ---- hidden layers, last to first: delta_{l-1} = round(G * act'(z_{l-1})), G = delta @ W
        // (FUSED unrolls it: the accumulators of each layer must stay registers)
        constexpr int bwd_unroll = FUSED ? NL : 1;
#pragma unroll bwd_unroll
        for (int l = NL - 1; l >= 1; --l) {
            const u32* stored = FUSED ? reinterpret_cast<const u32*>(stash + stash_off(l))
                              : STORE_DACT ? dactbuf + (i64)(l - 1) * rows_pad * WIDTH / 2
                                           : hbuf + h_off(l, rows_pad) / 2;
            u32* dn = dbuf + d_off(l - 1, rows_pad) / 2;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const i64 r = row0 + mt * 16 + g;
                const int rl = rl0 + mt * 16 + g;
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
                    const int col = nt * 8 + 2 * t;
                    const i64 i01 = FUSED ? (rl * stash_stride(l) + col) / 2 : (r * WIDTH + col) / 2;
                    const i64 i23 = FUSED ? ((rl + 8) * stash_stride(l) + col) / 2 : ((r + 8) * WIDTH + col) / 2;
                    const float2 s01 = unpack_h2(stored[i01]);
                    const float2 s23 = unpack_h2(stored[i23]);
                    const u32 d01 = pack_h2(G[mt][nt][0] * hidden_grad_from_stored(s01.x),
                                            G[mt][nt][1] * hidden_grad_from_stored(s01.y));
                    const u32 d23 = pack_h2(G[mt][nt][2] * hidden_grad_from_stored(s23.x),
                                            G[mt][nt][3] * hidden_grad_from_stored(s23.y));
                    A[mt][nt >> 1][(nt & 1) * 2 + 0] = d01;
                    A[mt][nt >> 1][(nt & 1) * 2 + 1] = d23;
                    if (FUSED) {
                        reinterpret_cast<u32*>(sD)[(rl * SD_STRIDE + col) / 2] = d01;
                        reinterpret_cast<u32*>(sD)[((rl + 8) * SD_STRIDE + col) / 2] = d23;
                    } else {
                        dn[(r * WIDTH + col) / 2] = d01;
                        dn[((r + 8) * WIDTH + col) / 2] = d23;
                    }
                }
            }
            if constexpr (FUSED) {
                __syncthreads();
                fused_wgrad(l - 1, stash, sD, acc, bacc, warp, lane);
                __syncthreads();
            }
            if (l == 1) {
#if ENCODED_INPUT
                // d loss / d input = delta_0 @ W_0, 8 input columns at a time, rounded to fp16 as
                // tcnn's network hands it to its encoding
#pragma unroll 1
                for (int nt = 0; nt < KIN / 8; ++nt) {
                    float E[MT][4];
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int q = 0; q < 4; ++q) E[mt][q] = 0.f;
#pragma unroll
                    for (int kc = 0; kc < KCW; ++kc) {
                        uint2 b = load_b(w, WB0_OFF, nt, kc, KCW, lane);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) mma16816(E[mt], A[mt][kc], b);
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const i64 r = row0 + mt * 16 + g;
                        din[(r * KIN + nt * 8 + 2 * t) / 2] = pack_h2(E[mt][0], E[mt][1]);
                        din[((r + 8) * KIN + nt * 8 + 2 * t) / 2] = pack_h2(E[mt][2], E[mt][3]);
                    }
                }
#endif
                break;
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                    for (int q = 0; q < 4; ++q) G[mt][nt][q] = 0.f;
#pragma unroll
            for (int kc = 0; kc < KCW; ++kc)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
                    uint2 b = load_b(w, wb_off(l - 1), nt, kc, KCW, lane);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma16816(G[mt][nt], A[mt][kc], b);
                }
        }
    }
    if (TRAIN) {
        // fixed-order reduction: lanes by xor tree, warps each to their own slot
#pragma unroll
        for (int s = 16; s >= 1; s >>= 1) loss_sum += __shfl_xor_sync(0xffffffffu, loss_sum, s);
        if (lane == 0) loss_partial[(i64)blockIdx.x * NWARPS + warp] = loss_sum;
    }
    if constexpr (FUSED) fused_store_partials(partial, acc, bacc, reinterpret_cast<float*>(sD), warp, lane);
}

// ---- the forward with fp16 accumulators (FWD_ACC16: the cuda backend's mma-f16acc variant) ----
// tiny-cuda-nn's fully fused MLP accumulates in fp16 (wmma accumulator fragments of __half). Here
// mma.sync ... f16.f16.f16.f16: a 16x8 tile's accumulators are 2 registers of f16x2 pairs, which
// are the next layer's A fragment once the bias (HADD2, the fp32 bias rounded to fp16) and the
// activation (HMNMX2 for ReLU; the others through fp32) are applied: the fp32 epilogue's adds,
// activations and packing go. Forward only, fp16 out, for the plain, grouped and pair-major
// (ENCODED_INPUT) inputs that mlp_tile_loop reads.
__device__ __forceinline__ void mma16816_acc16(u32* c, const u32* a, uint2 b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};"
                 : "+r"(c[0]), "+r"(c[1]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

// an accumulator pair plus its bias pair, then the activation, in fp16 pairs
__device__ __forceinline__ u32 bias_act_h2(int act, u32 acc, u32 bias_pair) {
    u32 z;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(z) : "r"(acc), "r"(bias_pair));
    if (act == ACT_NONE) return z;
    if (act == ACT_RELU) {
        u32 r;
        asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(z), "r"(0u));
        return r;
    }
    const float2 f = unpack_h2(z);
    return pack_h2(activate(act, f.x), activate(act, f.y));
}

__device__ __forceinline__ u32 bias_h2(const float* __restrict__ bias, int off) {
    const float2 v = __ldg(reinterpret_cast<const float2*>(bias + off));
    return pack_h2(v.x, v.y);
}

template <int MT, bool GROUPED = false, bool PAIRS = false>
__device__ __forceinline__ void mlp_forward_acc16(
    const u16* __restrict__ x_all, i64 rows_all, i64 rows_pad, u16* __restrict__ out_all,
    const uint2* __restrict__ wglobal, const float* __restrict__ bias,
    const GroupForward* __restrict__ group = nullptr, int n_group = 0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const uint2* w = block_weights(wglobal, W_SMEM_FWD, WF_TOTAL / 8);
    constexpr int ROWS_PER_WARP = 16 * MT;
    const i64 n_tiles = rows_pad / ROWS_PER_WARP;
    int entry = 0;  // GROUPED: the forward this tile belongs to
    for (i64 tile = (i64)blockIdx.x * WARPS + warp; tile < n_tiles; tile += (i64)gridDim.x * WARPS) {
        const u16* __restrict__ x = x_all;
        u16* __restrict__ out = out_all;
        i64 rows = rows_all, row0 = tile * ROWS_PER_WARP;
        if constexpr (GROUPED) group_tile(group, n_group, entry, tile, ROWS_PER_WARP, x, out, rows, row0);
        u32 A[MT][KCW][4];
        u32 C[MT][NTW][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) C[mt][nt][0] = C[mt][nt][1] = 0u;
        bool bad = false;  // GROUPED: this lane read NaN or Inf
#pragma unroll 2
        for (int kc = 0; kc < KC0; ++kc) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const i64 r = row0 + mt * 16 + g;
                load_a0<GROUPED, PAIRS>(a[mt], x, rows, r, r + 8, kc, t, r < rows, r + 8 < rows, bad);
            }
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const uint2 b = load_b(w, wf_off(0), nt, kc, KC0, lane);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma16816_acc16(C[mt][nt], a[mt], b);
            }
        }
        if constexpr (GROUPED) flag_nonfinite_input(group[entry], bad, lane);
        // hidden layer l's bias and activation on the pairs, which chain into A; then layer l + 1
#pragma unroll 1
        for (int l = 0; l < NHID; ++l) {
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const u32 bh = bias_h2(bias, bias_off(l) + nt * 8 + 2 * t);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    A[mt][nt >> 1][(nt & 1) * 2 + 0] = bias_act_h2(ACT, C[mt][nt][0], bh);
                    A[mt][nt >> 1][(nt & 1) * 2 + 1] = bias_act_h2(ACT, C[mt][nt][1], bh);
                    C[mt][nt][0] = C[mt][nt][1] = 0u;
                }
            }
            if (l + 1 == NHID) break;
#pragma unroll
            for (int kc = 0; kc < KCW; ++kc)
#pragma unroll
                for (int nt = 0; nt < NTW; ++nt) {
                    const uint2 b = load_b(w, wf_off(l + 1), nt, kc, KCW, lane);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma16816_acc16(C[mt][nt], A[mt][kc], b);
                }
        }
        // output layer, 16 columns at a time
#pragma unroll 1
        for (int og = 0; og < KCO; ++og) {
            u32 Z[MT][2][2];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int j = 0; j < 2; ++j) Z[mt][j][0] = Z[mt][j][1] = 0u;
#pragma unroll
            for (int kc = 0; kc < KCW; ++kc)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const uint2 b = load_b(w, wf_off(NL - 1), og * 2 + j, kc, KCW, lane);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) mma16816_acc16(Z[mt][j], A[mt][kc], b);
                }
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int col = og * 16 + j * 8 + 2 * t;
                const u32 bh = bias_h2(bias, bias_off(NL - 1) + col);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        const i64 r = row0 + mt * 16 + g + half * 8;
                        if (r < rows) store_out_h2(out + r * NOUT + col, col, bias_act_h2(OUT_ACT, Z[mt][j][half], bh));
                    }
            }
        }
    }
}

#if SERVE_KERNELS
#if !ENCODED_INPUT
// the forwards of a plain input (an encoded one has mlp_forward_pairs below)
extern "C" __global__ void __launch_bounds__(WARPS * 32) mlp_forward(
    const float* __restrict__ x, i64 rows, i64 rows_pad, float* __restrict__ out,
    const uint2* __restrict__ wpack, const float* __restrict__ bias) {
    mlp_tile_loop<false, MT_FWD>(x, rows, rows_pad, out, wpack, bias, nullptr, 0.f, nullptr, nullptr,
                         nullptr, nullptr);
}

// fp16 in, fp16 out (the I/O of an fp16 pipeline such as PyTorch's half forward): half the bytes
extern "C" __global__ void __launch_bounds__(WARPS * 32) mlp_forward_half(
    const u16* __restrict__ x, i64 rows, i64 rows_pad, u16* __restrict__ out,
    const uint2* __restrict__ wpack, const float* __restrict__ bias) {
#if FWD_ACC16
    mlp_forward_acc16<MT_HALF>(x, rows, rows_pad, out, wpack, bias);
#else
    mlp_tile_loop<false, MT_FWD, false, WARPS, u16, u16>(x, rows, rows_pad, out, wpack, bias, nullptr, 0.f,
                                                         nullptr, nullptr, nullptr, nullptr);
#endif
}
#endif

#if ENCODED_INPUT
// the forward of a pair-major fp16 encoded input (grid.cu), fp32 or fp16 out
extern "C" __global__ void __launch_bounds__(WARPS * 32) mlp_forward_pairs(
    const u16* __restrict__ x, i64 rows, i64 rows_pad, float* __restrict__ out,
    const uint2* __restrict__ wpack, const float* __restrict__ bias) {
    mlp_tile_loop<false, MT_FWD, false, WARPS, u16, float, false, false, true>(
        x, rows, rows_pad, out, wpack, bias, nullptr, 0.f, nullptr, nullptr, nullptr, nullptr);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) mlp_forward_pairs_half(
    const u16* __restrict__ x, i64 rows, i64 rows_pad, u16* __restrict__ out,
    const uint2* __restrict__ wpack, const float* __restrict__ bias) {
#if FWD_ACC16
    mlp_forward_acc16<MT_HALF, false, true>(x, rows, rows_pad, out, wpack, bias);
#else
    mlp_tile_loop<false, MT_FWD, false, WARPS, u16, u16, false, false, true>(
        x, rows, rows_pad, out, wpack, bias, nullptr, 0.f, nullptr, nullptr, nullptr, nullptr);
#endif
}
#endif

// several forwards in one launch (the daemon's group of forwards between CUDA shared-memory
// regions): fp32 in and out, and fp16 in and out; every input checked for NaN and Inf. Only where
// GROUP_FORWARD: a group's per-tile pointers live in registers, which the 256-wide forward lacks
#if GROUP_FORWARD
extern "C" __global__ void __launch_bounds__(WARPS * 32) mlp_forward_group(
    const GroupForward* __restrict__ group, int n_group, i64 n_tiles, const uint2* __restrict__ wpack,
    const float* __restrict__ bias) {
    mlp_tile_loop<false, MT_FWD, false, WARPS, float, float, false, true>(
        nullptr, 0, n_tiles * 16 * MT_FWD, nullptr, wpack, bias, nullptr, 0.f, nullptr, nullptr, nullptr, nullptr,
        nullptr, nullptr, group, n_group);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) mlp_forward_half_group(
    const GroupForward* __restrict__ group, int n_group, i64 n_tiles, const uint2* __restrict__ wpack,
    const float* __restrict__ bias) {
#if FWD_ACC16
    mlp_forward_acc16<MT_HALF, true>(nullptr, 0, n_tiles * 16 * MT_HALF, nullptr, wpack, bias, group, n_group);
#else
    mlp_tile_loop<false, MT_FWD, false, WARPS, u16, u16, false, true>(
        nullptr, 0, n_tiles * 16 * MT_FWD, nullptr, wpack, bias, nullptr, 0.f, nullptr, nullptr, nullptr, nullptr,
        nullptr, nullptr, group, n_group);
#endif
}
#endif
#endif  // SERVE_KERNELS

#if TRAIN_KERNELS
extern "C" __global__ void __launch_bounds__(WARPS * 32) mlp_train_fwd_bwd(
    const TRAIN_XT* __restrict__ x, i64 rows, i64 rows_pad, const uint2* __restrict__ wpack,
    const float* __restrict__ bias, const float* __restrict__ target, float grad_scale,
    u32* __restrict__ hbuf, u32* __restrict__ dbuf, u32* __restrict__ dactbuf,
    double* __restrict__ loss_partial, u32* __restrict__ din) {
    mlp_tile_loop<true, MT_TRAIN, false, WARPS, TRAIN_XT, float, false, false, ENCODED_INPUT>(
        x, rows, rows_pad, static_cast<float*>(nullptr), wpack, bias, target, grad_scale, hbuf, dbuf, dactbuf,
        loss_partial, nullptr, nullptr, nullptr, 0, din);
}

// the same over a held dataset: batch row r is row row_map[r] of x and target
extern "C" __global__ void __launch_bounds__(WARPS * 32) mlp_train_fwd_bwd_rows(
    const float* __restrict__ x, i64 rows, i64 rows_pad, const uint2* __restrict__ wpack,
    const float* __restrict__ bias, const float* __restrict__ target, float grad_scale,
    u32* __restrict__ hbuf, u32* __restrict__ dbuf, u32* __restrict__ dactbuf,
    double* __restrict__ loss_partial, const int* __restrict__ row_map, u32* __restrict__ din) {
    mlp_tile_loop<true, MT_TRAIN, false, WARPS, float, float, true>(
        x, rows, rows_pad, static_cast<float*>(nullptr), wpack, bias, target, grad_scale, hbuf, dbuf, dactbuf,
        loss_partial, nullptr, row_map, nullptr, 0, din);
}

#if FUSED_WGRAD
// forward + loss + backward + weight/bias gradients of every layer in one persistent kernel; the
// per-block sums go to `partial` (layout: partial_off), reduced by mlp_optimize in block order
extern "C" __global__ void __launch_bounds__(FW * 32, FUSED_MIN_BLOCKS) mlp_train_fused(
    const TRAIN_XT* __restrict__ x, i64 rows, i64 rows_pad, const uint2* __restrict__ wpack,
    const float* __restrict__ bias, const float* __restrict__ target, float grad_scale,
    float* __restrict__ partial, double* __restrict__ loss_partial, u32* __restrict__ din) {
    mlp_tile_loop<true, 1, true, FW, TRAIN_XT, float, false, false, ENCODED_INPUT>(x, rows, rows_pad, static_cast<float*>(nullptr), wpack, bias, target,
                                     grad_scale, nullptr, nullptr, nullptr, loss_partial, partial, nullptr, nullptr, 0,
                                     din);
}

extern "C" __global__ void __launch_bounds__(FW * 32, FUSED_MIN_BLOCKS) mlp_train_fused_rows(
    const float* __restrict__ x, i64 rows, i64 rows_pad, const uint2* __restrict__ wpack,
    const float* __restrict__ bias, const float* __restrict__ target, float grad_scale,
    float* __restrict__ partial, double* __restrict__ loss_partial, const int* __restrict__ row_map,
    u32* __restrict__ din) {
    mlp_tile_loop<true, 1, true, FW, float, float, true>(x, rows, rows_pad, static_cast<float*>(nullptr), wpack,
                                                         bias, target, grad_scale, nullptr, nullptr, nullptr,
                                                         loss_partial, partial, row_map, nullptr, 0, din);
}
#endif

// ---- weight gradients: dW = delta^T @ h over one chunk of rows, per 64 x 64 tile -------------
// D: rows_pad x N halves (delta, row-major), H: rows_pad x K halves. Partial sums per chunk go
// to pw[chunk][N][K] and pb[chunk][N]; a later kernel adds the chunks in a fixed order.
#define WG_ROWS 32
#define WG_LD 72  // 64 + 8 halves: rows 144 bytes apart, ldmatrix conflict-free

extern "C" __global__ void __launch_bounds__(128) mlp_wgrad(
    const u16* __restrict__ D, int N, const u16* __restrict__ H, int K, i64 chunk_rows,
    i64 rows_pad, float* __restrict__ pw, float* __restrict__ pb) {
    __shared__ __align__(16) u16 sD[2][WG_ROWS][WG_LD];
    __shared__ __align__(16) u16 sH[2][WG_ROWS][WG_LD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tiles_k = (K + 63) / 64;
    const int o0 = (blockIdx.y / tiles_k) * 64, k0 = (blockIdx.y % tiles_k) * 64;
    const i64 r_begin = (i64)blockIdx.x * chunk_rows;
    i64 r_end = r_begin + chunk_rows;
    if (r_end > rows_pad) r_end = rows_pad;
    const bool warp_active = o0 + warp * 16 < N;
    const bool do_bias = k0 == 0 && tid < 64;

    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][q] = 0.f;
    float bsum = 0.f;

    auto load_stage = [&](int s, i64 r0) {
#pragma unroll
        for (int i = tid; i < WG_ROWS * 8; i += 128) {
            const int rr = i >> 3, c8 = (i & 7) * 8;
            const i64 row = r0 + rr;
            const bool okd = o0 + c8 < N, okh = k0 + c8 < K;
            cp_async16(&sD[s][rr][c8], okd ? D + row * N + o0 + c8 : D, okd ? 16 : 0);
            cp_async16(&sH[s][rr][c8], okh ? H + row * K + k0 + c8 : H, okh ? 16 : 0);
        }
        asm volatile("cp.async.commit_group;");
    };

    int s = 0;
    if (r_begin < r_end) load_stage(0, r_begin);
    for (i64 r0 = r_begin; r0 < r_end; r0 += WG_ROWS) {
        if (r0 + WG_ROWS < r_end) {
            load_stage(s ^ 1, r0 + WG_ROWS);
            asm volatile("cp.async.wait_group 1;");
        } else {
            asm volatile("cp.async.wait_group 0;");
        }
        __syncthreads();
        if (warp_active) {
#pragma unroll
            for (int kk = 0; kk < WG_ROWS / 16; ++kk) {
                const int j = lane >> 3, rr = lane & 7;
                u32 a[4];
                ldmatrix_x4_trans(a, &sD[s][kk * 16 + (j >> 1) * 8 + rr][warp * 16 + (j & 1) * 8]);
#pragma unroll
                for (int p = 0; p < 4; ++p) {
                    u32 b[4];
                    ldmatrix_x4_trans(b, &sH[s][kk * 16 + (j & 1) * 8 + rr][p * 16 + (j >> 1) * 8]);
                    mma16816(acc[2 * p], a, make_uint2(b[0], b[1]));
                    mma16816(acc[2 * p + 1], a, make_uint2(b[2], b[3]));
                }
            }
        }
        if (do_bias) {
#pragma unroll 8
            for (int rr = 0; rr < WG_ROWS; ++rr) bsum += half_bits_to_float(sD[s][rr][tid]);
        }
        __syncthreads();
        s ^= 1;
    }
    if (warp_active) {
        const int o = o0 + warp * 16 + g;
        float* base = pw + (i64)blockIdx.x * N * K;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int k = k0 + nt * 8 + 2 * t;
            if (k < K) {
                if (o < N) *reinterpret_cast<float2*>(base + (i64)o * K + k) = make_float2(acc[nt][0], acc[nt][1]);
                if (o + 8 < N) *reinterpret_cast<float2*>(base + (i64)(o + 8) * K + k) = make_float2(acc[nt][2], acc[nt][3]);
            }
        }
    }
    if (do_bias && o0 + tid < N) pb[(i64)blockIdx.x * N + o0 + tid] = bsum;
}
#endif  // TRAIN_KERNELS

// ---- chunk reduction + optimizer step + fp16 repack, one layer per launch --------------------
// Index of element (k, n) of a K x N operand in its packed B image (see the header comment).
__device__ __forceinline__ int b_image_index(int Kdim, int k, int n) {
    const int kc = k >> 4, kk = k & 15, hi = kk >> 3, rr = kk & 7;
    const int lane = (n & 7) * 4 + (rr >> 1);
    return (((n >> 3) * (Kdim >> 4) + kc) * 32 + lane) * 4 + hi * 2 + (rr & 1);
}

// ctl (int32[4]) lives on the device so that a step's launches are the same every step (one CUDA
// graph replayed): the run's step (indexes the learning-rate table and the losses), the position
// of the next batch in the epoch's order, the epoch, and the order's seed.
#define CTL_STEP 0
#define CTL_CURSOR 1
#define CTL_EPOCH 2
#define CTL_SEED 3

// mode 0: reduce + optimizer step + repack; 1: reduce into grad_w/grad_b only; 2: repack only
// (set_params); 3: the EMA inference image from the average only (a restored optimizer state).
// With tcnn's EMA wrapper (EMA 1) modes 0 and 2 also write the average ema_w / ema_b and the
// forward image eimage made from it, which inference reads instead of wimage (training keeps
// reading wimage, the raw weights).
#if SERVE_KERNELS
extern "C" __global__ void mlp_optimize(
    int mode, float* __restrict__ w, float* __restrict__ b, float* __restrict__ s1w,
    float* __restrict__ s1b, float* __restrict__ s2w, float* __restrict__ s2b,
    const float* __restrict__ pw, const float* __restrict__ pb, int n_chunks, int N, int K,
    int fan_out, int fan_in, u16* __restrict__ wimage, int wf_offset, int wb_offset,
    const float* __restrict__ lr_table, const int* __restrict__ ctl, float inv_scale,
    float* __restrict__ grad_w, float* __restrict__ grad_b, float* __restrict__ ema_w,
    float* __restrict__ ema_b, u16* __restrict__ eimage, const float2* __restrict__ ema_table) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int n_w = N * K;
    if (i >= n_w + N) return;
    const bool is_w = i < n_w;
    const int o = is_w ? i / K : i - n_w, c = is_w ? i % K : 0;
    if (o >= fan_out || (is_w && c >= fan_in)) return;
    float* param = is_w ? w + i : b + o;
#if EMA
    if (mode == 3) {
        if (is_w) eimage[wf_offset + b_image_index(K, c, o)] = to_half_bits(ema_w[i]);
        return;
    }
#endif
    if (mode != 2) {
        float gsum = 0.f;
        if (is_w) for (int ch = 0; ch < n_chunks; ++ch) gsum += pw[(i64)ch * n_w + i];
        else for (int ch = 0; ch < n_chunks; ++ch) gsum += pb[(i64)ch * N + o];
        float grad = gsum * inv_scale;
        if (mode == 1) {
            if (is_w) grad_w[i] = grad; else grad_b[o] = grad;
            return;
        }
        float p = *param;
        const float lr_t = lr_table[ctl[CTL_STEP]];  // the run's step: a replayed graph reads it here
        if (L2REG != 0.f) grad += L2REG * p;
#if OPT_ADAM
        float* m = is_w ? s1w + i : s1b + o;
        float* v = is_w ? s2w + i : s2b + o;
        const float mn = BETA1 * *m + (1.f - BETA1) * grad;
        const float vn = BETA2 * *v + (1.f - BETA2) * (grad * grad);
        *m = mn; *v = vn;
        p -= lr_t * mn / (sqrtf(vn) + EPS);
#else
        float* vel = is_w ? s1w + i : s1b + o;
        const float vn = MOMENTUM * *vel + grad;
        *vel = vn;
        p -= lr_t * vn;
#endif
        *param = p;
    }
    if (is_w) {
        const u16 hb = to_half_bits(*param);
        wimage[wf_offset + b_image_index(K, c, o)] = hb;
        if (wb_offset >= 0) wimage[wb_offset + b_image_index(N, o, c)] = hb;
    }
#if EMA
    // as cpu.py's _update_ema: average the weights the network computes with (fp16 weights, fp32
    // biases); without full precision the weights' average is kept in fp16 too
    float* avg = is_w ? ema_w + i : ema_b + o;
    float e = *param;  // mode 2 (set_params): inference serves the weights just set
    if (mode == 0) {
        const float2 f = ema_table[ctl[CTL_STEP]];  // (keep, take) of the run's step, as lr_t
        const float src = is_w ? half_bits_to_float(to_half_bits(e)) : e;
        e = *avg * f.x + src * f.y;
        if (!EMA_FULL && is_w) e = half_bits_to_float(to_half_bits(e));
    }
    *avg = e;
    if (is_w) eimage[wf_offset + b_image_index(K, c, o)] = to_half_bits(e);
#endif
}

// tinycudann's flat parameters (fp16, mmad.torch's modules) into the fp32 masters and the fp16
// images, one launch: a thread per weight of the padded layers, whose layout is tcnn's (layer by
// layer, row-major N x K). With bias_columns, the thread of a row's first padding column of
// layer 0 sums the row's padding weights into b0 (they multiply tcnn's padding columns of 1; the
// padding the kernels read is 0). The other biases stay as they are (0: tcnn has none).
extern "C" __global__ void mlp_load_tcnn(const u16* __restrict__ flat, float* __restrict__ w, float* __restrict__ b,
                                         u16* __restrict__ wimage, int bias_columns) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= WF_TOTAL) return;
    int l = 0, off = 0;
    while (l < NL - 1 && i >= off + layer_n(l) * layer_k(l)) {
        off += layer_n(l) * layer_k(l);
        ++l;
    }
    const int K = layer_k(l), j = i - off, o = j / K, c = j % K;
    const int fan_out = l == NL - 1 ? NOUT : WIDTH, fan_in = l == 0 ? NIN : WIDTH;
    const u16 hb = flat[i];
    w[i] = half_bits_to_float(hb);
    if (o >= fan_out) return;
    if (c < fan_in) {
        wimage[wf_off(l) + b_image_index(K, c, o)] = hb;
        if (l > 0) wimage[wb_off(l) + b_image_index(layer_n(l), o, c)] = hb;
#if ENCODED_INPUT
        else wimage[WB0_OFF + b_image_index(WIDTH, o, c)] = hb;
#endif
    } else if (l == 0 && c == fan_in && bias_columns) {
        float sum = 0.f;
        for (int p = fan_in; p < K; ++p) sum += half_bits_to_float(flat[off + o * K + p]);
        b[o] = sum;
    }
}

#endif  // SERVE_KERNELS

// ---- training from a held dataset: the epoch's order, the batch gather, the step's bookkeeping --
#if TRAIN_KERNELS

__device__ __forceinline__ u32 mix32(u32 x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

// numerics.epoch_rows, element by element: a keyed four-round Feistel network on 2*half_bits
// bits, cycle-walked into [0, rows); every row once per epoch, nothing stored
__device__ __forceinline__ i64 epoch_row(u32 seed, u32 epoch, i64 rows, int half_bits, i64 position) {
    u32 keys[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) keys[r] = mix32(seed ^ mix32(epoch * 4u + (u32)r + 1u));
    const u32 mask = (1u << half_bits) - 1u;
    u32 v = (u32)position;
    do {
        u32 left = v >> half_bits, right = v & mask;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const u32 next = left ^ (mix32(right ^ keys[r]) & mask);
            left = right;
            right = next;
        }
        v = (left << half_bits) | right;
    } while ((i64)v >= rows);
    return (i64)v;
}

// the next batch of the epoch's order into the fp32 batch buffers the training kernel reads;
// a warp per row (every lane walks the same order, then the columns are copied coalesced)
extern "C" __global__ void mlp_gather_batch(
    const void* __restrict__ xs, int x_half, const void* __restrict__ ys, int y_half, i64 rows,
    int half_bits, const int* __restrict__ ctl, int batch, float* __restrict__ bx, float* __restrict__ by) {
    const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const u32 seed = (u32)ctl[CTL_SEED], epoch = (u32)ctl[CTL_EPOCH];
    const i64 cursor = ctl[CTL_CURSOR];
    for (i64 r = (i64)blockIdx.x * warps + (threadIdx.x >> 5); r < batch; r += (i64)gridDim.x * warps) {
        const i64 src = epoch_row(seed, epoch, rows, half_bits, cursor + r);
        for (int c = lane; c < NIN; c += 32)
            bx[r * NIN + c] = x_half ? half_bits_to_float(static_cast<const u16*>(xs)[src * NIN + c])
                                     : static_cast<const float*>(xs)[src * NIN + c];
        for (int c = lane; c < NOUT; c += 32)
            by[r * NOUT + c] = y_half ? half_bits_to_float(static_cast<const u16*>(ys)[src * NOUT + c])
                                      : static_cast<const float*>(ys)[src * NOUT + c];
    }
}

// the rows of the next batch of the epoch's order, for a training kernel that reads the dataset
// through them (row_map): 4 bytes a row move instead of the rows themselves
extern "C" __global__ void mlp_batch_rows(i64 rows, int half_bits, const int* __restrict__ ctl, int batch,
                                          int* __restrict__ row_map) {
    const u32 seed = (u32)ctl[CTL_SEED], epoch = (u32)ctl[CTL_EPOCH];
    const i64 cursor = ctl[CTL_CURSOR];
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < batch; r += (i64)gridDim.x * blockDim.x)
        row_map[r] = (int)epoch_row(seed, epoch, rows, half_bits, cursor + r);
}

// the end of a step: the loss (the training kernel's per-warp sums, added in a fixed order) to
// losses[step], then the step and, over a dataset (rows > 0), the order's position move on
#define FINISH_THREADS 256
extern "C" __global__ void __launch_bounds__(FINISH_THREADS) mlp_finish_step(
    const double* __restrict__ loss_slots, int n_slots, double* __restrict__ losses, int* __restrict__ ctl,
    int batch, i64 rows) {
    __shared__ double sums[FINISH_THREADS];
    double sum = 0.0;
    for (int i = threadIdx.x; i < n_slots; i += FINISH_THREADS) sum += loss_slots[i];
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int half = FINISH_THREADS / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        losses[ctl[CTL_STEP]] = sums[0];
        ctl[CTL_STEP] += 1;
        if (rows > 0) {
            const i64 next = (i64)ctl[CTL_CURSOR] + batch;
            if (next + batch > rows) {
                ctl[CTL_CURSOR] = 0;
                ctl[CTL_EPOCH] += 1;
            } else {
                ctl[CTL_CURSOR] = (int)next;
            }
        }
    }
}
#endif  // TRAIN_KERNELS
