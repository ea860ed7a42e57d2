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

// The F values of the row at p from its aligned 16-byte group q (table_group(p)).
template <int F>
__device__ __forceinline__ void group_row(const uint4& q, const u16* p, float* v) {
    const u32 byte = (u32)reinterpret_cast<size_t>(p) & 15u;
    const u32 lo = (byte & 8u) ? q.z : q.x, hi = (byte & 8u) ? q.w : q.y;  // the 8-byte half holding the row
    if (F == 4) {
        const float2 a = unpack_h2(lo), b = unpack_h2(hi);
        v[0] = a.x;
        v[1] = a.y;
        v[2] = b.x;
        v[3] = b.y;
    } else {
        const u32 word = (byte & 4u) ? hi : lo;
        if (F == 2) {
            const float2 h = unpack_h2(word);
            v[0] = h.x;
            v[1] = h.y;
        } else {
            v[0] = half_bits_to_float((u16)((byte & 2u) ? word >> 16 : word & 0xffffu));
        }
    }
}

template <int F>
__device__ __forceinline__ void add_group_row(float* acc, const uint4& q, const u16* p, float w) {
    float v[F];
    group_row<F>(q, p, v);
#pragma unroll
    for (int f = 0; f < F; ++f) acc[f] = fmaf(w, v[f], acc[f]);
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

__device__ __forceinline__ void red_add4(float* p, float a, float b, float c, float d) {  // sm_90: 16 bytes
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Add w · dl (F values) into the F floats at p: 16-byte reductions where p allows, else 8-byte
// ones for pairs (a part's table starts at an even value), else single values.
template <int F>
__device__ __forceinline__ void red_row(float* p, float w, const float* dl) {
    if (F % 4 == 0 && (reinterpret_cast<size_t>(p) & 15u) == 0u) {
#pragma unroll
        for (int f = 0; f < F; f += 4) red_add4(p + f, w * dl[f], w * dl[f + 1], w * dl[f + 2], w * dl[f + 3]);
    } else if (F % 2 == 0) {
#pragma unroll
        for (int f = 0; f < F; f += 2) red_add2(p + f, w * dl[f], w * dl[f + 1]);
    } else {
#pragma unroll
        for (int f = 0; f < F; ++f) red_add(p + f, w * dl[f]);
    }
}

// d loss / d table of one grid part (tcnn's scatter: each corner gets weight x gradient). The
// row's d loss / d encoded input comes from the training kernel (``din``: fp16, rows_pad x
// din_cols, loss-scaled: ``inv_scale`` undoes it). One level per blockIdx.y, as tcnn's
// kernel_grid_backward: the blocks of a level run before the next's, so the gradient rows being
// added to are one level's (a 2^19-entry level of pairs is 4 MiB of fp32) and stay in L2, where
// every level at once (52 MiB for instant-NGP's 13 hashed levels) did not.
// Two threads per row (grid-stride over rows × 2), side by side in the warp: thread 2r + s adds
// the corners whose dim-0 bit is s. tcnn's hash multiplies dim 0 by 1 and the dense index counts
// it first, so a corner's row and its dim-0 neighbour's differ in their low bits only: the same
// 32-byte sector of the gradient unless x ≡ 3 mod 4, the same 128-byte line unless x ≡ 15 mod 16,
// and the two threads' reductions of one instruction reach L2 together (H200, instant-NGP's 2^18
// rows: 291 us against 396 for a thread per row doing all 8 corners; one thread per row with one
// 16-byte reduction of both rows where they are 2k and 2k + 1, else two: 311 us).
// blockIdx.y 0 (when SMEM_LEVELS > 0) takes the first SMEM_LEVELS levels together (the coarse
// ones, SMEM_VALUES values: their rows are the first of the table), adding into shared memory,
// and the block adds its sums to ``grad`` once at the end: thousands of rows share each of their
// few rows, which as global atomics would queue on the same addresses. Half the blocks of x do
// it, each over twice the rows: half the flushes (the image config's 4 coarse levels: 135 us
// against 160 with every block). The other levels add into ``grad`` directly.
// Launched with GridPlan.backward_level_blocks(...) in y.
template <int DIMS, int F, int INTERP, int LEVELS, int SMEM_LEVELS, int SMEM_VALUES>
__device__ __forceinline__ void grid_backward_part(
    const GridLevelDesc* __restrict__ levels, int begin, int column, const u16* __restrict__ din, int din_cols,
    const float* __restrict__ x, const int* __restrict__ row_map, i64 rows, int x_cols, float* __restrict__ grad,
    float inv_scale) {
    __shared__ float sgrad[SMEM_VALUES > 0 ? SMEM_VALUES : 1];
    const bool coarse = SMEM_LEVELS > 0 && blockIdx.y == 0;  // the same for the whole block
    const int first = coarse ? 0 : SMEM_LEVELS + (int)blockIdx.y - (SMEM_LEVELS > 0 ? 1 : 0);
    const int last = coarse ? SMEM_LEVELS : first + 1;
    const int blocks = coarse ? max(1, (int)gridDim.x / 2) : (int)gridDim.x;
    if ((int)blockIdx.x >= blocks) return;
    if (coarse) {
        for (int i = threadIdx.x; i < SMEM_VALUES; i += blockDim.x) sgrad[i] = 0.f;
        __syncthreads();
    }
    constexpr int CORNERS = grid_corners<INTERP, DIMS>();
    constexpr int LANES = CORNERS > 1 ? 2 : 1;  // threads per row
    for (i64 t = (i64)blockIdx.x * blockDim.x + threadIdx.x; t < rows * LANES; t += (i64)blocks * blockDim.x) {
        const i64 r = t / LANES;
        const int side = (int)(t % LANES);
        const i64 src = row_map ? (i64)row_map[r] : r;
        float xr[DIMS];
#pragma unroll
        for (int d = 0; d < DIMS; ++d) xr[d] = __ldg(x + src * x_cols + begin + d);
        const u16* dr = din + r * din_cols + column;
        // not unrolled: the reductions need no registers in flight, and unrolled a 3-D part spills
#pragma unroll 1
        for (int level = first; level < last; ++level) {
            const u16* dp = dr + level * F;
            float dl[F];
            if (F % 2 == 0 && (reinterpret_cast<size_t>(dp) & 3u) == 0u) {  // the pairs as words
#pragma unroll
                for (int f = 0; f < F; f += 2) {
                    const float2 v = unpack_h2(__ldg(reinterpret_cast<const u32*>(dp + f)));
                    dl[f] = v.x * inv_scale;
                    dl[f + 1] = v.y * inv_scale;
                }
            } else {
#pragma unroll
                for (int f = 0; f < F; ++f) dl[f] = half_bits_to_float(__ldg(dp + f)) * inv_scale;
            }
            const GridLevelDesc L = levels[level];
            const GridCell<DIMS, INTERP> g(xr, L);
#pragma unroll
            for (int c = 0; c < CORNERS / LANES; ++c) {
                const int corner = c * LANES + side;
                const float w = INTERP == INTERP_NEAREST ? 1.f : g.weight(corner);
                const u32 row = g.row(L, corner);
                if (coarse) {
#pragma unroll
                    for (int f = 0; f < F; ++f) atomicAdd(sgrad + row * F + f, w * dl[f]);
                } else {
                    red_row<F>(grad + (size_t)row * F, w, dl);
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
// inv_scale. Nearest interpolation has no input gradient (the host launches nothing). GROUPED:
// the corners along dim 0 from one 16-byte load where they share it, as add_corners (H200,
// instant-NGP's 2^18 rows: 178 us against 261 for a 2-byte load per value).
template <int DIMS, int F, int INTERP, bool GROUPED, int LEVELS>
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
        if constexpr (GROUPED) {
#pragma unroll
            for (int corner = 0; corner < (1 << DIMS); corner += 2) {
                const u16* p0 = table + (size_t)g.row(L, corner) * F;
                const u16* p1 = table + (size_t)g.row(L, corner + 1) * F;
                const uint4 q0 = __ldg(table_group(p0));
                const uint4 q1 = table_group(p0) == table_group(p1) ? q0 : __ldg(table_group(p1));
                float v0[F], v1[F];
                group_row<F>(q0, p0, v0);
                group_row<F>(q1, p1, v1);
                float s0 = 0.f, s1 = 0.f;
#pragma unroll
                for (int f = 0; f < F; ++f) {
                    s0 = fmaf(v0[f], dl[f], s0);
                    s1 = fmaf(v1[f], dl[f], s1);
                }
                proj[corner] = s0;
                proj[corner + 1] = s1;
            }
        } else {
#pragma unroll
            for (int corner = 0; corner < (1 << DIMS); ++corner) {
                const u16* p = table + (size_t)g.row(L, corner) * F;
                float s = 0.f;
#pragma unroll
                for (int f = 0; f < F; ++f) s = fmaf(half_bits_to_float(__ldg(p + f)), dl[f], s);
                proj[corner] = s;
            }
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

// mmad.torch's d loss / d params as its fp32 master parameters receive them: n fp32 sums rounded
// to fp16 and back in place (tinycudann's fp16 gradient through torch's cast), 4 values a thread.
extern "C" __global__ void grid_round_half(i64 n, float* g) {
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i + 4 <= n && (reinterpret_cast<size_t>(g) & 15u) == 0u) {
        float4 v = reinterpret_cast<const float4*>(g + i)[0];
        v = make_float4(half_bits_to_float(to_half_bits(v.x)), half_bits_to_float(to_half_bits(v.y)),
                        half_bits_to_float(to_half_bits(v.z)), half_bits_to_float(to_half_bits(v.w)));
        reinterpret_cast<float4*>(g + i)[0] = v;
    } else {
        for (i64 k = i; k < n && k < i + 4; ++k) g[k] = half_bits_to_float(to_half_bits(g[k]));
    }
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
