// Element-wise kernels around cuBLASLt matmuls (the cuda backend's cublaslt variant).
//
// Activations live feature-major, [features][rows], because cuBLASLt's bias epilogs run the
// bias along the M dimension: layer l is  h_{l+1}^T = act(W_l @ h_l^T + b_l)  with W_l as A.
// The host prepends #defines (NIN NOUT ACT OUT_ACT LOSS HUBER_DELTA STORE_DACT OPT_ADAM LR BETA1
// BETA2 EPS L2REG MOMENTUM) and mlp_common.cuh.

#define TILE 32

// x [rows][NIN] fp32 -> xt [NIN][rows] fp16 (tile transpose: both sides coalesced)
extern "C" __global__ void ew_input(const float* __restrict__ x, i64 rows, u16* __restrict__ xt) {
    __shared__ float tile[TILE][TILE + 1];
    const i64 r0 = (i64)blockIdx.x * TILE;
    const int k0 = blockIdx.y * TILE;
    for (int j = threadIdx.y; j < TILE; j += blockDim.y) {
        const i64 r = r0 + j;
        const int k = k0 + threadIdx.x;
        tile[j][threadIdx.x] = (r < rows && k < NIN) ? x[r * NIN + k] : 0.f;
    }
    __syncthreads();
    for (int j = threadIdx.y; j < TILE; j += blockDim.y) {
        const int k = k0 + j;
        const i64 r = r0 + threadIdx.x;
        if (k < NIN && r < rows) xt[(i64)k * rows + r] = to_half_bits(tile[threadIdx.x][j]);
    }
}

// hidden layer from its fp32 pre-activation zt [width][rows]: h = fp16(act(z)), and the
// derivative where it cannot be read off h (training only)
extern "C" __global__ void ew_hidden(const float* __restrict__ zt, i64 n, u16* __restrict__ h,
                                     u16* __restrict__ dact, int train) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float z = zt[i];
    h[i] = to_half_bits(activate(ACT, z));
    if (STORE_DACT && train) dact[i] = to_half_bits(activation_grad(ACT, z));
}

// output: zt [NOUT][rows] fp32 -> out [rows][NOUT] fp32 after the output activation
extern "C" __global__ void ew_output(const float* __restrict__ zt, i64 rows, float* __restrict__ out) {
    __shared__ float tile[TILE][TILE + 1];
    const i64 r0 = (i64)blockIdx.x * TILE;
    const int c0 = blockIdx.y * TILE;
    for (int j = threadIdx.y; j < TILE; j += blockDim.y) {
        const int c = c0 + j;
        const i64 r = r0 + threadIdx.x;
        tile[j][threadIdx.x] = (c < NOUT && r < rows) ? activate(OUT_ACT, zt[(i64)c * rows + r]) : 0.f;
    }
    __syncthreads();
    for (int j = threadIdx.y; j < TILE; j += blockDim.y) {
        const i64 r = r0 + j;
        const int c = c0 + threadIdx.x;
        if (r < rows && c < NOUT) out[r * NOUT + c] = tile[threadIdx.x][j];
    }
}

// loss: per element value (for a fixed-order sum on the host side) and the output delta
// delta^T [NOUT][rows] = fp16(dloss/dpred * grad_scale * act_out'(z))
extern "C" __global__ void ew_loss(const float* __restrict__ zt, const float* __restrict__ y, i64 rows,
                                   float grad_scale, u16* __restrict__ delta, float* __restrict__ values) {
    __shared__ float ytile[TILE][TILE + 1];
    const i64 r0 = (i64)blockIdx.x * TILE;
    const int c0 = blockIdx.y * TILE;
    for (int j = threadIdx.y; j < TILE; j += blockDim.y) {  // target tile, read row-major
        const i64 r = r0 + j;
        const int c = c0 + threadIdx.x;
        ytile[j][threadIdx.x] = (r < rows && c < NOUT) ? y[r * NOUT + c] : 0.f;
    }
    __syncthreads();
    for (int j = threadIdx.y; j < TILE; j += blockDim.y) {
        const int c = c0 + j;
        const i64 r = r0 + threadIdx.x;
        if (c >= NOUT || r >= rows) continue;
        const float z = zt[(i64)c * rows + r];
        const float p = activate(OUT_ACT, z);
        float lum = 0.f;
#if LOSS == LOSS_REL_L2_LUM
#if NOUT >= 3
        lum = 0.299f * activate(OUT_ACT, zt[r]) + 0.587f * activate(OUT_ACT, zt[rows + r]) +
              0.114f * activate(OUT_ACT, zt[2 * rows + r]);
#elif NOUT == 2
        lum = 0.5f * (fabsf(activate(OUT_ACT, zt[r])) + fabsf(activate(OUT_ACT, zt[rows + r])));
#else
        lum = fabsf(p);
#endif
#endif
        float grad;
        values[(i64)c * rows + r] = loss_term(p, ytile[threadIdx.x][j], lum, &grad);
        delta[(i64)c * rows + r] = to_half_bits(grad * grad_scale * activation_grad(OUT_ACT, z));
    }
}

// hidden delta from the fp32 gradient gt [width][rows]: fp16(g * act'(z)), act' from the stored
// h (ReLU, LeakyReLU, None) or the stored derivative
extern "C" __global__ void ew_backward(const float* __restrict__ gt, const u16* __restrict__ stored, i64 n,
                                       u16* __restrict__ delta) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    delta[i] = to_half_bits(gt[i] * hidden_grad_from_stored(half_bits_to_float(stored[i])));
}

// optimizer step on the fp32 masters of one layer (weights then biases) and refresh of their
// fp16 copies; mode 2 only refreshes the copies
extern "C" __global__ void ew_optimize(int mode, int n_w, int n_b, float* __restrict__ w, float* __restrict__ b,
                                       const float* __restrict__ gw, const float* __restrict__ gb,
                                       float* __restrict__ s1w, float* __restrict__ s1b, float* __restrict__ s2w,
                                       float* __restrict__ s2b, u16* __restrict__ w16, u16* __restrict__ b16,
                                       float lr_t, float inv_scale) {
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
        p -= LR * vn;
#endif
        *param = p;
    }
    if (is_w) w16[j] = to_half_bits(*param);
    else b16[j] = to_half_bits(*param);
}
