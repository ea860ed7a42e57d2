#version 450
#extension GL_EXT_control_flow_attributes : enable
// Fused MLP forward with cooperative matrices (GL_KHR_cooperative_matrix): every layer of one
// tile of R rows in one workgroup; fp16 activations in shared memory, fp32 accumulators with
// the bias folded in (loaded once per column block from the row-replicated bias block),
// activation applied element-wise on the accumulators, then converted to fp16 for the next
// layer, rounding to nearest even (r16 first unless the device's conversion does that itself).
// The training pipeline (specialization constant TRAINING = 1; the push constant store_z is
// the simt kernel's) keeps what the backward pass and the weight gradients
// read: every hidden layer's fp16 activation (H16, the next layer's exact operand), the output
// layer's fp32 pre-activation (Z, instead of the output) and, where the hidden activation's
// derivative needs more than z's side of 0 (STORE_HIDDEN_Z), the hidden fp32 pre-activations.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
layout(local_size_x = THREADS) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) restrict readonly buffer InputBuf { vec4 X4[]; };
layout(std430, binding = 0) restrict readonly buffer InputBuf16 { uvec2 XH4[]; };  // the same as fp16 (INPUT_F16)
layout(std430, binding = 1) restrict readonly buffer WeightBuf { float16_t WALL16[]; };  // fp16 weight copy
layout(std430, binding = 2) restrict readonly buffer BiasBuf { float BIAS[]; };   // BIAS_ROWS x Z_COLS
layout(std430, binding = 3) restrict writeonly buffer OutBuf { float OUT[]; };
layout(std430, binding = 3) restrict writeonly buffer OutBuf16 { float16_t OUT16[]; };  // the same as fp16 (OUTPUT_F16)
layout(std430, binding = 4) restrict writeonly buffer ZBuf { float Z[]; };      // fp32 pre-activations
layout(std430, binding = 5) restrict writeonly buffer HBuf { float16_t H16[]; };  // hidden activations
// row_base: first row of this chunk in the input (training runs big batches in chunks)
layout(push_constant) uniform Push { uint rows_pad; uint tiles_x; uint store_z; int hidden_act; int output_act; uint row_base; } pc;
// a pipeline of its own for training, so that inference carries none of its stores or branches
layout(constant_id = 14) const int TRAINING = 0;

#include "coopmat_tile.glsl"

void main() {
    uint tile = gl_WorkGroupID.y * pc.tiles_x + gl_WorkGroupID.x;
    uint row0 = tile * uint(R);
    if (row0 >= pc.rows_pad) return;
    uint tid = gl_LocalInvocationID.x;
    // unrolled (constant trip count) so that every load is in flight before the first is used
    [[unroll]] for (int it = 0; it < (R * IN_PAD / 4 + THREADS - 1) / THREADS; ++it) {
        uint i = tid + uint(it * THREADS);
        if (i < uint(R * IN_PAD / 4)) {
            uint at = (pc.row_base + row0) * uint(IN_PAD) / 4u + i;
            vec4 v = INPUT_F16 == 1 ? unpack_halves(XH4[at]) : pre_f16(X4[at]);
            uint r = i / uint(IN_PAD / 4), c = (i - r * uint(IN_PAD / 4)) * 4u;
            [[unroll]] for (uint q = 0u; q < 4u; ++q) ACT[r * uint(AS) + c + q] = float16_t(v[q]);
        }
    }
    [[unroll]] for (int l = 0; l < N_LAYERS; ++l) {
        int kin = LAYER_K[l], nout = LAYER_N[l];
        int ncb = nout / CM_N;
        [[unroll]] for (int j = 0; j < NCJ; ++j) {
            if (col_block(j) >= ncb) break;
            ACC_T bias;
            coopMatLoad(bias, BIAS, uint(B_OFF[l] + col_block(j) * CM_N), uint(Z_COLS), gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (int rb = 0; rb < NRB; ++rb) acc[j * NRB + rb] = bias;
        }
        tile_mma(kin, nout, uint(WT_OFF[l]));
        bool last = l == N_LAYERS - 1;
        // layer l's block in Z (fp32) and H16 (fp16): rows_pad x nout from column Z_COL[l] on
        uint zbase = uint(last ? ZOUT_COL : Z_COL[l]) * pc.rows_pad;
        uint hbase = uint(Z_COL[l]) * pc.rows_pad;
        [[unroll]] for (int j = 0; j < NCJ; ++j) {
            int cb = col_block(j);
            if (cb >= ncb) break;
            [[unroll]] for (int rb = 0; rb < NRB; ++rb) {
                int i = j * NRB + rb;
                uint row = row0 + uint(row_block(rb) * CM_M);
                if (TRAINING == 1 && (last || STORE_HIDDEN_Z == 1))
                    coopMatStore(acc[i], Z, zbase + row * uint(nout) + uint(cb * CM_N), uint(nout),
                                 gl_CooperativeMatrixLayoutRowMajor);
                if (last) {
                    if (TRAINING == 0) {  // training reads the pre-activation (above) instead
                        [[unroll]] for (int e = 0; e < acc[i].length(); ++e) acc[i][e] = activate(OUTPUT_ACT, acc[i][e]);
                        if (OUTPUT_F16 == 1) {  // the conversion rounds (RNE; r16 first where it does not)
                            [[unroll]] for (int e = 0; e < acc[i].length(); ++e) acc[i][e] = pre_f16(acc[i][e]);
                            ACC16_T o = ACC16_T(acc[i]);
                            coopMatStore(o, OUT16, row * uint(OUT_PAD) + uint(cb * CM_N), uint(OUT_PAD),
                                         gl_CooperativeMatrixLayoutRowMajor);
                        } else {
                            coopMatStore(acc[i], OUT, row * uint(OUT_PAD) + uint(cb * CM_N), uint(OUT_PAD),
                                         gl_CooperativeMatrixLayoutRowMajor);
                        }
                    }
                } else {
                    [[unroll]] for (int e = 0; e < acc[i].length(); ++e) {
                        float h = pre_f16(activate(HIDDEN_ACT, acc[i][e]));
                        // the flag only matters to the backward pass (-0 multiplies as +0)
                        acc[i][e] = STORE_HIDDEN_Z == 1 || TRAINING == 0 ? h : flag_nonpositive(h, acc[i][e]);
                    }
                    ACC16_T h = ACC16_T(acc[i]);
                    coopMatStore(h, ACT, uint(row_block(rb) * CM_M * AS + cb * CM_N), uint(AS),
                                 gl_CooperativeMatrixLayoutRowMajor);
                    if (TRAINING == 1)
                        coopMatStore(h, H16, hbase + row * uint(nout) + uint(cb * CM_N), uint(nout),
                                     gl_CooperativeMatrixLayoutRowMajor);
                }
            }
        }
    }
}
