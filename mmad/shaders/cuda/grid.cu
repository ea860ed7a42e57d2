// tiny-cuda-nn's grid encodings (HashGrid, DenseGrid, TiledGrid) on the cuda backend: the encoded
// input of the mma kernels, the tables' gradient and their optimizer step.
//
// The host (mmad/backends/cuda/grids.py) prepends mlp_common.cuh's types, the optimizer's
// #defines (mma.optimizer_defines) and, per grid part k, a __constant__ table of its levels
// (GRID_LEVELS_k) and the wrappers grid_encode_k / grid_backward_k that instantiate the templates
// below with the part's dims, features and interpolation (and GRID_THREADS, the encode block). The arithmetic is
// mmad/backends/encodings.py's (tcnn's grid.h): pos = fmaf(x, scale, 0.5), the cell floor(pos) as
// uint32, the fraction (through smoothstep for Smoothstep), a corner's row from the dense index,
// tcnn's coherent prime hash or 0 (the level's mode), modulo the level's rows; the weights are
// the dims' factors multiplied in dim order. Interpolation sums in fp32 over fp16 table values.
//
// The kernel input is the raw input rows (the parameter-free parts are encoded on the device too:
// encodings.cu); ``row_map`` (or null) says which input row each batch row reads (a dataset read
// through the epoch's order). Needs encodings.cu before it (enc_din).

#define GRID_MODE_DENSE 0
#define GRID_MODE_HASH 1
#define GRID_MODE_ZERO 2
#define INTERP_LINEAR 0
#define INTERP_NEAREST 1
#define INTERP_SMOOTHSTEP 2

#ifndef CTL_STEP
#define CTL_STEP 0  // the training control block's step word (mlp_mma.cu)
#endif

struct GridLevelDesc {
    unsigned long long fastmod;  // floor(2^64 / entries) + 1: idx % entries without a division (Lemire)
    float scale;
    u32 resolution;
    u32 entries;
    u32 offset;  // first row of the level in its part's table
    int mode;
    u32 mask;  // entries - 1 where entries is a power of two (above 1), else 0
};

__device__ __constant__ u32 HASH_PRIMES[7] = {1u, 2654435761u, 805459861u, 3674653429u, 2097192037u,
                                              1434869437u, 2165219737u};

template <int DIMS, int INTERP>
struct GridCell {
    u32 cell[DIMS];
    float frac[DIMS];
    float slope[DIMS];  // d frac / d position: 1, or smoothstep's 6f(1 − f) (tcnn's pos_derivative)

    __device__ __forceinline__ GridCell(const float (&xrow)[DIMS], const GridLevelDesc& L) {
#pragma unroll
        for (int d = 0; d < DIMS; ++d) {
            const float pos = __fmaf_rn(xrow[d], L.scale, 0.5f);
            const float c = floorf(pos);
            cell[d] = (u32)(int)c;
            float f = pos - c;
            slope[d] = INTERP == INTERP_SMOOTHSTEP ? 6.f * f * (1.f - f) : 1.f;
            if (INTERP == INTERP_SMOOTHSTEP) f = f * f * (3.f - 2.f * f);
            frac[d] = f;
        }
    }

    // the weight of `corner` without dim `skip`'s factor
    __device__ __forceinline__ float weight_without(int corner, int skip) const {
        float w = 1.f;
#pragma unroll
        for (int d = 0; d < DIMS; ++d)
            if (d != skip) w *= ((corner >> d) & 1) ? frac[d] : 1.f - frac[d];
        return w;
    }

    __device__ __forceinline__ u32 row(const GridLevelDesc& L, int corner) const {
        u32 idx = 0;
        if (L.mode == GRID_MODE_HASH) {
#pragma unroll
            for (int d = 0; d < DIMS; ++d) idx ^= (cell[d] + ((corner >> d) & 1)) * HASH_PRIMES[d];
        } else if (L.mode == GRID_MODE_DENSE) {
            u32 stride = 1;
#pragma unroll
            for (int d = 0; d < DIMS; ++d) {
                idx += (cell[d] + ((corner >> d) & 1)) * stride;
                stride *= L.resolution;
            }
        }
        // idx % entries: a mask for a power of two (hashed levels), else the index itself where it is
        // in range (a corner inside the grid), else Lemire's exact 32-bit remainder
        if (L.mask != 0u) return (idx & L.mask) + L.offset;
        return (idx < L.entries ? idx : (u32)__umul64hi(L.fastmod * idx, L.entries)) + L.offset;
    }

    __device__ __forceinline__ float weight(int corner) const {
        float w = 1.f;
#pragma unroll
        for (int d = 0; d < DIMS; ++d) w *= ((corner >> d) & 1) ? frac[d] : 1.f - frac[d];
        return w;
    }
};

template <int INTERP, int DIMS>
__device__ __forceinline__ constexpr int grid_corners() { return INTERP == INTERP_NEAREST ? 1 : 1 << DIMS; }

template <int F>
__device__ __forceinline__ void add_table_row(float* acc, const u16* __restrict__ table, u32 row, float w) {
    if (F % 2 == 0) {
        const u32* p = reinterpret_cast<const u32*>(table + (size_t)row * F);
#pragma unroll
        for (int f = 0; f < F; f += 2) {
            const float2 v = unpack_h2(__ldg(p + f / 2));
            acc[f] = fmaf(w, v.x, acc[f]);
            acc[f + 1] = fmaf(w, v.y, acc[f + 1]);
        }
    } else {
#pragma unroll
        for (int f = 0; f < F; ++f) acc[f] = fmaf(w, half_bits_to_float(__ldg(table + (size_t)row * F + f)), acc[f]);
    }
}

// The table rows of one grid cell's corners that differ only in dim 0 (corners c and c + 1, c even)
// often share an aligned 16-byte group of the table: the dense index puts them side by side, and
// tcnn's hash multiplies dim 0 by 1, so x and x + 1 differ in the low bits only (x even: bit 0).
// One 16-byte load then serves both; as two loads each missed L1 and read its own L2 sector
// (Nsight Compute, 2^19 table: as many sectors as fine-level corner loads). For rows of 1, 2 or 4
// fp16 values whose table starts at a multiple of a row, in 2-3 dims (GROUPED: the host decides).
__device__ __forceinline__ const uint4* table_group(const u16* p) {
    return reinterpret_cast<const uint4*>(reinterpret_cast<size_t>(p) & ~(size_t)15);
}

template <int F>
__device__ __forceinline__ void add_group_row(float* acc, const uint4& q, const u16* p, float w) {
    const u32 byte = (u32)reinterpret_cast<size_t>(p) & 15u;
    const u32 lo = (byte & 8u) ? q.z : q.x, hi = (byte & 8u) ? q.w : q.y;  // the 8-byte half holding the row
    if (F == 4) {
        const float2 a = unpack_h2(lo), b = unpack_h2(hi);
        acc[0] = fmaf(w, a.x, acc[0]);
        acc[1] = fmaf(w, a.y, acc[1]);
        acc[2] = fmaf(w, b.x, acc[2]);
        acc[3] = fmaf(w, b.y, acc[3]);
    } else {
        const u32 word = (byte & 4u) ? hi : lo;
        if (F == 2) {
            const float2 v = unpack_h2(word);
            acc[0] = fmaf(w, v.x, acc[0]);
            acc[1] = fmaf(w, v.y, acc[1]);
        } else {
            acc[0] = fmaf(w, half_bits_to_float((u16)((byte & 2u) ? word >> 16 : word & 0xffffu)), acc[0]);
        }
    }
}

template <int DIMS, int F, int INTERP, bool GROUPED>
__device__ __forceinline__ void add_corners(float* acc, const u16* __restrict__ table, const GridCell<DIMS, INTERP>& g,
                                            const GridLevelDesc& L) {
    if constexpr (GROUPED && INTERP != INTERP_NEAREST) {
#pragma unroll
        for (int corner = 0; corner < (1 << DIMS); corner += 2) {
            const u16* p0 = table + (size_t)g.row(L, corner) * F;
            const u16* p1 = table + (size_t)g.row(L, corner + 1) * F;
            const uint4 q0 = __ldg(table_group(p0));
            const uint4 q1 = table_group(p0) == table_group(p1) ? q0 : __ldg(table_group(p1));
            add_group_row<F>(acc, q0, p0, g.weight(corner));
            add_group_row<F>(acc, q1, p1, g.weight(corner + 1));
        }
    } else {
#pragma unroll
        for (int corner = 0; corner < grid_corners<INTERP, DIMS>(); ++corner)
            add_table_row<F>(acc, table, g.row(L, corner), INTERP == INTERP_NEAREST ? 1.f : g.weight(corner));
    }
}

// Row r's features at one level, out as one word per pair (coalesced over consecutive rows).
template <int DIMS, int F, int INTERP, bool GROUPED, int BEGIN, int COLUMN, int X_COLS>
__device__ __forceinline__ void grid_encode_row(
    const GridLevelDesc& L, int level, const float* __restrict__ x, const int* __restrict__ row_map, i64 rows, i64 r,
    u16* __restrict__ out, const u16* __restrict__ table) {
    const float* xs = x + (row_map ? (i64)row_map[r] : r) * X_COLS + BEGIN;
    float xr[DIMS];
    if constexpr (DIMS % 2 == 0 && BEGIN % 2 == 0 && X_COLS % 2 == 0) {  // 8-byte loads of the position
#pragma unroll
        for (int d = 0; d < DIMS; d += 2) {
            const float2 v = __ldg(reinterpret_cast<const float2*>(xs + d));
            xr[d] = v.x;
            xr[d + 1] = v.y;
        }
    } else {
#pragma unroll
        for (int d = 0; d < DIMS; ++d) xr[d] = __ldg(xs + d);
    }
    const GridCell<DIMS, INTERP> g(xr, L);
    float acc[F];
#pragma unroll
    for (int f = 0; f < F; ++f) acc[f] = 0.f;
    add_corners<DIMS, F, INTERP, GROUPED>(acc, table, g, L);
    const int c0 = COLUMN + level * F;
    if constexpr (F % 2 == 0 && COLUMN % 2 == 0) {  // whole pairs: one word each
#pragma unroll
        for (int f = 0; f < F; f += 2)
            reinterpret_cast<u32*>(out)[pair_major(rows, r, c0 + f) / 2] = pack_h2(acc[f], acc[f + 1]);
    } else {
#pragma unroll
        for (int f = 0; f < F; ++f) out[pair_major(rows, r, c0 + f)] = to_half_bits(acc[f]);
    }
}

// A thread per (row, level), blockIdx.y the level: the blocks resident on an SM at once work on
// one level, so its table rows stay in L1 (H100, the image config: 49 us against 70 for a thread
// per row and every level). Blocks that stay on the level of their SM (%smid) and claim row
// chunks from a counter per level measure no faster.
template <int DIMS, int F, int INTERP, bool GROUPED, int BEGIN, int COLUMN, int X_COLS>
__device__ __forceinline__ void grid_encode_part(
    const GridLevelDesc* __restrict__ levels, const float* __restrict__ x, const int* __restrict__ row_map, i64 rows,
    u16* __restrict__ out, const u16* __restrict__ table) {
    const i64 r = (i64)blockIdx.x * GRID_THREADS + threadIdx.x;
    if (r >= rows) return;
    const int level = blockIdx.y;
    grid_encode_row<DIMS, F, INTERP, GROUPED, BEGIN, COLUMN, X_COLS>(levels[level], level, x, row_map, rows, r, out,
                                                                     table);
}

__device__ __forceinline__ void red_add(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(v) : "memory");
}

__device__ __forceinline__ void red_add2(float* p, float a, float b) {  // sm_90: one 8-byte reduction
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a), "f"(b) : "memory");
}

// d loss / d table of one grid part (tcnn's scatter: each corner gets weight x gradient). The
// row's d loss / d encoded input comes from the training kernel (``din``: fp16, rows_pad x
// din_cols, loss-scaled: ``inv_scale`` undoes it). A thread per row (grid-stride) and one level
// per blockIdx.y, as tcnn's kernel_grid_backward: the blocks of a level run before the next's, so
// the gradient rows being added to are one level's (a 2^19-entry level of pairs is 4 MiB of fp32)
// and stay in L2, where every level at once (52 MiB for instant-NGP's 13 hashed levels) did not.
// blockIdx.y 0 (when SMEM_LEVELS > 0) takes the first SMEM_LEVELS levels together (the coarse
// ones, SMEM_VALUES values: their rows are the first of the table), adding into shared memory,
// and the block adds its sums to ``grad`` once at the end: thousands of rows share each of their
// few rows, which as global atomics would queue on the same addresses. The other levels add into
// ``grad`` directly (8-byte reductions for pairs). Launched with grid_backward_levels(...) in y.
template <int DIMS, int F, int INTERP, int LEVELS, int SMEM_LEVELS, int SMEM_VALUES>
__device__ __forceinline__ void grid_backward_part(
    const GridLevelDesc* __restrict__ levels, int begin, int column, const u16* __restrict__ din, int din_cols,
    const float* __restrict__ x, const int* __restrict__ row_map, i64 rows, int x_cols, float* __restrict__ grad,
    float inv_scale) {
    __shared__ float sgrad[SMEM_VALUES > 0 ? SMEM_VALUES : 1];
    const bool coarse = SMEM_LEVELS > 0 && blockIdx.y == 0;  // the same for the whole block
    const int first = coarse ? 0 : SMEM_LEVELS + (int)blockIdx.y - (SMEM_LEVELS > 0 ? 1 : 0);
    const int last = coarse ? SMEM_LEVELS : first + 1;
    if (coarse) {
        for (int i = threadIdx.x; i < SMEM_VALUES; i += blockDim.x) sgrad[i] = 0.f;
        __syncthreads();
    }
    for (i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += (i64)gridDim.x * blockDim.x) {
        const i64 src = row_map ? (i64)row_map[r] : r;
        float xr[DIMS];
#pragma unroll
        for (int d = 0; d < DIMS; ++d) xr[d] = __ldg(x + src * x_cols + begin + d);
        const u16* dr = din + r * din_cols + column;
        // not unrolled: the reductions need no registers in flight, and unrolled a 3-D part spills
#pragma unroll 1
        for (int level = first; level < last; ++level) {
            float dl[F];
#pragma unroll
            for (int f = 0; f < F; ++f) dl[f] = half_bits_to_float(__ldg(dr + level * F + f)) * inv_scale;
            const GridLevelDesc L = levels[level];
            const GridCell<DIMS, INTERP> g(xr, L);
#pragma unroll
            for (int corner = 0; corner < grid_corners<INTERP, DIMS>(); ++corner) {
                const float w = INTERP == INTERP_NEAREST ? 1.f : g.weight(corner);
                const u32 row = g.row(L, corner);
                if (coarse) {
#pragma unroll
                    for (int f = 0; f < F; ++f) atomicAdd(sgrad + row * F + f, w * dl[f]);
                } else if (F % 2 == 0) {
#pragma unroll
                    for (int f = 0; f < F; f += 2) red_add2(grad + (size_t)row * F + f, w * dl[f], w * dl[f + 1]);
                } else {
#pragma unroll
                    for (int f = 0; f < F; ++f) red_add(grad + (size_t)row * F + f, w * dl[f]);
                }
            }
        }
    }
    if (!coarse) return;
    __syncthreads();
    if (F % 2 == 0) {
        for (int i = 2 * threadIdx.x; i < SMEM_VALUES; i += 2 * blockDim.x)
            if (sgrad[i] != 0.f || sgrad[i + 1] != 0.f) red_add2(grad + i, sgrad[i], sgrad[i + 1]);
    } else {
        for (int i = threadIdx.x; i < SMEM_VALUES; i += blockDim.x)
            if (sgrad[i] != 0.f) red_add(grad + i, sgrad[i]);
    }
}

// d loss / d input of one grid part (tcnn's kernel_grid dy_dx and kernel_grid_backward_input): a
// thread per row, every level; per dim, scale · slope · Σ over the corner pairs along it of the
// other dims' weights · (right row − left row) · d loss / d feature, added into dx (rows × x_cols).
// ``din``: d loss / d encoded output, row-major fp16 or fp32 (din_half), din_cols a row, times
// inv_scale. Nearest interpolation has no input gradient (the host launches nothing).
template <int DIMS, int F, int INTERP, int LEVELS>
__device__ __forceinline__ void grid_input_grad_part(
    const GridLevelDesc* __restrict__ levels, int begin, int column, const void* __restrict__ din, int din_half,
    int din_cols, const float* __restrict__ x, i64 rows, int x_cols, const u16* __restrict__ table, float inv_scale,
    float* __restrict__ dx) {
    const i64 r = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float xr[DIMS], acc[DIMS];
#pragma unroll
    for (int d = 0; d < DIMS; ++d) {
        xr[d] = __ldg(x + r * x_cols + begin + d);
        acc[d] = 0.f;
    }
#pragma unroll 1
    for (int level = 0; level < LEVELS; ++level) {
        const GridLevelDesc L = levels[level];
        const GridCell<DIMS, INTERP> g(xr, L);
        float dl[F];
#pragma unroll
        for (int f = 0; f < F; ++f) dl[f] = enc_din(din, din_half, din_cols, r, column + level * F + f);
        float proj[1 << DIMS];  // each corner's row · d loss / d features
#pragma unroll
        for (int corner = 0; corner < (1 << DIMS); ++corner) {
            const u16* p = table + (size_t)g.row(L, corner) * F;
            float s = 0.f;
#pragma unroll
            for (int f = 0; f < F; ++f) s = fmaf(half_bits_to_float(__ldg(p + f)), dl[f], s);
            proj[corner] = s;
        }
#pragma unroll
        for (int d = 0; d < DIMS; ++d) {
            float s = 0.f;
#pragma unroll
            for (int corner = 0; corner < (1 << DIMS); ++corner)
                if ((corner >> d) & 1) s = fmaf(g.weight_without(corner, d), proj[corner] - proj[corner ^ (1 << d)], s);
            acc[d] = fmaf(L.scale * g.slope[d], s, acc[d]);
        }
    }
#pragma unroll
    for (int d = 0; d < DIMS; ++d) dx[r * x_cols + begin + d] += acc[d] * inv_scale;
}

// A batch's targets gathered through the epoch order's row numbers, as fp32 (the training
// kernels' type) from an fp32 or fp16 dataset.
extern "C" __global__ void grid_gather_targets(const void* __restrict__ y, int y_half, const int* __restrict__ row_map,
                                               i64 rows, int cols, float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    const i64 src = (i64)row_map[i / cols] * cols + i % cols;
    out[i] = y_half ? half_bits_to_float(reinterpret_cast<const u16*>(y)[src]) : reinterpret_cast<const float*>(y)[src];
}

// One optimizer step on every table value (all grid parts), then the fp16 image the forward
// reads; ``grad`` is zeroed for the next step's atomics. Adam as tcnn steps non-matrix parameters
// (numerics.grid_adam_update): a value whose gradient is exactly 0 is skipped, the bias
// correction uses its own step count, no L2. SGD as the MLP's (numerics.optimizer_update).
// ``lr_table``: the run's base rate per step (Adam) or rate (SGD), indexed by ctl[CTL_STEP].
// mode 0: step; 2: refresh the images (and the EMA average) from ``w`` only (set_params); 3: the
// EMA image from the average only (a restored optimizer state).
extern "C" __global__ void grid_optimize(int mode, i64 n, float* __restrict__ w, float* __restrict__ grad,
                                         float* __restrict__ s1, float* __restrict__ s2, u32* __restrict__ steps,
                                         u16* __restrict__ image, const float* __restrict__ lr_table,
                                         const int* __restrict__ ctl, float* __restrict__ ema,
                                         u16* __restrict__ eimage, const float2* __restrict__ ema_table) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
#if EMA
    if (mode == 3) {
        eimage[i] = to_half_bits(ema[i]);
        return;
    }
#endif
#if OPT_ADAM && !EMA
    // a value no row read keeps everything (its image included): only its gradient is read
    if (mode == 0 && grad[i] == 0.f) return;
#endif
    float p = w[i];
    if (mode == 0) {
        const float g = grad[i];
        const float lr = lr_table[ctl[CTL_STEP]];
#if OPT_ADAM
        if (g != 0.f) {
            grad[i] = 0.f;
            const float mn = BETA1 * s1[i] + (1.f - BETA1) * g;
            const float vn = BETA2 * s2[i] + (1.f - BETA2) * (g * g);
            s1[i] = mn;
            s2[i] = vn;
            const u32 t = steps[i] + 1;
            steps[i] = t;
            const float lr_t = lr * sqrtf(1.f - powf(BETA2, (float)t)) / (1.f - powf(BETA1, (float)t));
            p -= lr_t * mn / (sqrtf(vn) + EPS);
            w[i] = p;
        }
#else
        grad[i] = 0.f;
        const float gl = g + L2REG * p;
        const float vn = MOMENTUM * s1[i] + gl;
        s1[i] = vn;
        p -= lr * vn;
        w[i] = p;
#endif
    }
    image[i] = to_half_bits(p);
#if EMA
    float e = p;
    if (mode == 0) {
        const float2 f = ema_table[ctl[CTL_STEP]];
        e = ema[i] * f.x + half_bits_to_float(to_half_bits(p)) * f.y;
        if (!EMA_FULL) e = half_bits_to_float(to_half_bits(e));
    }
    ema[i] = e;
    eimage[i] = to_half_bits(e);
#endif
}
