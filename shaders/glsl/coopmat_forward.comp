#version 450
#extension GL_EXT_control_flow_attributes : enable
// Fused MLP forward with cooperative matrices (GL_KHR_cooperative_matrix): every layer of one
// tile of R rows in one workgroup; fp16 activations in shared memory, fp32 accumulators with
// the bias folded in (loaded from the row-replicated bias block), activation applied
// element-wise on the accumulators, then rounded to fp16 (exact r16, then an exact convert)
// for the next layer. With store_z != 0 the pre-activations are stored for the backward pass.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
layout(local_size_x = THREADS) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) readonly buffer InputBuf { vec4 X4[]; };
layout(std430, binding = 1) readonly buffer WeightBuf { float16_t WALL16[]; };  // fp16 weight copy
layout(std430, binding = 2) readonly buffer BiasBuf { float BIAS[]; };   // BIAS_ROWS x Z_COLS
layout(std430, binding = 3) writeonly buffer OutBuf { float OUT[]; };
layout(std430, binding = 4) writeonly buffer ZBuf { float Z[]; };
// row_base: first row of this chunk in the input (training runs big batches in chunks)
layout(push_constant) uniform Push { uint rows_pad; uint tiles_x; uint store_z; int hidden_act; int output_act; uint row_base; } pc;

#include "coopmat_tile.glsl"

void main() {
    uint tile = gl_WorkGroupID.y * pc.tiles_x + gl_WorkGroupID.x;
    uint row0 = tile * uint(R);
    if (row0 >= pc.rows_pad) return;
    uint tid = gl_LocalInvocationID.x;
    for (uint i = tid; i < uint(R * IN_PAD / 4); i += uint(THREADS)) {
        vec4 v = r16(X4[(pc.row_base + row0) * uint(IN_PAD) / 4u + i]);
        for (uint c = 0u; c < 4u; ++c) ACT[i * 4u + c] = float16_t(v[c]);
    }
    uint cur = 0u, nxt = uint(R * KMAX);
    ACC_T acc[NACC];
    for (int l = 0; l < N_LAYERS; ++l) {
        int kin = LAYER_K[l], nout = LAYER_N[l];
        [[unroll]] for (int i = 0; i < NACC; ++i) {
            ivec2 blk = block_of(i, nout);
            if (blk.x < 0) break;
            coopMatLoad(acc[i], BIAS, uint(B_OFF[l] + blk.y * CM_N), uint(Z_COLS), gl_CooperativeMatrixLayoutRowMajor);
        }
        tile_mma(cur, kin, nout, uint(WT_OFF[l]), acc);
        bool last = l == N_LAYERS - 1;
        uint zbase = uint(Z_COL[l]) * pc.rows_pad;
        [[unroll]] for (int i = 0; i < NACC; ++i) {
            ivec2 blk = block_of(i, nout);
            if (blk.x < 0) break;
            uint row = row0 + uint(blk.x * CM_M);
            if (pc.store_z != 0u)
                coopMatStore(acc[i], Z, zbase + row * uint(nout) + uint(blk.y * CM_N), uint(nout),
                             gl_CooperativeMatrixLayoutRowMajor);
            if (last) {
                for (int e = 0; e < acc[i].length(); ++e) acc[i][e] = activate(OUTPUT_ACT, acc[i][e]);
                coopMatStore(acc[i], OUT, row * uint(OUT_PAD) + uint(blk.y * CM_N), uint(OUT_PAD),
                             gl_CooperativeMatrixLayoutRowMajor);
            } else {
                for (int e = 0; e < acc[i].length(); ++e) acc[i][e] = r16(activate(HIDDEN_ACT, acc[i][e]));
                ACC16_T h = ACC16_T(acc[i]);
                coopMatStore(h, ACT, nxt + uint(blk.x * CM_M * nout + blk.y * CM_N), uint(nout),
                             gl_CooperativeMatrixLayoutRowMajor);
            }
        }
        uint t = cur; cur = nxt; nxt = t;
    }
}
