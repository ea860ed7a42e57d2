#version 450
#extension GL_EXT_control_flow_attributes : enable
// Fused MLP forward with workgroup-scope cooperative matrices (GL_NV_cooperative_matrix2): every
// layer of one tile of BM rows in one workgroup, each layer one BM x n matrix product of the fp16
// activations (use A) and the layer's fp16 weights (use B, from the fp16 copy in global memory,
// cache-resident), accumulated in fp32 on top of the bias. The activation acts element-wise on the
// accumulator; the fp16 conversion (round to nearest even; r16 first where the device's conversion
// does not) gives the next layer's operand. The training pipeline (TRAINING = 1) stores what the
// backward pass and the weight gradients read, as coopmat_forward.comp's does: the hidden layers'
// fp16 activations (H16, flagged where z <= 0), the output layer's fp32 pre-activation (Z) and,
// where the activation's derivative needs more (STORE_HIDDEN_Z), the hidden fp32 pre-activations.
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
layout(local_size_x = THREADS) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) restrict readonly buffer InputBuf { float X[]; };
layout(std430, binding = 0) restrict readonly buffer InputBuf16 { float16_t XH[]; };  // the same as fp16 (INPUT_F16)
layout(std430, binding = 1) restrict readonly buffer WeightBuf { float16_t WALL16[]; };  // fp16 weight copy
layout(std430, binding = 2) restrict readonly buffer BiasBuf { float BIAS[]; };   // BIAS_ROWS x Z_COLS
layout(std430, binding = 3) restrict writeonly buffer OutBuf { float OUT[]; };
layout(std430, binding = 3) restrict writeonly buffer OutBuf16 { float16_t OUT16[]; };  // the same as fp16 (OUTPUT_F16)
layout(std430, binding = 4) restrict writeonly buffer ZBuf { float Z[]; };      // fp32 pre-activations
layout(std430, binding = 5) restrict writeonly buffer HBuf { float16_t H16[]; };  // hidden activations
// row_base: first row of this chunk in the input (training runs big batches in chunks)
layout(push_constant) uniform Push { uint rows_pad; uint tiles_x; uint store_z; int hidden_act; int output_act; uint row_base; } pc;
layout(constant_id = 14) const int TRAINING = 0;

#include "coopmat2_tile.glsl"

// bias + product of hidden layer l done: its activation, the stores training needs, the next operand
void hidden_layer_out(inout ACC(NN) acc, int l, uint row0, out OPA(NN) next) {
    uint block = uint(Z_COL[l]) * pc.rows_pad;  // layer l's block in Z and H16: rows_pad x NN
    if (TRAINING == 1 && STORE_HIDDEN_Z == 1)
        coopMatStoreTensorNV(acc, Z, block, tile_rows(pc.rows_pad, NN, row0));
    [[unroll]] for (int e = 0; e < acc.length(); ++e) {
        float h = pre_f16(activate(HIDDEN_ACT, acc[e]));
        // the flag only matters to the backward pass (-0 multiplies as +0)
        acc[e] = STORE_HIDDEN_Z == 1 || TRAINING == 0 ? h : flag_nonpositive(h, acc[e]);
    }
    ACC16(NN) h16 = ACC16(NN)(acc);
    if (TRAINING == 1)
        coopMatStoreTensorNV(h16, H16, block, tile_rows(pc.rows_pad, NN, row0));
    next = OPA(NN)(h16);
}

void main() {
    uint tile = gl_WorkGroupID.y * pc.tiles_x + gl_WorkGroupID.x;
    uint row0 = tile * uint(BM);
    if (row0 >= pc.rows_pad) return;  // uniform over the workgroup
    OPA(IN_PAD) x;
    {
        tensorLayoutNV<2> rows = tile_rows(pc.row_base + pc.rows_pad, IN_PAD, pc.row_base + row0);
        if (INPUT_F16 == 1) {
            coopMatLoadTensorNV(x, XH, 0, rows);
        } else {
            ACC(IN_PAD) x32;
            coopMatLoadTensorNV(x32, X, 0, rows);
            [[unroll]] for (int e = 0; e < x32.length(); ++e) x32[e] = pre_f16(x32[e]);
            x = OPA(IN_PAD)(ACC16(IN_PAD)(x32));
        }
    }
    ACC(NN) acc;
    OPA(NN) h;
    LOAD_BIAS(acc, 0, NN);
    {
        OPB(IN_PAD, NN) w;
        LOAD_WEIGHTS(w, WT_OFF[0], IN_PAD, NN);
        acc = coopMatMulAdd(x, w, acc);
    }
    hidden_layer_out(acc, 0, row0, h);
    [[unroll]] for (int l = 1; l < N_LAYERS - 1; ++l) {
        LOAD_BIAS(acc, l, NN);
        OPB(NN, NN) w;
        LOAD_WEIGHTS(w, WT_OFF[l], NN, NN);
        acc = coopMatMulAdd(h, w, acc);
        hidden_layer_out(acc, l, row0, h);
    }
    const int L = N_LAYERS - 1;
    ACC(OUT_PAD) o;
    LOAD_BIAS(o, L, OUT_PAD);
    {
        OPB(NN, OUT_PAD) w;
        LOAD_WEIGHTS(w, WT_OFF[L], NN, OUT_PAD);
        o = coopMatMulAdd(h, w, o);
    }
    if (TRAINING == 1) {  // the loss reads the pre-activation
        coopMatStoreTensorNV(o, Z, uint(ZOUT_COL) * pc.rows_pad, tile_rows(pc.rows_pad, OUT_PAD, row0));
        return;
    }
    [[unroll]] for (int e = 0; e < o.length(); ++e) o[e] = activate(OUTPUT_ACT, o[e]);
    if (OUTPUT_F16 == 1) {  // the conversion rounds (RNE; r16 first where it does not)
        [[unroll]] for (int e = 0; e < o.length(); ++e) o[e] = pre_f16(o[e]);
        coopMatStoreTensorNV(ACC16(OUT_PAD)(o), OUT16, 0, tile_rows(pc.rows_pad, OUT_PAD, row0));
    } else {
        coopMatStoreTensorNV(o, OUT, 0, tile_rows(pc.rows_pad, OUT_PAD, row0));
    }
}
