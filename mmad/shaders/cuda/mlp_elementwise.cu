// Element-wise kernels around cuBLASLt matmuls (the cuda backend's cublaslt variant).
//
// Layer l is  h_{l+1}^T = act(W_l @ h_l^T + b_l)  with W_l as A, because cuBLASLt's bias epilogs
// run the bias along M. Every activation, pre-activation and delta is stored row-major,
// [rows][features] (the host holds them as (features, rows) arrays in F order): the layout
// cuBLASLt writes its column-major D in, so no matmul result is ever transposed. The host
// prepends #defines (NIN NOUT ACT OUT_ACT LOSS HUBER_DELTA STORE_DACT LOSS_BLOCK LOSS_ITEMS OPT_ADAM
// BETA1 BETA2 EPS L2REG MOMENTUM) and mlp_common.cuh.


// the fp32 input [rows][NIN] to fp16, four values per thread, 16-byte loads where x is aligned
// (CuPy's own astype runs at ~1.1 TB/s on an H100: 1.34 ms for 2^20 x 256)
extern "C" __global__ void ew_half(const float* __restrict__ x, i64 n, u16* __restrict__ out) {
    const i64 i = ((i64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (i >= n) return;
    if (i + 3 < n && (reinterpret_cast<unsigned long long>(x) & 15) == 0) {
        const float4 v = *reinterpret_cast<const float4*>(x + i);
        *reinterpret_cast<uint2*>(out + i) = make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
    } else {
        for (int j = 0; j < 4 && i + j < n; ++j) out[i + j] = to_half_bits(x[i + j]);
    }
}

// hidden layer from its fp32 pre-activation z [rows][width]: h = fp16(act(z)), and the
// derivative where it cannot be read off h (training only); h and dact in the same order as z
extern "C" __global__ void ew_hidden(const float* __restrict__ zt, i64 n, u16* __restrict__ h,
                                     u16* __restrict__ dact, int train) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float z = zt[i];
    h[i] = to_half_bits(activate(ACT, z));
    if (STORE_DACT && train) dact[i] = to_half_bits(activation_grad(ACT, z));
}

// output: z [rows][NOUT] fp32 -> out [rows][NOUT] fp32 after the output activation
extern "C" __global__ void ew_output(const float* __restrict__ zt, i64 n, float* __restrict__ out) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = activate(OUT_ACT, zt[i]);
}

// loss over n = rows * NOUT elements, all [rows][NOUT]: the output layer's fp16 pre-activation z
// (tiny-cuda-nn's loss reads its network's fp16 output too), the output delta = fp16(dloss/dpred *
// grad_scale * act_out'(z)) per element, and per block (LOSS_BLOCK threads, LOSS_ITEMS elements
// each, a block's elements contiguous) the sum of their loss values in a fixed order (each thread's
// items in turn, then the warp's lanes by shuffles, then the warps in turn): repeated steps give the
// same loss bit for bit; the host sums the blocks' partials in float64
__device__ __forceinline__ float loss_element(const u16* __restrict__ zt, const float* __restrict__ y, i64 i,
                                              float grad_scale, u16* __restrict__ delta) {
    const float z = half_bits_to_float(zt[i]);
    const float p = activate(OUT_ACT, z);
    float lum = 0.f;
#if LOSS == LOSS_REL_L2_LUM
    const u16* row = zt + (i / NOUT) * NOUT;
#if NOUT >= 3
    lum = 0.299f * activate(OUT_ACT, half_bits_to_float(row[0])) + 0.587f * activate(OUT_ACT, half_bits_to_float(row[1])) +
          0.114f * activate(OUT_ACT, half_bits_to_float(row[2]));
#elif NOUT == 2
    lum = 0.5f * (fabsf(activate(OUT_ACT, half_bits_to_float(row[0]))) + fabsf(activate(OUT_ACT, half_bits_to_float(row[1]))));
#else
    lum = fabsf(p);
#endif
#endif
    float grad;
    const float value = loss_term(p, y[i], lum, &grad);
    delta[i] = to_half_bits(grad * grad_scale * activation_grad(OUT_ACT, z));
    return value;
}

extern "C" __global__ void ew_loss(const u16* __restrict__ zt, const float* __restrict__ y, i64 n,
                                   float grad_scale, u16* __restrict__ delta, float* __restrict__ partial) {
    __shared__ float warp_sums[LOSS_BLOCK / 32];
    const i64 first = (i64)blockIdx.x * (LOSS_BLOCK * LOSS_ITEMS) + threadIdx.x;
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < LOSS_ITEMS; ++k) {  // a warp's loads of one k are contiguous
        const i64 i = first + (i64)k * LOSS_BLOCK;
        if (i < n) sum += loss_element(zt, y, i, grad_scale, delta);
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = warp_sums[0];
        for (int w = 1; w < LOSS_BLOCK / 32; ++w) total += warp_sums[w];
        partial[blockIdx.x] = total;
    }
}

// hidden delta from the fp32 gradient g [rows][width]: fp16(g * act'(z)), act' from the stored
// h (ReLU, LeakyReLU, None) or the stored derivative, both in the same order as g
extern "C" __global__ void ew_backward(const float* __restrict__ gt, const u16* __restrict__ stored, i64 n,
                                       u16* __restrict__ delta) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    delta[i] = to_half_bits(gt[i] * hidden_grad_from_stored(half_bits_to_float(stored[i])));
}

// optimizer step on the fp32 masters of one layer (weights then biases) and refresh of their
// fp16 copies: W [fan_out][fan_in] as w16 and its transpose [fan_in][fan_out] as w16t; mode 2
// only refreshes the copies
extern "C" __global__ void ew_optimize(int mode, int n_w, int n_b, float* __restrict__ w, float* __restrict__ b,
                                       const float* __restrict__ gw, const float* __restrict__ gb,
                                       float* __restrict__ s1w, float* __restrict__ s1b, float* __restrict__ s2w,
                                       float* __restrict__ s2b, u16* __restrict__ w16, u16* __restrict__ w16t,
                                       u16* __restrict__ b16, int fan_in, float lr_t, float inv_scale) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_w + n_b) return;
    const bool is_w = i < n_w;
    const int j = is_w ? i : i - n_w;
    float* param = is_w ? w + j : b + j;
    if (mode == 0) {
        float grad = (is_w ? gw[j] : gb[j]) * inv_scale;
        float p = *param;
        if (L2REG != 0.f) grad += L2REG * p;
#if OPT_ADAM
        float* m = is_w ? s1w + j : s1b + j;
        float* v = is_w ? s2w + j : s2b + j;
        const float mn = BETA1 * *m + (1.f - BETA1) * grad;
        const float vn = BETA2 * *v + (1.f - BETA2) * (grad * grad);
        *m = mn; *v = vn;
        p -= lr_t * mn / (sqrtf(vn) + EPS);
#else
        float* vel = is_w ? s1w + j : s1b + j;
        const float vn = MOMENTUM * *vel + grad;
        *vel = vn;
        p -= lr_t * vn;
#endif
        *param = p;
    }
    if (is_w) {
        const u16 half = to_half_bits(*param);
        w16[j] = half;
        w16t[(j % fan_in) * (n_w / fan_in) + j / fan_in] = half;
    } else {
        b16[j] = to_half_bits(*param);
    }
}
