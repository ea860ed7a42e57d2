// Shared by every mmad GLSL kernel: fp16 rounding, activations, losses.
// The host prepends #defines for the model's padded shapes (see backends/vulkan.py).
// Activation and loss choices are specialization constants on GPUs (the switches fold away
// when the pipeline is created); a value of -1 means "read the push constant" instead, which
// software devices use so that models differing only in them share one pipeline (lavapipe
// spends seconds of LLVM time per pipeline). Kernels that use HIDDEN_ACT / OUTPUT_ACT /
// LOSS_ID declare pc.hidden_act / pc.output_act / pc.loss_id in their push constants.

layout(constant_id = 0) const int HIDDEN_ACT_SPEC = -1;
layout(constant_id = 1) const int OUTPUT_ACT_SPEC = -1;
layout(constant_id = 2) const int LOSS_ID_SPEC = -1;
#define HIDDEN_ACT (HIDDEN_ACT_SPEC >= 0 ? HIDDEN_ACT_SPEC : pc.hidden_act)
#define OUTPUT_ACT (OUTPUT_ACT_SPEC >= 0 ? OUTPUT_ACT_SPEC : pc.output_act)
#define LOSS_ID (LOSS_ID_SPEC >= 0 ? LOSS_ID_SPEC : pc.loss_id)

layout(constant_id = 3) const float LOSS_SCALE = 128.0;
layout(constant_id = 5) const int ROUND_FP16 = 1;

// ACT_* and LOSS_* codes: mmad.spec.kernel_code_defines, in the header placed before this file

// Round an fp32 value to the nearest fp16 value (ties to even), kept in fp32 storage
// (ROUND_FP16 = 0: no rounding, precision fp32). Integer arithmetic, the same on every
// driver: packHalf2x16's rounding mode is implementation-defined, and NVIDIA's compiler can
// drop an unpackHalf2x16(packHalf2x16(x)) round trip altogether (no rounding at all).
// Branch-free (every case computed, then selected). On NVIDIA, r16 on coopmat accumulator
// elements (branchy or not) cost 256 B of local memory and ~5x the forward's time against
// letting the fp16 conversion round: see pre_f16 below.
float round_f16(float x) {
    uint u = floatBitsToUint(x);
    uint a = u & 0x7fffffffu;
    uint normal = (a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u;           // 10 mantissa bits kept
    uint sub = floatBitsToUint(roundEven(uintBitsToFloat(a) * 16777216.0) * (1.0 / 16777216.0));
    uint r = a < 0x38800000u ? sub                                          // fp16 subnormal range
           : a < 0x477ff000u ? normal
           : a < 0x7f800000u ? 0x7f800000u                                  // >= 65520 -> Inf
           : a;                                                             // Inf, NaN
    return uintBitsToFloat((u ^ a) | r);
}
float r16(float x) { return ROUND_FP16 == 0 ? x : round_f16(x); }
vec4 r16(vec4 v) { return vec4(r16(v.x), r16(v.y), r16(v.z), r16(v.w)); }

// fp16 device arrays (a VulkanArray of dtype float16): the forward's input rows (INPUT_F16) and its
// output (OUTPUT_F16) as fp16, 4 halves in a uvec2, so that no 16-bit storage feature is needed;
// 0: fp32 arrays. Unpacking is exact; packing takes values already rounded (round_f16), so
// packHalf2x16's implementation-defined rounding has nothing left to round.
layout(constant_id = 17) const int INPUT_F16 = 0;
layout(constant_id = 18) const int OUTPUT_F16 = 0;
vec4 unpack_halves(uvec2 h) { return vec4(unpackHalf2x16(h.x), unpackHalf2x16(h.y)); }
uvec2 pack_halves(vec4 v) {
    return uvec2(packHalf2x16(vec2(round_f16(v.x), round_f16(v.y))), packHalf2x16(vec2(round_f16(v.z), round_f16(v.w))));
}

// 1 where the device's own fp32 -> fp16 conversion was measured to round to nearest even
// (fp16_conversion_is_rne in backends/vulkan.py): a value about to be converted to fp16 then
// needs no r16 first, which saves ~15 ALU operations per element in the coopmat kernels.
layout(constant_id = 13) const int CONVERT_RNE = 0;
// x ready for a float16_t conversion that must round to nearest even
float pre_f16(float x) { return CONVERT_RNE == 1 ? x : r16(x); }
vec4 pre_f16(vec4 v) { return CONVERT_RNE == 1 ? v : r16(v); }

float sigmoid_stable(float z) {
    float e = exp(-abs(z));
    return z >= 0.0 ? 1.0 / (1.0 + e) : e / (1.0 + e);
}

float activate(int id, float z) {
    switch (id) {
    case ACT_RELU: return max(z, 0.0);
    case ACT_LEAKY: return z > 0.0 ? z : z * 0.01;
    case ACT_SIGMOID: return sigmoid_stable(z);
    case ACT_TANH: { float t = exp(-2.0 * abs(z)); return sign(z) * (1.0 - t) / (1.0 + t); }
    case ACT_SILU: return z * sigmoid_stable(z);
    case ACT_SOFTPLUS: return max(z, 0.0) + log(1.0 + exp(-abs(z)));
    case ACT_SQUAREPLUS: return 0.5 * (z + sqrt(z * z + 4.0));
    case ACT_EXP: return exp(z);
    case ACT_SINE: return sin(z);
    default: return z;
    }
}

float activation_grad(int id, float z) {
    switch (id) {
    case ACT_RELU: return z > 0.0 ? 1.0 : 0.0;
    case ACT_LEAKY: return z > 0.0 ? 1.0 : 0.01;
    case ACT_SIGMOID: { float s = sigmoid_stable(z); return s * (1.0 - s); }
    case ACT_TANH: { float t = exp(-2.0 * abs(z)); float th = (1.0 - t) / (1.0 + t); return 1.0 - th * th; }
    case ACT_SILU: { float s = sigmoid_stable(z); return s * (1.0 + z * (1.0 - s)); }
    case ACT_SOFTPLUS: return sigmoid_stable(z);
    case ACT_SQUAREPLUS: return 0.5 * (1.0 + z / sqrt(z * z + 4.0));
    case ACT_EXP: return exp(z);
    case ACT_SINE: return cos(z);
    default: return 1.0;
    }
}

// For None, ReLU and LeakyReLU act'(z) depends only on whether z > 0, which the fp16 activation
// alone loses where 0 < z < 2^-25 (it rounds to 0). The coopmat kernels store h = act(z) with
// its sign bit set where z <= 0 (or NaN) instead of storing z: the value is unchanged but for a
// +0 becoming -0, which no product or sum tells apart. Bit operations, not a select of -0.0:
// Vulkan does not require arithmetic to keep the sign of a zero.
float flag_nonpositive(float h, float z) {
    return uintBitsToFloat(floatBitsToUint(h) | (z > 0.0 ? 0u : 0x80000000u));
}
// act'(z) of those activations from the flagged activation (-1 and 1 stand for z's side of 0)
float activation_grad_flagged(int id, float h) {
    return activation_grad(id, floatBitsToUint(h) >= 0x80000000u ? -1.0 : 1.0);
}

vec4 activate4(int id, vec4 z) {
    return vec4(activate(id, z.x), activate(id, z.y), activate(id, z.z), activate(id, z.w));
}
vec4 activation_grad4(int id, vec4 z) {
    return vec4(activation_grad(id, z.x), activation_grad(id, z.y), activation_grad(id, z.z), activation_grad(id, z.w));
}

// loss ids: the order of mmad.spec.LOSSES
#define LOSS_EPSILON 0.01

// Per-element loss value (x) and d value / d pred (y), tiny-cuda-nn's definitions
// (relative losses hold their normaliser constant); lum is the row's luminance.
vec2 loss_term(int loss_id, float huber_delta, float pred, float target, float lum) {
    float d = pred - target;
    float s = sign(d);
    switch (loss_id) {
    case LOSS_L1: return vec2(abs(d), s);
    case LOSS_REL_L2: { float n = pred * pred + LOSS_EPSILON; return vec2(d * d / n, 2.0 * d / n); }
    case LOSS_REL_L1: { float n = abs(pred) + LOSS_EPSILON; return vec2(abs(d) / n, s / n); }
    case LOSS_REL_L2_LUM: { float n = lum * lum + LOSS_EPSILON; return vec2(d * d / n, 2.0 * d / n); }
    case LOSS_MAPE: { float n = abs(target) + LOSS_EPSILON; return vec2(abs(d) / n, s / n); }
    case LOSS_SMAPE: { float n = abs(pred) + abs(target) + LOSS_EPSILON; return vec2(2.0 * abs(d) / n, 2.0 * s / n); }
    case LOSS_HUBER:
        if (abs(d) <= huber_delta) return vec2(0.5 * d * d, d);
        return vec2(huber_delta * (abs(d) - 0.5 * huber_delta), huber_delta * s);
    default: return vec2(d * d, 2.0 * d);
    }
}
