// tiny-cuda-nn's parameter-free encodings (Identity, Frequency, OneBlob, TriangleWave,
// SphericalHarmonics) on the cuda backend: forward into the layouts the MLP kernels read, and
// d loss / d input from d loss / d encoded output (tcnn's *_backward kernels).
//
// The host (mmad/backends/cuda/encodings.py) prepends mlp_common.cuh and, per part k, the
// wrappers enc_forward_k / enc_backward_k: a thread per (row, input dim) of the part (a thread per
// row for SphericalHarmonics), consecutive threads on consecutive rows. The arithmetic is
// mmad/backends/numerics.py's (its float32 mode): Frequency's sin(2^i·π·x) and cos(2^i·π·x) with
// sinpif / cospif (exact range reduction; tcnn's __sinf of x·2^i·π + phase is the same function,
// less precise at high frequencies), OneBlob's quartic kernel over the three wrapped copies, the
// triangle wave's phase-shifted folds, the spherical harmonics' polynomials (generated from
// mmad.backends.encodings.spherical_harmonics, differentiated through Dual3).
//
// Layouts of the encoded output: ENC_PAIRS (pair-major fp16, mlp_common.cuh's pair_major: the
// ENCODED_INPUT kernels' input), ENC_ROWS_F32 / ENC_ROWS_F16 (row-major, `out_cols` a row).
// d loss / d encoded output is row-major fp16 or fp32 (`din_half`), `din_cols` a row, multiplied
// by `inv_scale` (the loss scale undone); d loss / d input is added into dx (fp32, x_cols a row).

#define ENC_PAIRS 0
#define ENC_ROWS_F32 1
#define ENC_ROWS_F16 2
#define ENC_PI 3.14159265358979323846f

__device__ __forceinline__ void enc_store(void* out, int layout, i64 rows, int out_cols, i64 r, int c, float v) {
    if (layout == ENC_PAIRS) reinterpret_cast<u16*>(out)[pair_major(rows, r, c)] = to_half_bits(v);
    else if (layout == ENC_ROWS_F32) reinterpret_cast<float*>(out)[r * out_cols + c] = v;
    else reinterpret_cast<u16*>(out)[r * out_cols + c] = to_half_bits(v);
}

__device__ __forceinline__ float enc_din(const void* din, int din_half, int din_cols, i64 r, int c) {
    return din_half ? half_bits_to_float(__ldg(reinterpret_cast<const u16*>(din) + r * din_cols + c))
                    : __ldg(reinterpret_cast<const float*>(din) + r * din_cols + c);
}

__device__ __forceinline__ float enc_x(const float* __restrict__ x, const int* __restrict__ row_map, int x_cols, i64 r,
                                       int col) {
    return __ldg(x + (row_map ? (i64)row_map[r] : r) * x_cols + col);
}

// ---- OneBlob: the quartic kernel's CDF (clamped like fminf/fmaxf) and density ------------------
__device__ __forceinline__ float quartic_cdf(float v, float n) {
    const float u = v * n, u2 = u * u, u4 = u2 * u2;
    return fmaxf(0.f, fminf(1.f, (15.f / 16.f) * u * (1.f - (2.f / 3.f) * u2 + (1.f / 5.f) * u4) + 0.5f));
}

__device__ __forceinline__ float quartic_density(float v, float n) {
    const float u = v * n, w = fmaxf(1.f - u * u, 0.f);
    return (15.f / 16.f) * w * w * n;
}

__device__ __forceinline__ float wrapped_cdf(float b, float x, float n) {
    const float u = b - x;
    return quartic_cdf(u, n) + quartic_cdf(u - 1.f, n) + quartic_cdf(u + 1.f, n);
}

__device__ __forceinline__ float wrapped_density(float b, float x, float n) {
    const float u = b - x;
    return quartic_density(u, n) + quartic_density(u - 1.f, n) + quartic_density(u + 1.f, n);
}

// bin k holds C(k/n) .. C((k+1)/n); the last bin's right value is C(0) + 1 (tcnn's wrap)
template <int BINS>
__device__ __forceinline__ void one_blob_forward(float x, void* out, int layout, i64 rows, int out_cols, i64 r, int c0) {
    const float n = (float)BINS;
    const float first = wrapped_cdf(0.f, x, n);
    float left = first;
#pragma unroll 4
    for (int k = 0; k < BINS; ++k) {
        const float right = k + 1 < BINS ? wrapped_cdf((float)(k + 1) / n, x, n) : first + 1.f;
        enc_store(out, layout, rows, out_cols, r, c0 + k, right - left);
        left = right;
    }
}

// tcnn's kernel_one_blob_backward: d bin_k / dx = K(k/n − x) − K((k+1)/n − x), up to boundary 1
template <int BINS>
__device__ __forceinline__ float one_blob_backward(float x, const void* din, int din_half, int din_cols, i64 r, int c0) {
    const float n = (float)BINS;
    float left = wrapped_density(0.f, x, n), sum = 0.f;
#pragma unroll 4
    for (int k = 0; k < BINS; ++k) {
        const float right = wrapped_density((float)(k + 1) / n, x, n);
        sum = fmaf(enc_din(din, din_half, din_cols, r, c0 + k), left - right, sum);
        left = right;
    }
    return sum;
}

// ---- Frequency: [frequency][sin, cos] per dim -------------------------------------------------------
template <int NF>
__device__ __forceinline__ void frequency_forward(float x, void* out, int layout, i64 rows, int out_cols, i64 r, int c0) {
#pragma unroll
    for (int i = 0; i < NF; ++i) {
        float s, c;
        sincospif(scalbnf(x, i), &s, &c);
        enc_store(out, layout, rows, out_cols, r, c0 + 2 * i, s);
        enc_store(out, layout, rows, out_cols, r, c0 + 2 * i + 1, c);
    }
}

template <int NF>
__device__ __forceinline__ float frequency_backward(float x, const void* din, int din_half, int din_cols, i64 r, int c0) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < NF; ++i) {
        float s, c;
        sincospif(scalbnf(x, i), &s, &c);
        const float f = scalbnf(ENC_PI, i);  // d sin(f·x) = f·cos, d cos(f·x) = −f·sin
        sum = fmaf(enc_din(din, din_half, din_cols, r, c0 + 2 * i), f * c, sum);
        sum = fmaf(enc_din(din, din_half, din_cols, r, c0 + 2 * i + 1), -f * s, sum);
    }
    return sum;
}

// ---- TriangleWave: v = x·2^(k−1) + k/4, 4·|v − floor(v) − 1/2| − 1 --------------------------------
template <int NF>
__device__ __forceinline__ void triangle_forward(float x, void* out, int layout, i64 rows, int out_cols, i64 r, int c0) {
#pragma unroll
    for (int k = 0; k < NF; ++k) {
        const float v = scalbnf(x, k - 1) + (float)k * 0.25f;
        enc_store(out, layout, rows, out_cols, r, c0 + k, fabsf(v - floorf(v) - 0.5f) * 4.f - 1.f);
    }
}

// tcnn's dy_dx: ±2^(k+1), negative where floor(2v) is even
template <int NF>
__device__ __forceinline__ float triangle_backward(float x, const void* din, int din_half, int din_cols, i64 r, int c0) {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < NF; ++k) {
        const float v = scalbnf(x, k - 1) + (float)k * 0.25f;
        const float slope = scalbnf((int)floorf(v * 2.f) % 2 == 0 ? -1.f : 1.f, k + 1);
        sum = fmaf(enc_din(din, din_half, din_cols, r, c0 + k), slope, sum);
    }
    return sum;
}

// ---- SphericalHarmonics: the polynomials on Dual3 give their gradient -------------------------------
struct Dual3 {
    float v, d0, d1, d2;  // value, d / d each of the three direction components
};
__device__ __forceinline__ Dual3 dual(float c) { return {c, 0.f, 0.f, 0.f}; }
__device__ __forceinline__ Dual3 operator+(Dual3 a, Dual3 b) { return {a.v + b.v, a.d0 + b.d0, a.d1 + b.d1, a.d2 + b.d2}; }
__device__ __forceinline__ Dual3 operator-(Dual3 a, Dual3 b) { return {a.v - b.v, a.d0 - b.d0, a.d1 - b.d1, a.d2 - b.d2}; }
__device__ __forceinline__ Dual3 operator-(Dual3 a) { return {-a.v, -a.d0, -a.d1, -a.d2}; }
__device__ __forceinline__ Dual3 operator*(Dual3 a, Dual3 b) {
    return {a.v * b.v, a.d0 * b.v + a.v * b.d0, a.d1 * b.v + a.v * b.d1, a.d2 * b.v + a.v * b.d2};
}
__device__ __forceinline__ Dual3 operator+(Dual3 a, float b) { return {a.v + b, a.d0, a.d1, a.d2}; }
__device__ __forceinline__ Dual3 operator+(float b, Dual3 a) { return a + b; }
__device__ __forceinline__ Dual3 operator-(Dual3 a, float b) { return {a.v - b, a.d0, a.d1, a.d2}; }
__device__ __forceinline__ Dual3 operator-(float b, Dual3 a) { return {b - a.v, -a.d0, -a.d1, -a.d2}; }
__device__ __forceinline__ Dual3 operator*(Dual3 a, float b) { return {a.v * b, a.d0 * b, a.d1 * b, a.d2 * b}; }
__device__ __forceinline__ Dual3 operator*(float b, Dual3 a) { return a * b; }
template <typename T> __device__ __forceinline__ T sh_const(float c);
template <> __device__ __forceinline__ float sh_const<float>(float c) { return c; }
template <> __device__ __forceinline__ Dual3 sh_const<Dual3>(float c) { return dual(c); }
