#version 450
#extension GL_EXT_control_flow_attributes : enable
// Fused MLP forward (SIMT): every layer of one tile of R rows in one workgroup; activations
// stay in shared memory, weights are streamed in chunks. With store_z != 0 (training) the
// pre-activations of every layer are written for the backward pass.
layout(local_size_x = THREADS) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) readonly buffer InputBuf { vec4 X4[]; };      // rows_pad x IN_PAD
layout(std430, binding = 0) readonly buffer InputBuf16 { uvec2 XH4[]; };  // the same as fp16 (INPUT_F16)
layout(std430, binding = 1) readonly buffer WeightBuf { vec4 WALL4[]; };  // transposed + plain fp16-rounded weights
layout(std430, binding = 2) readonly buffer BiasBuf { vec4 BIAS4[]; };    // fp32 biases, padded
layout(std430, binding = 3) writeonly buffer OutBuf { vec4 OUT4[]; };     // rows_pad x OUT_PAD
layout(std430, binding = 3) writeonly buffer OutBuf16 { uvec2 OUTH4[]; }; // the same as fp16 (OUTPUT_F16)
layout(std430, binding = 4) writeonly buffer ZBuf { vec4 Z4[]; };         // pre-activations, layer blocks
// row_base: first row of this chunk in the input (training runs big batches in chunks)
layout(push_constant) uniform Push { uint rows_pad; uint tiles_x; uint store_z; int hidden_act; int output_act; uint row_base; } pc;

#include "simt_tile.glsl"

void main() {
    uint tile = gl_WorkGroupID.y * pc.tiles_x + gl_WorkGroupID.x;
    uint row0 = tile * uint(R);
    if (row0 >= pc.rows_pad) return;  // uniform over the workgroup
    uint tid = gl_LocalInvocationID.x;
    for (uint i = tid; i < uint(R * IN_PAD / 4); i += uint(THREADS)) {
        uint at = (pc.row_base + row0) * uint(IN_PAD) / 4u + i;
        ACT4[i] = r16(INPUT_F16 == 1 ? unpack_halves(XH4[at]) : X4[at]);
    }
    uint cur = 0u, nxt = uint(R * KMAX);
    vec4 acc[MTPT * MR];
    for (int l = 0; l < N_LAYERS; ++l) {
        int kin = LAYER_K[l], nout = LAYER_N[l];
        tile_product(cur, kin, nout, uint(WT_OFF[l]), KC_FWD[l], acc);
        bool last = l == N_LAYERS - 1;
        int ncols4 = nout / 4;
        uint zbase = uint(Z_COL[l]) * pc.rows_pad / 4u;
        [[unroll]] for (int j = 0; j < MTPT; ++j) {
            int mt = int(tid) + j * THREADS;
            if (mt >= (R / MR) * ncols4) break;
            int rt = mt / ncols4, ct = mt - rt * ncols4;
            vec4 bias = BIAS4[B_OFF[l] / 4 + ct];
            [[unroll]] for (int r = 0; r < MR; ++r) {
                uint row = uint(rt * MR + r);
                vec4 z = acc[j * MR + r] + bias;
                if (pc.store_z != 0u) Z4[zbase + (row0 + row) * uint(ncols4) + uint(ct)] = z;
                if (last && OUTPUT_F16 == 1) OUTH4[(row0 + row) * uint(OUT_PAD / 4) + uint(ct)] = pack_halves(activate4(OUTPUT_ACT, z));
                else if (last) OUT4[(row0 + row) * uint(OUT_PAD / 4) + uint(ct)] = activate4(OUTPUT_ACT, z);
                else ACT4[nxt / 4u + row * uint(ncols4) + uint(ct)] = r16(activate4(HIDDEN_ACT, z));
            }
        }
        uint t = cur; cur = nxt; nxt = t;
    }
}
