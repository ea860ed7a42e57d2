// Fused MLP forward on Hopper warpgroup MMA (wgmma, sm_90a): fp16 x fp16 -> fp32.
//
// The host (backends/cuda.py, WgmmaPlan) prepends the specialisation as #defines, then
// mlp_common.cuh, wgmma_layout.cuh and the generated wgmma wrappers
// (wgmma_ss_n_hidden: m64nWPk16, A and B from shared memory; wgmma_rs_n_hidden and
// wgmma_rs_n_out: m64nWPk16 / m64nNOUT_Pk16 with A from registers):
//   NIN KIN_P SWZ_IN    encoded input dims, padded to a power of two >= 16, its swizzle bytes
//   WP SWZ_W NHID       hidden width padded to a power of two, its swizzle bytes, hidden layers
//   NOUT NOUT_P         output dims, padded to a power of two >= 8
//   ACT OUT_ACT         activation codes (mlp_common.cuh)
//   W_RESIDENT          1: every layer's weights stay in shared memory for the whole launch;
//                       0: one layer at a time is copied into one stage before its products
//   INPUT_STAGED        1: the next X_STAGES tiles' fp32 inputs are prefetched into shared memory
//                       by cp.async while this tile computes (a ring of X_STAGES staging tiles
//                       per warpgroup); 0: read from global when converted
//   W_BYTES0 W_OFF1 W_HID_STRIDE W_OFF_OUT W_TOTAL_BYTES   weight image sizes/offsets (bytes)
//   B_TOTAL             floats in the bias image (layer l at l * WP, the output at NHID * WP)
//   WGS                 warpgroups per block (they share the resident weights; 1 when streamed)
//   MIN_BLOCKS          blocks per SM the register allocation must allow (__launch_bounds__)
//   SM_A_OFF A_BYTES SM_B_OFF SM_X_OFF X_BYTES   shared-memory sections (bytes from a
//                       1024-aligned base): weights, WGS input A tiles, biases, WGS x X_STAGES
//                       staging tiles
//
// Each warpgroup (128 threads) computes 64-row tiles, persistent over the grid; warpgroups of
// one block meet only at the start (weights and biases), then sync on their own named barrier.
// Weights: the host packs each layer's W (N = fan_out rows, K = fan_in cols, zero padded) into
// the K-major swizzled image wgmma's B descriptor reads (layouts.wgmma_smem_operand); the
// device gathers fp16 copies of the fp32 master weights through that map (wgmma_pack).
// Layer 0 takes A (the fp16-rounded input tile) from shared memory in the same K-major layout;
// later layers take A from registers: the fp32 accumulator of m64nNk16, after bias and
// activation, packed as cvt.rn.f16x2.f32(d[8s+2j+1], d[8s+2j]) is register j of k16 slice s
// (layouts.register_permutation(wgmma_accumulator(N), wgmma_a_registers()) is the identity).
// Accumulator element i of thread (warp w, lane = 4g + t): row 16w + g + 8 * ((i >> 1) & 1),
// column 2t + (i & 1) + 8 * (i >> 2).

#define NL (NHID + 1)

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// every committed group but the newest N complete
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
// generic-proxy writes (st.shared, cp.async) become visible to wgmma (the async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// the compiler must neither read accumulators nor reuse A registers before wgmma completes
__device__ __forceinline__ void keep_f(float& v) { asm volatile("" : "+f"(v) :: "memory"); }
__device__ __forceinline__ void keep_r(u32& v) { asm volatile("" : "+r"(v) :: "memory"); }

// bytes [0, n) of global src -> shared dst (both 16-byte aligned, n a multiple of 16), by the block
__device__ __forceinline__ void copy_async(u32 dst, const unsigned char* src, int n) {
    for (int i = threadIdx.x * 16; i < n; i += blockDim.x * 16) cp_async16(dst + i, src + i, 16);
}

// the 128 threads of this thread's warpgroup, in a block of N_WG (named barrier 1 + warpgroup)
// (constant ids: a register id makes ptxas reserve all 16 barriers)
template <int N_WG>
__device__ __forceinline__ void wg_sync_of() {
    const int wg = threadIdx.x >> 7;
    if (N_WG == 1 || wg == 0) asm volatile("bar.sync 1, 128;" ::: "memory");
    else if (N_WG == 2 || wg == 1) asm volatile("bar.sync 2, 128;" ::: "memory");
    else if (N_WG == 3 || wg == 2) asm volatile("bar.sync 3, 128;" ::: "memory");
    else asm volatile("bar.sync 4, 128;" ::: "memory");
}
__device__ __forceinline__ void wg_sync() { wg_sync_of<WGS>(); }

// fp32 input rows [row0, row0 + 64) (contiguous: 64 * NIN floats) -> staging, zero beyond rows
__device__ __forceinline__ void stage_input(float* staging, const float* __restrict__ x, i64 rows, i64 tile) {
    const i64 first = tile * 64 * NIN, end = rows * NIN;
    const u32 dst = smem_addr(staging);
    for (int i = (threadIdx.x & 127) * 4; i < 64 * NIN; i += 128 * 4) {
        const i64 e = first + i;
        const i64 left = end - e;
        const int bytes = left >= 4 ? 16 : (left > 0 ? (int)left * 4 : 0);
        cp_async16(dst + i * 4, x + (bytes ? e : 0), bytes);  // bytes < 16: the rest is zero-filled
    }
}

// 64 x NIN fp32 (row-major at src, elements >= limit read as 0) -> fp16 A tile, K-major swizzled
__device__ __forceinline__ void convert_input(const float* src, i64 limit, unsigned char* a_tile) {
    constexpr int CHUNKS = KIN_P / 8;  // 16-byte units per row
    for (int c = threadIdx.x & 127; c < 64 * CHUNKS; c += 128) {
        const int r = c / CHUNKS, k0 = (c % CHUNKS) * 8;
        float v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int e = r * NIN + k0 + j;
            v[j] = (k0 + j < NIN && e < limit) ? src[e] : 0.f;
        }
        const uint4 h = make_uint4(pack_h2(v[0], v[1]), pack_h2(v[2], v[3]), pack_h2(v[4], v[5]), pack_h2(v[6], v[7]));
        *reinterpret_cast<uint4*>(a_tile + kmajor_offset(r, k0, 64, SWZ_IN)) = h;
    }
}

// bias + hidden activation on an m64nWP accumulator, rounded into the next layer's A registers
__device__ __forceinline__ void hidden_epilogue(const float* d, u32* a, const float* bias, int t) {
#pragma unroll
    for (int s = 0; s < WP / 16; ++s)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int i = 8 * s + 2 * j;
            const float2 b = *reinterpret_cast<const float2*>(bias + 2 * t + 8 * (i >> 2));
            a[4 * s + j] = pack_h2(activate(ACT, d[i] + b.x), activate(ACT, d[i + 1] + b.y));
        }
}

// one layer's products with A from registers: d (N accumulators a thread: N_D of them) =
// sum over the K / 16 steps ks of mma(d, A registers of step ks, desc(ks)), waited for; d and
// the A registers stay put for the compiler until then
template <int N_D, int K, class Mma, class Desc>
__device__ __forceinline__ void wgmma_rs_layer(float* d, u32* a, Mma mma, Desc desc) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) mma(d, a + 4 * ks, desc(ks), ks > 0);
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int i = 0; i < N_D; ++i) keep_f(d[i]);
#pragma unroll
    for (int i = 0; i < K / 4; ++i) keep_r(a[i]);
}

// layer 0's products, A (the 64-row input tile at s_a) and B (its weights at s_w) from shared
// memory, waited for
__device__ __forceinline__ void wgmma_layer0(float* d, u32 s_a, u32 s_w) {
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KIN_P / 16; ++ks)
        wgmma_ss_n_hidden(d, kmajor_desc(s_a, ks, 64, SWZ_IN), kmajor_desc(s_w, ks, WP, SWZ_IN), ks > 0);
    wgmma_commit();
    wgmma_wait_all();
#pragma unroll
    for (int i = 0; i < WP / 2; ++i) keep_f(d[i]);
}

// streamed weights (W_RESIDENT 0, one warpgroup): the stage at s_w takes the next layer's n bytes
// once every warp's wgmma reads of it are complete, and is visible to wgmma when this returns
__device__ __forceinline__ void refill_stage(u32 s_w, const unsigned char* src, int n) {
    wg_sync();
    copy_async(s_w, src, n);
    cp_async_commit(); cp_async_wait_all(); fence_proxy_async(); wg_sync();
}

// The layers of one 64-row tile whose fp16 input is the K-major A tile at s_a: layer 0 with A
// and B from shared memory, then hidden layers and the output layer with A from registers; o
// gets the output layer's accumulator (no bias yet). after_layer0() runs once layer 0's
// products are complete (the A tile is free from then on). Streamed weights (W_RESIDENT 0)
// refill the one stage at s_w from wimg before each layer.
template <class AfterLayer0>
__device__ __forceinline__ void mlp_layers(u32 s_a, u32 s_w, const unsigned char* __restrict__ wimg,
                                           const float* bias_s, int t, float* o, AfterLayer0 after_layer0) {
    float d[WP / 2];
    u32 a[WP / 4];
    wgmma_layer0(d, s_a, s_w);
    after_layer0();
    hidden_epilogue(d, a, bias_s, t);

    // hidden layers 1 .. NHID-1: A from registers
#pragma unroll 1
    for (int l = 1; l < NHID; ++l) {
        u32 w_l = s_w + W_OFF1 + (l - 1) * W_HID_STRIDE;
        if (!W_RESIDENT) {
            refill_stage(s_w, wimg + W_OFF1 + (l - 1) * W_HID_STRIDE, WP * WP * 2);
            w_l = s_w;
        }
        wgmma_rs_layer<WP / 2, WP>(d, a, wgmma_rs_n_hidden, [&](int ks) { return kmajor_desc(w_l, ks, WP, SWZ_W); });
        hidden_epilogue(d, a, bias_s + l * WP, t);
    }

    // output layer, A from registers
    u32 w_o = s_w + W_OFF_OUT;
    if (!W_RESIDENT) {
        refill_stage(s_w, wimg + W_OFF_OUT, NOUT_P * WP * 2);
        w_o = s_w;
    }
    wgmma_rs_layer<NOUT_P / 2, WP>(o, a, wgmma_rs_n_out, [&](int ks) { return kmajor_desc(w_o, ks, NOUT_P, SWZ_W); });
}

// the output row and column of this thread's accumulator pair (o[i], o[i + 1]), i even
__device__ __forceinline__ i64 out_row(i64 tile, int warp, int g, int i) { return tile * 64 + 16 * warp + g + 8 * ((i >> 1) & 1); }
__device__ __forceinline__ int out_col(int t, int i) { return 2 * t + 8 * (i >> 2); }

#ifndef TRAIN_MODULE  // the training module (mlp_wgmma_train.cu) shares the helpers above
// an output pair (columns col, col + 1) in the output's precision; an odd NOUT's last pair is one value
__device__ __forceinline__ void store_pair(float* dst, int col, float p0, float p1) {
#if NOUT % 2 == 0
    *reinterpret_cast<float2*>(dst) = make_float2(p0, p1);
#else
    dst[0] = p0;
    if (col + 1 < NOUT) dst[1] = p1;
#endif
}
__device__ __forceinline__ void store_pair(u16* dst, int col, float p0, float p1) {
#if NOUT % 2 == 0
    *reinterpret_cast<u32*>(dst) = pack_h2(p0, p1);
#else
    dst[0] = to_half_bits(p0);
    if (col + 1 < NOUT) dst[1] = to_half_bits(p1);
#endif
}

// the output layer's accumulator o of one tile: bias, output activation, stores of its live rows
template <class T>
__device__ __forceinline__ void store_outputs(T* __restrict__ out, const float* o, const float* bias_o, i64 rows,
                                              i64 tile, int warp, int g, int t) {
#pragma unroll
    for (int i = 0; i < NOUT_P / 2; i += 2) {
        const int col = out_col(t, i);
        const i64 r = out_row(tile, warp, g, i);
        if (r >= rows || col >= NOUT) continue;
        const float2 b = *reinterpret_cast<const float2*>(bias_o + col);
        store_pair(out + r * NOUT + col, col, activate(OUT_ACT, o[i] + b.x), activate(OUT_ACT, o[i + 1] + b.y));
    }
}

extern "C" __global__ void __launch_bounds__(128 * WGS, MIN_BLOCKS)
wgmma_forward(const float* __restrict__ x, i64 rows, i64 n_tiles, float* __restrict__ out,
              const unsigned char* __restrict__ wimg, const float* __restrict__ bimg) {
    extern __shared__ unsigned char smem_raw[];
    // swizzle atoms repeat every 1024 bytes: the sections start on a 1024-byte boundary
    const u32 raw = smem_addr(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    const int wg = threadIdx.x >> 7;
    const u32 s_w = smem_addr(smem), s_a = s_w + SM_A_OFF + wg * A_BYTES;
    unsigned char* a_tile = smem + SM_A_OFF + wg * A_BYTES;
    float* bias_s = reinterpret_cast<float*>(smem + SM_B_OFF);
    // staging tile s of this warpgroup: the input of its (s mod X_STAGES)-th tile
    float* const staging = reinterpret_cast<float*>(smem + SM_X_OFF + wg * X_STAGES * X_BYTES);
    constexpr int X_FLOATS = X_BYTES / 4;
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 tile_step = (i64)gridDim.x * WGS;

    for (int i = threadIdx.x; i < B_TOTAL; i += blockDim.x) bias_s[i] = bimg[i];
    if (W_RESIDENT) copy_async(s_w, wimg, W_TOTAL_BYTES);
    i64 tile = (i64)blockIdx.x * WGS + wg;
    if (INPUT_STAGED && tile < n_tiles) stage_input(staging, x, rows, tile);
    cp_async_commit();
    cp_async_wait_all();
    fence_proxy_async();  // resident weights (cp.async) are read by wgmma
    __syncthreads();      // biases and weights visible to every warpgroup
    // the ring's other tiles, one cp.async group each (empty groups keep the count regular)
#pragma unroll
    for (int s = 1; s < X_STAGES; ++s) {
        if (INPUT_STAGED && tile + s * tile_step < n_tiles)
            stage_input(staging + s * X_FLOATS, x, rows, tile + s * tile_step);
        cp_async_commit();
    }

    for (int it = 0; tile < n_tiles; tile += tile_step, ++it) {
        float* const staged = staging + (it % X_STAGES) * X_FLOATS;
        cp_async_wait_group<X_STAGES - 1>();  // this tile's group is done; later tiles' may still fly
        wg_sync();  // staged input visible; this warpgroup's reads of the last tile are done
        if (INPUT_STAGED) convert_input(staged, 64 * NIN, a_tile);
        else convert_input(x + tile * 64 * NIN, rows * NIN - tile * 64 * NIN, a_tile);
        if (!W_RESIDENT) { copy_async(s_w, wimg, W_BYTES0); cp_async_commit(); cp_async_wait_all(); }
        fence_proxy_async();  // A tile (st.shared) and streamed weights (cp.async) are read by wgmma next
        wg_sync();
        // this staging tile is free: the tile X_STAGES ahead goes into it (always one group)
        if (INPUT_STAGED && tile + X_STAGES * tile_step < n_tiles)
            stage_input(staged, x, rows, tile + X_STAGES * tile_step);
        cp_async_commit();

        float o[NOUT_P / 2];
        mlp_layers(s_a, s_w, wimg, bias_s, t, o, [] {});
        store_outputs(out, o, bias_s + NHID * WP, rows, tile, warp, g, t);
    }
    cp_async_wait_all();  // no copy may still target shared memory when the block exits
}

#if HALF_IO
// fp16 input rows [64 tile, 64 tile + 64) -> the K-major A tile at a_tile (shared address
// s_tile), zero past the rows and past NIN. Rows of a multiple of 8 halves go by cp.async in
// 16-byte units straight into their swizzled place (a unit never straddles a swizzle atom);
// other rows element by element (x is then not 16-byte aligned per row).
__device__ __forceinline__ void stage_input_half(u32 s_tile, unsigned char* a_tile, const u16* __restrict__ x,
                                                 i64 rows, i64 tile) {
    constexpr int CHUNKS = KIN_P / 8;  // 16-byte units per row
    for (int c = threadIdx.x & 127; c < 64 * CHUNKS; c += 128) {
        const int r = c / CHUNKS, k0 = (c % CHUNKS) * 8;
        const i64 row = tile * 64 + r;
        const u32 offset = kmajor_offset(r, k0, 64, SWZ_IN);
#if NIN % 8 == 0
        const bool live = row < rows && k0 < NIN;
        cp_async16(s_tile + offset, live ? x + row * NIN + k0 : x, live ? 16 : 0);
#else
        u16 v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = (row < rows && k0 + j < NIN) ? x[row * NIN + k0 + j] : (u16)0;
        *reinterpret_cast<uint4*>(a_tile + offset) = make_uint4(v[0] | (u32)v[1] << 16, v[2] | (u32)v[3] << 16,
                                                               v[4] | (u32)v[5] << 16, v[6] | (u32)v[7] << 16);
#endif
    }
}

// fp16 in, fp16 out: each warpgroup keeps a ring of H_STAGES input A tiles filled by cp.async
// (its next H_STAGES - 1 tiles in flight while one computes); layer 0 reads its slot directly.
// Resident weights only (the plan offers this kernel where they fit).
extern "C" __global__ void __launch_bounds__(128 * WGH, MIN_BLOCKS_H)
wgmma_forward_half(const u16* __restrict__ x, i64 rows, i64 n_tiles, u16* __restrict__ out,
                   const unsigned char* __restrict__ wimg, const float* __restrict__ bimg) {
    extern __shared__ unsigned char smem_raw[];
    const u32 raw = smem_addr(smem_raw);
    unsigned char* smem = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    const int wg = threadIdx.x >> 7;
    const u32 s_w = smem_addr(smem);
    unsigned char* ring = smem + SMH_RING_OFF + wg * H_STAGES * A_BYTES;
    const u32 s_ring = smem_addr(ring);
    float* bias_s = reinterpret_cast<float*>(smem + SMH_B_OFF);
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const i64 tile_step = (i64)gridDim.x * WGH;

    for (int i = threadIdx.x; i < B_TOTAL; i += blockDim.x) bias_s[i] = bimg[i];
    copy_async(s_w, wimg, W_TOTAL_BYTES);
    i64 tile = (i64)blockIdx.x * WGH + wg;
    // slot s holds the warpgroup's tiles it with it % H_STAGES == s; one cp.async group per fill
    // (empty groups keep the count regular); the weights travel in the first
#pragma unroll
    for (int s = 0; s < H_STAGES; ++s) {
        if (tile + s * tile_step < n_tiles)
            stage_input_half(s_ring + s * A_BYTES, ring + s * A_BYTES, x, rows, tile + s * tile_step);
        cp_async_commit();
    }
    cp_async_wait_group<H_STAGES - 1>();
    fence_proxy_async();  // resident weights (cp.async) are read by wgmma
    __syncthreads();      // biases and weights visible to every warpgroup

    for (int it = 0; tile < n_tiles; tile += tile_step, ++it) {
        const int slot = it % H_STAGES;
        cp_async_wait_group<H_STAGES - 1>();  // this tile's fill is done; later tiles' may still fly
        fence_proxy_async();  // its cp.async (and st.shared) writes are read by wgmma next
        wg_sync_of<WGH>();
        float o[NOUT_P / 2];
        mlp_layers(s_ring + slot * A_BYTES, s_w, wimg, bias_s, t, o, [&] {
            // every warp's layer-0 products are done before the slot takes the tile H_STAGES ahead
            wg_sync_of<WGH>();
            if (tile + H_STAGES * tile_step < n_tiles)
                stage_input_half(s_ring + slot * A_BYTES, ring + slot * A_BYTES, x, rows, tile + H_STAGES * tile_step);
            cp_async_commit();
        });
        store_outputs(out, o, bias_s + NHID * WP, rows, tile, warp, g, t);
    }
    cp_async_wait_all();  // no copy may still target shared memory when the block exits
}
#endif

#endif  // TRAIN_MODULE

// fp16 weight image from the fp32 master weights through the host's map (-1: zero padding)
extern "C" __global__ void wgmma_pack(const float* __restrict__ master, const int* __restrict__ src, u16* __restrict__ image,
                                      int n, const float* __restrict__ b_master, const int* __restrict__ b_src,
                                      float* __restrict__ b_image, int n_b) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) image[i] = src[i] < 0 ? (u16)0 : to_half_bits(master[src[i]]);
    if (i < n_b) b_image[i] = b_src[i] < 0 ? 0.f : b_master[b_src[i]];
}
