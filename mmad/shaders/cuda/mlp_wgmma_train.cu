// MLP training on Hopper warpgroup MMA (wgmma, sm_90a): the wgmma variant's training step.
//
// Compiled as a module of its own (the forward module's code stays as benchmarked): the source
// of a training plan (WgmmaPlan with training=True: NOUT_P at least 16, since the backward's k16
// steps read 16 output rows of W_out, and the image and biases laid out for that), then
// mlp_wgmma.cu's helpers (TRAIN_MODULE leaves its kernels out) and this file. Its own #defines:
//   WGT MIN_BLOCKS_T SMT_B_OFF SMT_A_OFF      warpgroups per block, blocks an SM, sections
//   KIN WIDTH NOUT_PAD STORE_DACT              the mma plan's buffers (mlp_mma.cu: h_off, d_off)
//   WG_KP0 WG_KPW WG_STAGES                    the weight-gradient kernels' N (fan_in padded to
//               64) for layer 0 and the later layers, and their ring depth
//
// wgmma_train_fwd_bwd(_rows): one warpgroup per 64-row tile, persistent; the weights resident in
// shared memory. Forward as wgmma_forward (layer 0 A from the tile in shared memory, later layers
// A from registers), every layer's fp16 output h stored for the weight gradients (and the
// activation's derivative where h does not give it), the loss and the output delta, then the
// backward through the same resident weights: G = delta . W, with delta the A operand from
// registers (the accumulator-to-A chaining of the forward) and W read transposed from its
// K-major image through an MN-major descriptor (kmajor_as_mn_desc), each layer's delta stored.
// The buffers are the mma variant's (h_off, d_off), so the loss and both kernels' results are
// laid out as mlp_optimize and the mma kernels expect.
//
// wgmma_wgrad_in / wgmma_wgrad_hid: dW = delta^T . h over one chunk of rows for a 64-row block of
// fan_out, both operands MN-major from shared memory (transposed wgmma), the chunk's partial sums
// to pw[chunk][N][K] and pb[chunk][N]; mlp_optimize adds the chunks in a fixed order.

__device__ __forceinline__ i64 h_off(int l, i64 rows_pad) { return l == 0 ? 0 : rows_pad * (KIN + (i64)(l - 1) * WIDTH); }
__device__ __forceinline__ i64 d_off(int l, i64 rows_pad) { return rows_pad * (i64)l * WIDTH; }

// the 64 input rows of a tile (row r of the batch is row src_row(r) of x) -> the K-major A tile
// (fp16, zero past the rows and NIN) and h_0 (the same values, KIN columns a row) in hbuf
template <bool MAPPED>
__device__ __forceinline__ void load_train_input(unsigned char* a_tile, const float* __restrict__ x, i64 rows,
                                                 const int* __restrict__ row_map, i64 tile, u16* __restrict__ h0) {
    constexpr int CHUNKS = KIN_P / 8;
    for (int c = threadIdx.x & 127; c < 64 * CHUNKS; c += 128) {
        const int r = c / CHUNKS, k0 = (c % CHUNKS) * 8;
        const i64 row = tile * 64 + r;
        float v[8];
        const bool live = row < rows;
        const i64 src = live ? (MAPPED ? (i64)__ldg(row_map + row) : row) : 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = (live && k0 + j < NIN) ? __ldg(x + src * NIN + k0 + j) : 0.f;
        const uint4 h = make_uint4(pack_h2(v[0], v[1]), pack_h2(v[2], v[3]), pack_h2(v[4], v[5]), pack_h2(v[6], v[7]));
        *reinterpret_cast<uint4*>(a_tile + kmajor_offset(r, k0, 64, SWZ_IN)) = h;
        if (k0 < KIN) *reinterpret_cast<uint4*>(h0 + row * KIN + k0) = h;
    }
}

// the accumulator pairs of an m64nN tile to a row-major fp16 buffer of `stride` columns (pairs
// at or past `stride` are not stored)
template <int N>
__device__ __forceinline__ void store_pairs(u16* __restrict__ buf, int stride, const u32* a, i64 tile, int warp,
                                            int g, int t) {
#pragma unroll
    for (int i = 0; i < N / 2; i += 2) {
        const int col = out_col(t, i);
        if (col < stride) *reinterpret_cast<u32*>(buf + out_row(tile, warp, g, i) * stride + col) = a[i / 2];
    }
}

template <bool MAPPED>
__device__ __forceinline__ void train_fwd_bwd(
    const float* __restrict__ x, i64 rows, i64 n_tiles, const unsigned char* __restrict__ wimg,
    const float* __restrict__ bimg, const float* __restrict__ target, float grad_scale, u16* __restrict__ hbuf,
    u16* __restrict__ dbuf, u16* __restrict__ dactbuf, double* __restrict__ loss_partial,
    const int* __restrict__ row_map) {
    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    const int wg = threadIdx.x >> 7;
    const u32 s_w = smem_addr(smem);
    unsigned char* a_tile = smem + SMT_A_OFF + wg * A_BYTES;
    const u32 s_a = smem_addr(a_tile);
    float* bias_s = reinterpret_cast<float*>(smem + SMT_B_OFF);
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 rows_pad = n_tiles * 64;

    for (int i = threadIdx.x; i < B_TOTAL; i += blockDim.x) bias_s[i] = bimg[i];
    copy_async(s_w, wimg, W_TOTAL_BYTES);
    cp_async_commit();
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();

    double loss_sum = 0.0;
    for (i64 tile = (i64)blockIdx.x * WGT + wg; tile < n_tiles; tile += (i64)gridDim.x * WGT) {
        wg_sync_of<WGT>();  // every warp's reads of the last tile's A are done
        load_train_input<MAPPED>(a_tile, x, rows, row_map, tile, hbuf);
        fence_proxy_async();
        wg_sync_of<WGT>();

        // ---- forward: every hidden layer's h stored (zero on rows past the batch)
        float d[WP / 2];
        u32 a[WP / 4];
        wgmma_layer0(d, s_a, s_w);
#pragma unroll 1
        for (int l = 0; l < NHID; ++l) {
            if (l > 0) {
                const u32 w_l = s_w + W_OFF1 + (l - 1) * W_HID_STRIDE;
                wgmma_rs_layer<WP / 2, WP>(d, a, wgmma_rs_n_hidden, [&](int ks) { return kmajor_desc(w_l, ks, WP, SWZ_W); });
            }
            const float* b = bias_s + l * WP;
            u32 da[WP / 4];
#pragma unroll
            for (int i = 0; i < WP / 2; i += 2) {
                const float2 bv = *reinterpret_cast<const float2*>(b + out_col(t, i));
                const float z0 = d[i] + bv.x, z1 = d[i + 1] + bv.y;
                const bool live = out_row(tile, warp, g, i) < rows;
                a[i / 2] = live ? pack_h2(activate(ACT, z0), activate(ACT, z1)) : 0u;
                if (STORE_DACT) da[i / 2] = live ? pack_h2(activation_grad(ACT, z0), activation_grad(ACT, z1)) : 0u;
            }
            store_pairs<WP>(hbuf + h_off(l + 1, rows_pad), WIDTH, a, tile, warp, g, t);
            if (STORE_DACT) store_pairs<WP>(dactbuf + (i64)l * rows_pad * WIDTH, WIDTH, da, tile, warp, g, t);
        }

        // ---- output layer, loss, output delta
        float o[NOUT_P / 2];
        wgmma_rs_layer<NOUT_P / 2, WP>(o, a, wgmma_rs_n_out,
                                       [&](int ks) { return kmajor_desc(s_w + W_OFF_OUT, ks, NOUT_P, SWZ_W); });
        const float* bias_o = bias_s + NHID * WP;
        float z[NOUT_P / 2], p[NOUT_P / 2];
#pragma unroll
        for (int i = 0; i < NOUT_P / 2; ++i) {
            z[i] = o[i] + bias_o[out_col(t, i & ~1) + (i & 1)];
            p[i] = activate(OUT_ACT, z[i]);
        }
#if LOSS == LOSS_REL_L2_LUM
        // the row's luminance from its first three outputs: columns 0, 1 in lane 4g, 2 in 4g + 1
        float lum[2];
        {
            const int base = lane & ~3;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const float q0 = __shfl_sync(0xffffffffu, p[half * 2], base);
                const float q1 = __shfl_sync(0xffffffffu, p[half * 2 + 1], base);
                const float q2 = __shfl_sync(0xffffffffu, p[half * 2], base + 1);
#if NOUT >= 3
                lum[half] = 0.299f * q0 + 0.587f * q1 + 0.114f * q2;
#elif NOUT == 2
                lum[half] = 0.5f * (fabsf(q0) + fabsf(q1));
#else
                lum[half] = fabsf(q0);
#endif
            }
        }
#endif
        u32 ad[NOUT_P / 4];
#pragma unroll
        for (int i = 0; i < NOUT_P / 2; i += 2) {
            const int col = out_col(t, i);
            const i64 r = out_row(tile, warp, g, i);
            const bool rok = r < rows;
            float y0 = 0.f, y1 = 0.f;
            if (rok) {
                const float* yp = target + (MAPPED ? (i64)__ldg(row_map + r) : r) * NOUT + col;
                if (col < NOUT) y0 = __ldg(yp);
                if (col + 1 < NOUT) y1 = __ldg(yp + 1);
            }
            float l_lum = 0.f;
#if LOSS == LOSS_REL_L2_LUM
            l_lum = lum[(i >> 1) & 1];
#endif
            float gr0, gr1;
            const float v0 = loss_term(p[i], y0, l_lum, &gr0);
            const float v1 = loss_term(p[i + 1], y1, l_lum, &gr1);
            const bool ok0 = rok && col < NOUT, ok1 = rok && col + 1 < NOUT;
            if (ok0) loss_sum += (double)v0;
            if (ok1) loss_sum += (double)v1;
            const float d0 = ok0 ? gr0 * grad_scale * activation_grad(OUT_ACT, z[i]) : 0.f;
            const float d1 = ok1 ? gr1 * grad_scale * activation_grad(OUT_ACT, z[i + 1]) : 0.f;
            ad[i / 2] = pack_h2(d0, d1);
        }
        store_pairs<NOUT_P>(dbuf + d_off(NL - 1, rows_pad), NOUT_PAD, ad, tile, warp, g, t);

        // ---- backward: G = delta . W through the resident image read transposed
        float G[WP / 2];
        wgmma_rs_layer<WP / 2, NOUT_P>(G, ad, wgmma_rs_n_hidden_t,
                                       [&](int ks) { return kmajor_as_mn_desc(s_w + W_OFF_OUT, ks, NOUT_P, SWZ_W); });
#pragma unroll 1
        for (int l = NL - 1; l >= 1; --l) {
            // delta_{l-1} = round(G * act'(z_{l-1})), from h_l (or the stored derivative)
            const u16* stored = STORE_DACT ? dactbuf + (i64)(l - 1) * rows_pad * WIDTH : hbuf + h_off(l, rows_pad);
#pragma unroll
            for (int i = 0; i < WP / 2; i += 2) {
                const int col = out_col(t, i);
                float f0 = 0.f, f1 = 0.f;
                if (col < WIDTH) {
                    const float2 s = unpack_h2(*reinterpret_cast<const u32*>(stored + out_row(tile, warp, g, i) * WIDTH + col));
                    f0 = hidden_grad_from_stored(s.x);
                    f1 = hidden_grad_from_stored(s.y);
                }
                a[i / 2] = pack_h2(G[i] * f0, G[i + 1] * f1);
            }
            store_pairs<WP>(dbuf + d_off(l - 1, rows_pad), WIDTH, a, tile, warp, g, t);
            if (l == 1) break;
            const u32 w_l = s_w + W_OFF1 + (l - 2) * W_HID_STRIDE;  // hidden layer l - 1's weights
            wgmma_rs_layer<WP / 2, WP>(G, a, wgmma_rs_n_hidden_t, [&](int ks) { return kmajor_as_mn_desc(w_l, ks, WP, SWZ_W); });
        }
    }
    // fixed-order reduction: lanes by xor tree, each warp to its own slot
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) loss_sum += __shfl_xor_sync(0xffffffffu, loss_sum, s);
    if (lane == 0) loss_partial[((i64)blockIdx.x * WGT + wg) * 4 + warp] = loss_sum;
}

extern "C" __global__ void __launch_bounds__(128 * WGT, MIN_BLOCKS_T)
wgmma_train_fwd_bwd(const float* __restrict__ x, i64 rows, i64 n_tiles, const unsigned char* __restrict__ wimg,
                    const float* __restrict__ bimg, const float* __restrict__ target, float grad_scale,
                    u16* __restrict__ hbuf, u16* __restrict__ dbuf, u16* __restrict__ dactbuf,
                    double* __restrict__ loss_partial) {
    train_fwd_bwd<false>(x, rows, n_tiles, wimg, bimg, target, grad_scale, hbuf, dbuf, dactbuf, loss_partial, nullptr);
}

// over a held dataset: batch row r is row row_map[r] of x and target
extern "C" __global__ void __launch_bounds__(128 * WGT, MIN_BLOCKS_T)
wgmma_train_fwd_bwd_rows(const float* __restrict__ x, i64 rows, i64 n_tiles, const unsigned char* __restrict__ wimg,
                         const float* __restrict__ bimg, const float* __restrict__ target, float grad_scale,
                         u16* __restrict__ hbuf, u16* __restrict__ dbuf, u16* __restrict__ dactbuf,
                         double* __restrict__ loss_partial, const int* __restrict__ row_map) {
    train_fwd_bwd<true>(x, rows, n_tiles, wimg, bimg, target, grad_scale, hbuf, dbuf, dactbuf, loss_partial, row_map);
}

// ---- weight gradients ---------------------------------------------------------------------
// A block takes 64 rows of dW (fan_out o0 .. o0 + 63) over one chunk of batch rows, 64 rows a
// stage: the stage's delta rows (64 columns of D from o0) and h rows (KP columns of H) land by
// cp.async as 128-byte-swizzled rows (mn_rows_offset), which are the MN-major atoms (64 M or
// N x 8 K) of A = delta^T and B = h: 8 rows of an atom 128 bytes apart, 8-row groups 1024 bytes
// apart (SBO), H's 64-column blocks 64 * 128 bytes apart (LBO). The bias gradient (delta's column sums) is
// added by 64 threads in row order while the products run.
#define WG_STAGE_ROWS 64
#define WG_D_BYTES (WG_STAGE_ROWS * 128)

template <int KP>
__device__ __forceinline__ void wgrad_body(const u16* __restrict__ D, int N, const u16* __restrict__ H, int K,
                                           i64 chunk_rows, i64 rows_pad, float* __restrict__ pw,
                                           float* __restrict__ pb) {
    constexpr int STAGE_BYTES = WG_D_BYTES + KP * 128;
    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    const u32 s0 = smem_addr(smem);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int o0 = blockIdx.y * 64;
    const i64 r_begin = (i64)blockIdx.x * chunk_rows;
    const i64 r_end = min(r_begin + chunk_rows, rows_pad);
    const int n_stages = (int)((r_end - r_begin + WG_STAGE_ROWS - 1) / WG_STAGE_ROWS);

    auto load_stage = [&](int it) {
        if (it < n_stages) {
            const u32 sd = s0 + (it % WG_STAGES) * STAGE_BYTES, sh = sd + WG_D_BYTES;
            const i64 r0 = r_begin + (i64)it * WG_STAGE_ROWS;
            for (int u = tid; u < WG_STAGE_ROWS * 8; u += 128) {
                const int rr = u >> 3, c8 = (u & 7) * 8;
                const bool ok = r0 + rr < r_end && o0 + c8 < N;
                cp_async16(sd + mn_rows_offset(rr, c8, WG_STAGE_ROWS), ok ? D + (r0 + rr) * N + o0 + c8 : D, ok ? 16 : 0);
            }
            for (int u = tid; u < WG_STAGE_ROWS * (KP / 8); u += 128) {
                const int rr = u / (KP / 8), c8 = (u % (KP / 8)) * 8;
                const bool ok = r0 + rr < r_end && c8 < K;
                cp_async16(sh + mn_rows_offset(rr, c8, WG_STAGE_ROWS), ok ? H + (r0 + rr) * K + c8 : H, ok ? 16 : 0);
            }
        }
        cp_async_commit();  // empty past the chunk: the group count stays regular
    };

    float acc[KP / 2];
#pragma unroll
    for (int i = 0; i < KP / 2; ++i) acc[i] = 0.f;
    float bsum = 0.f;
#pragma unroll
    for (int s = 0; s < WG_STAGES - 1; ++s) load_stage(s);
    for (int it = 0; it < n_stages; ++it) {
        cp_async_wait_group<WG_STAGES - 2>();  // stage it's copies (this thread's) are done
        fence_proxy_async();
        __syncthreads();  // everyone's copies landed; stage it - 1 is no longer read
        load_stage(it + WG_STAGES - 1);
        const u32 sd = s0 + (it % WG_STAGES) * STAGE_BYTES, sh = sd + WG_D_BYTES;
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < WG_STAGE_ROWS / 16; ++ks)
            wgmma_tt_wgrad<KP>(acc, mn_rows_desc(sd, ks, WG_STAGE_ROWS), mn_rows_desc(sh, ks, WG_STAGE_ROWS));
        wgmma_commit();
        if (tid < 64) {
            const unsigned char* rowp = smem + (it % WG_STAGES) * STAGE_BYTES;
#pragma unroll 8
            for (int rr = 0; rr < WG_STAGE_ROWS; ++rr)
                bsum += half_bits_to_float(*reinterpret_cast<const u16*>(rowp + mn_rows_offset(rr, tid, WG_STAGE_ROWS)));
        }
        wgmma_wait_all();
#pragma unroll
        for (int i = 0; i < KP / 2; ++i) keep_f(acc[i]);
    }
    cp_async_wait_all();
    float* base = pw + (i64)blockIdx.x * N * K;
#pragma unroll
    for (int i = 0; i < KP / 2; i += 2) {
        const int o = o0 + 16 * warp + g + 8 * ((i >> 1) & 1), k = out_col(t, i);
        if (o < N && k < K) *reinterpret_cast<float2*>(base + (i64)o * K + k) = make_float2(acc[i], acc[i + 1]);
    }
    if (tid < 64 && o0 + tid < N) pb[(i64)blockIdx.x * N + o0 + tid] = bsum;
}

extern "C" __global__ void __launch_bounds__(128) wgmma_wgrad_in(
    const u16* __restrict__ D, int N, const u16* __restrict__ H, int K, i64 chunk_rows, i64 rows_pad,
    float* __restrict__ pw, float* __restrict__ pb) {
    wgrad_body<WG_KP0>(D, N, H, K, chunk_rows, rows_pad, pw, pb);
}

extern "C" __global__ void __launch_bounds__(128) wgmma_wgrad_hid(
    const u16* __restrict__ D, int N, const u16* __restrict__ H, int K, i64 chunk_rows, i64 rows_pad,
    float* __restrict__ pw, float* __restrict__ pb) {
    wgrad_body<WG_KPW>(D, N, H, K, chunk_rows, rows_pad, pw, pb);
}
