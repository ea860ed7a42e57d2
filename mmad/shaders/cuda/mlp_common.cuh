// Helpers shared by mlp_mma.cu and mlp_elementwise.cu: fp16 packing, mma.sync, activations
// (value and derivative, numerics.py's definitions) and the per-element loss.
// Needs ACT (hidden activation) and LOSS / HUBER_DELTA defined before it, and the ACT_* / LOSS_*
// codes (mmad.spec.kernel_code_defines, prepended with them).

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

// ---- small helpers -------------------------------------------------------------------------
__device__ __forceinline__ u32 pack_h2(float lo, float hi) {
    u32 r;  // cvt packs a into the upper half, b into the lower
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float2 unpack_h2(u32 v) {
    float lo, hi;
    asm("{.reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h;}"
        : "=f"(lo), "=f"(hi) : "r"(v));
    return make_float2(lo, hi);
}

__device__ __forceinline__ u16 to_half_bits(float x) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float half_bits_to_float(u16 h) {
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h));
    return r;
}

__device__ __forceinline__ void mma16816(float* c, const u32* a, uint2 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y));
}

__device__ __forceinline__ float sigmoidf_(float z) {
    float e = expf(-fabsf(z));
    return z >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

__device__ __forceinline__ float activate(int act, float z) {
    switch (act) {
        case ACT_RELU: return fmaxf(z, 0.f);
        case ACT_LEAKY: return z > 0.f ? z : z * 0.01f;
        case ACT_SIGMOID: return sigmoidf_(z);
        case ACT_TANH: return tanhf(z);
        case ACT_SILU: return z * sigmoidf_(z);
        case ACT_SOFTPLUS: return fmaxf(z, 0.f) + log1pf(expf(-fabsf(z)));
        case ACT_SQUAREPLUS: return 0.5f * (z + sqrtf(z * z + 4.f));
        case ACT_EXP: return expf(z);
        case ACT_SINE: return sinf(z);
        default: return z;
    }
}

__device__ __forceinline__ float activation_grad(int act, float z) {
    switch (act) {
        case ACT_RELU: return z > 0.f ? 1.f : 0.f;
        case ACT_LEAKY: return z > 0.f ? 1.f : 0.01f;
        case ACT_SIGMOID: { float s = sigmoidf_(z); return s * (1.f - s); }
        case ACT_TANH: { float th = tanhf(z); return 1.f - th * th; }
        case ACT_SILU: { float s = sigmoidf_(z); return s * (1.f + z * (1.f - s)); }
        case ACT_SOFTPLUS: return sigmoidf_(z);
        case ACT_SQUAREPLUS: return 0.5f * (1.f + z / sqrtf(z * z + 4.f));
        case ACT_EXP: return expf(z);
        case ACT_SINE: return cosf(z);
        default: return 1.f;
    }
}

// derivative of the hidden activation from what the forward pass stored: h itself where the
// sign of h decides it (ReLU, LeakyReLU), the stored derivative otherwise
__device__ __forceinline__ float hidden_grad_from_stored(float stored) {
#if ACT == ACT_RELU
    return stored > 0.f ? 1.f : 0.f;
#elif ACT == ACT_LEAKY
    return stored > 0.f ? 1.f : 0.01f;
#elif ACT == ACT_NONE
    return 1.f;
#else
    return stored;
#endif
}

// The encoded input in pair-major fp16 (what mlp_mma.cu's ENCODED_INPUT kernels read): element
// (r, c) of a batch of `rows` rows at half (c / 2 · rows + r) · 2 + c % 2, so the pair of columns
// 2p, 2p + 1 of consecutive rows are consecutive words.
__device__ __forceinline__ i64 pair_major(i64 rows, i64 r, int c) { return ((i64)(c >> 1) * rows + r) * 2 + (c & 1); }

__device__ __forceinline__ float signf_(float d) { return d > 0.f ? 1.f : (d < 0.f ? -1.f : 0.f); }

// LOSS_GIVEN (the backward from an outside gradient, CompiledModel.backward): the training
// kernels' "target" is d loss / d output itself, and the loss they sum is 0
#define LOSS_GIVEN 255

// per-element loss value and d value / d pred (numerics.loss_terms); lum: the row's luminance
__device__ __forceinline__ float loss_term(float p, float y, float lum, float* grad) {
#if LOSS == LOSS_GIVEN
    *grad = y; return 0.f;
#else
    float d = p - y;
#if LOSS == LOSS_L2
    *grad = 2.f * d; return d * d;
#elif LOSS == LOSS_L1
    *grad = signf_(d); return fabsf(d);
#elif LOSS == LOSS_REL_L2
    float n = p * p + 0.01f; *grad = 2.f * d / n; return d * d / n;
#elif LOSS == LOSS_REL_L1
    float n = fabsf(p) + 0.01f; *grad = signf_(d) / n; return fabsf(d) / n;
#elif LOSS == LOSS_REL_L2_LUM
    float n = lum * lum + 0.01f; *grad = 2.f * d / n; return d * d / n;
#elif LOSS == LOSS_MAPE
    float n = fabsf(y) + 0.01f; *grad = signf_(d) / n; return fabsf(d) / n;
#elif LOSS == LOSS_SMAPE
    float n = fabsf(p) + fabsf(y) + 0.01f; *grad = 2.f * signf_(d) / n; return 2.f * fabsf(d) / n;
#else  // Huber
    if (fabsf(d) <= HUBER_DELTA) { *grad = d; return 0.5f * d * d; }
    *grad = HUBER_DELTA * signf_(d); return HUBER_DELTA * (fabsf(d) - 0.5f * HUBER_DELTA);
#endif
#endif
}

