#version 450
// One invocation per (unpadded) parameter: sums the gradient splits in a fixed order, divides
// by the loss scale, and either stores the gradient (mode 0) or applies Adam/SGD to the fp32
// master (mode 1), refreshing the fp16-rounded copies the kernels read (both layouts). With
// tcnn's EMA wrapper (EMA = 1) it then updates the parameter's running average and the
// inference copies of the forward kernel (transposed weights, row-replicated biases) from it.
// Grid models (GRID_PARTS defined): the tables' values follow the MLP's parameters (index
// MLP_PARAMS on); their summed gradients come from grid.comp (GGRAD), their compute-type copies
// (TABLE, with EMA the average's ETABLE) are what grid.comp interpolates, and Adam steps them as
// tcnn does (numerics.grid_adam_update): no l2_reg, a value whose gradient is exactly 0 is not
// stepped, the bias correction uses the value's own step count (GSTEPS).
#ifdef CM_M
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#endif
layout(local_size_x = 256) in;
#include "mlp_common.glsl"

layout(constant_id = 6) const int OPT_ADAM = 1;
layout(constant_id = 8) const float BETA1 = 0.9;
layout(constant_id = 9) const float BETA2 = 0.99;
layout(constant_id = 10) const float EPSILON = 1e-15;
layout(constant_id = 11) const float L2_REG = 0.0;
layout(constant_id = 12) const float MOMENTUM = 0.0;
layout(constant_id = 15) const int EMA = 0;
layout(constant_id = 16) const int EMA_FULL_PRECISION = 0;

layout(std430, binding = 0) readonly buffer PartBuf { float PART[]; };
layout(std430, binding = 1) buffer MasterBuf { float MASTER[]; };
layout(std430, binding = 2) buffer SlotA { float SLOT_A[]; };
layout(std430, binding = 3) buffer SlotB { float SLOT_B[]; };
layout(std430, binding = 4) buffer WeightBuf { float WALL[]; };
layout(std430, binding = 5) buffer BiasBuf { float BIAS[]; };
layout(std430, binding = 6) writeonly buffer GradBuf { float GRAD[]; };
// the learning rate of each step of a submission, written by the host (contract.next_step_rate:
// Adam's bias correction is computed once, in float64, for every backend)
layout(std430, binding = 7) readonly buffer Control {
    uint step; uint base; uint pad0; uint pad1; float hist[HIST_CAP]; float rate[HIST_CAP];
    float ema[2 * HIST_CAP];  // per step: keep, take (numerics.ema_factors, float64 on the host)
    float base_rate[HIST_CAP];  // per step: the rate without Adam's bias correction (grid tables)
} ctrl;
// EMA models: the average (unpadded like MASTER) and what inference reads; others bind a dummy
layout(std430, binding = 9) buffer EmaBuf { float EMA_AVG[]; };
layout(std430, binding = 10) writeonly buffer EmaWeightBuf { float EWALL[]; };
layout(std430, binding = 11) writeonly buffer EmaBiasBuf { float EBIAS[]; };
#ifdef CM_M
layout(std430, binding = 8) buffer Weight16Buf { float16_t WALL16[]; };  // the coopmat kernels' copy
layout(std430, binding = 12) writeonly buffer EmaWeight16Buf { float16_t EWALL16[]; };
#endif
layout(push_constant) uniform Push { uint n_params; uint splits; uint gsize; uint mode; uint groups_x; } pc;
#ifdef GRID_PARTS
layout(std430, binding = 13) readonly buffer GridGradBuf { float GGRAD[]; };
layout(std430, binding = 14) buffer GridStepsBuf { uint GSTEPS[]; };
layout(std430, binding = 15) writeonly buffer TableBuf { float TABLE[]; };
layout(std430, binding = 16) writeonly buffer EmaTableBuf { float ETABLE[]; };

void step_table_value(uint i) {
    uint gi = i - uint(MLP_PARAMS);
    float g = GGRAD[gi] / LOSS_SCALE;
    if (pc.mode == 0u) {
        GRAD[i] = g;
        return;
    }
    uint t = ctrl.step - ctrl.base - 1u;
    float w = MASTER[i];
    if (OPT_ADAM != 0) {
        if (g != 0.0) {
            float m = BETA1 * SLOT_A[i] + (1.0 - BETA1) * g;
            float v = BETA2 * SLOT_B[i] + (1.0 - BETA2) * g * g;
            uint steps = GSTEPS[gi] + 1u;
            GSTEPS[gi] = steps;
            float lr_t = ctrl.base_rate[t] * sqrt(1.0 - pow(BETA2, float(steps))) / (1.0 - pow(BETA1, float(steps)));
            w -= lr_t * m / (sqrt(v) + EPSILON);
            SLOT_A[i] = m;
            SLOT_B[i] = v;
        }
    } else {  // tcnn's SGD steps every parameter alike
        g += L2_REG * w;
        float vel = MOMENTUM * SLOT_A[i] + g;
        w -= ctrl.rate[t] * vel;
        SLOT_A[i] = vel;
    }
    MASTER[i] = w;
    TABLE[gi] = r16(w);
    if (EMA == 0) return;
    float e = EMA_AVG[i] * ctrl.ema[2u * t] + r16(w) * ctrl.ema[2u * t + 1u];
    if (EMA_FULL_PRECISION == 0) e = r16(e);
    EMA_AVG[i] = e;
    ETABLE[gi] = r16(e);
}
#endif

void main() {
    uint i = gl_WorkGroupID.y * pc.groups_x * 256u + gl_GlobalInvocationID.x;
    if (i >= pc.n_params) return;
#ifdef GRID_PARTS
    if (i >= uint(MLP_PARAMS)) {
        step_table_value(i);
        return;
    }
#endif
    int l = 0;
    for (; l < N_LAYERS - 1; ++l)
        if (i < uint(P_OFF[l + 1])) break;
    int fan_in = FAN_IN[l], fan_out = FAN_OUT[l];
    int local = int(i) - P_OFF[l];
    bool is_bias = local >= fan_out * fan_in;
    int n, k = 0, gidx;
    if (is_bias) {
        n = local - fan_out * fan_in;
        gidx = GB_OFF[l] + n;
    } else {
        n = local / fan_in;
        k = local - n * fan_in;
        gidx = GW_OFF[l] + n * LAYER_K[l] + k;
    }
    float g = 0.0;
    for (uint s = 0u; s < pc.splits; ++s) g += PART[s * pc.gsize + uint(gidx)];
    g /= LOSS_SCALE;
    if (pc.mode == 0u) {
        GRAD[i] = g;
        return;
    }
    // ctrl.step was advanced by loss_finalize: this is step ctrl.step, the (step-base)-th of the submission
    uint t = ctrl.step - ctrl.base - 1u;
    float w = MASTER[i];
    g += L2_REG * w;
    if (OPT_ADAM != 0) {
        float m = BETA1 * SLOT_A[i] + (1.0 - BETA1) * g;
        float v = BETA2 * SLOT_B[i] + (1.0 - BETA2) * g * g;
        w -= ctrl.rate[t] * m / (sqrt(v) + EPSILON);
        SLOT_A[i] = m;
        SLOT_B[i] = v;
    } else {
        float vel = MOMENTUM * SLOT_A[i] + g;
        w -= ctrl.rate[t] * vel;
        SLOT_A[i] = vel;
    }
    MASTER[i] = w;
    if (is_bias) {
        for (int r = 0; r < BIAS_ROWS; ++r) BIAS[r * Z_COLS + B_OFF[l] + n] = w;
    } else {
        float w16 = r16(w);
        WALL[WT_OFF[l] + k * LAYER_N[l] + n] = w16;
        WALL[WR_OFF[l] + n * LAYER_K[l] + k] = w16;
#ifdef CM_M
        WALL16[WT_OFF[l] + k * LAYER_N[l] + n] = float16_t(w16);
        WALL16[WR_OFF[l] + n * LAYER_K[l] + k] = float16_t(w16);
#endif
    }
    if (EMA == 0) return;
    // tcnn averages the weights the network computes with (fp16-rounded weights, fp32 biases)
    // and, without full_precision, keeps the weights' average in that precision too (cpu.py)
    float e = EMA_AVG[i] * ctrl.ema[2u * t] + (is_bias ? w : r16(w)) * ctrl.ema[2u * t + 1u];
    if (EMA_FULL_PRECISION == 0 && !is_bias) e = r16(e);
    EMA_AVG[i] = e;
    if (is_bias) {
        for (int r = 0; r < BIAS_ROWS; ++r) EBIAS[r * Z_COLS + B_OFF[l] + n] = e;
    } else {
        // the forward kernel reads only the transposed layout, in fp32 (simt) or fp16 (coopmat)
#ifdef CM_M
        EWALL16[WT_OFF[l] + k * LAYER_N[l] + n] = float16_t(r16(e));
#else
        EWALL[WT_OFF[l] + k * LAYER_N[l] + n] = r16(e);
#endif
    }
}
