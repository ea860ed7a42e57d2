#version 450
#extension GL_EXT_control_flow_attributes : enable
// Fused MLP backward with cooperative matrices, one tile of R rows per workgroup: the loss and
// its gradient element-wise from the stored output pre-activations (as the SIMT kernel), then
// delta_{l-1} = (delta_l . W_l) * act'(z_{l-1}) with fp16 operands and fp32 accumulators; the
// fp32 pre-activations (STORE_HIDDEN_Z) or the flagged fp16 activations (flag_nonpositive) are
// loaded as accumulator-shaped matrices so that act' applies element-wise. Deltas are stored
// as fp16 (D16): they are fp16 values by the contract, and the conversion rounds them (RNE;
// r16 first where the device's conversion does not). Grid models (GRID_PARTS) run on through the
// first layer: d loss / d encoded input, which the grid tables' gradients read (grid.comp).
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
layout(local_size_x = THREADS) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) restrict readonly buffer TargetBuf { vec4 Y4[]; };
layout(std430, binding = 1) restrict readonly buffer WeightBuf { float16_t WALL16[]; };  // fp16 weight copy
layout(std430, binding = 2) restrict readonly buffer ZBuf { float Z[]; };          // fp32 pre-activations
layout(std430, binding = 2) restrict readonly buffer ZBuf4 { vec4 Z4[]; };         // the same, 4 at a time
layout(std430, binding = 3) restrict readonly buffer HBuf { float16_t H16[]; };    // flagged hidden activations
layout(std430, binding = 4) restrict writeonly buffer DBuf { float16_t D16[]; };   // deltas, every layer
// the same, 4 at a time (the output layer's block only: no element is written through both)
layout(std430, binding = 4) restrict writeonly buffer DBuf4 { f16vec4 D16x4[]; };
layout(std430, binding = 5) restrict writeonly buffer LossBuf { float LOSS_PART[]; };
#ifdef GRID_PARTS
// grid models: d loss / d encoded input (x LOSS_SCALE), rows_pad x IN_PAD fp32 over the whole batch
layout(std430, binding = 6) restrict writeonly buffer DinBuf { vec4 DIN4[]; };
#endif
layout(push_constant) uniform Push {
    uint rows_pad; uint tiles_x; uint n_rows; uint n_out;
    int hidden_act; int output_act; int loss_id; float huber_delta;
    uint row_base; uint tile_base; uint n_total;  // chunk's first row and tile; rows in the whole batch
} pc;

#include "coopmat_tile.glsl"
shared float LOSS_SH[THREADS];

void main() {
    uint tile = gl_WorkGroupID.y * pc.tiles_x + gl_WorkGroupID.x;
    uint row0 = tile * uint(R);
    if (row0 >= pc.rows_pad) return;
    uint tid = gl_LocalInvocationID.x;
    const int L = N_LAYERS - 1;
    uint zlast = uint(ZOUT_COL) * pc.rows_pad;
    uint dlast = uint(Z_COL[L]) * pc.rows_pad;
    float inv_count = 1.0 / (float(pc.n_total) * float(pc.n_out));
    float loss_sum = 0.0;
    // 4 columns per item, all items unrolled so that their loads are in flight together (in
    // bounds: rows_pad rows); padded rows and columns then contribute nothing
    const int ITEMS = (R * OUT_PAD / 4 + THREADS - 1) / THREADS;
    [[unroll]] for (int it = 0; it < ITEMS; ++it) {
        uint i = tid + uint(it * THREADS);
        if (i >= uint(R * OUT_PAD / 4)) break;
        uint r = i / uint(OUT_PAD / 4), c0 = (i - r * uint(OUT_PAD / 4)) * 4u;
        uint row = row0 + r;
        uint zrow = zlast + row * uint(OUT_PAD);
        vec4 z = Z4[(zrow + c0) / 4u];
        vec4 target = Y4[((pc.row_base + row) * uint(OUT_PAD) + c0) / 4u];
        float lum = 0.0;
        if (LOSS_ID == LOSS_REL_L2_LUM && row < pc.n_rows) {
            if (pc.n_out >= 3u) {
                lum = 0.299 * activate(OUTPUT_ACT, Z[zrow]) + 0.587 * activate(OUTPUT_ACT, Z[zrow + 1u])
                    + 0.114 * activate(OUTPUT_ACT, Z[zrow + 2u]);
            } else {
                for (uint k = 0u; k < pc.n_out; ++k) lum += abs(activate(OUTPUT_ACT, Z[zrow + k]));
                lum /= float(pc.n_out);
            }
        }
        f16vec4 delta;
        [[unroll]] for (uint q = 0u; q < 4u; ++q) {
            bool valid = row < pc.n_rows && c0 + q < pc.n_out;
            vec2 term = loss_term(LOSS_ID, pc.huber_delta, activate(OUTPUT_ACT, z[q]), target[q], lum);
            loss_sum += valid ? term.x : 0.0;
            delta[q] = float16_t(valid ? pre_f16(term.y * inv_count * LOSS_SCALE * activation_grad(OUTPUT_ACT, z[q])) : 0.0);
            ACT[r * uint(AS) + c0 + q] = delta[q];
        }
        D16x4[(dlast + row * uint(OUT_PAD) + c0) / 4u] = delta;
    }
    LOSS_SH[tid] = loss_sum;
    barrier();
    for (uint s = uint(THREADS) / 2u; s > 0u; s >>= 1) {
        if (tid < s) LOSS_SH[tid] += LOSS_SH[tid + s];
        barrier();
    }
    if (tid == 0u) LOSS_PART[pc.tile_base + tile] = LOSS_SH[0];
    [[unroll]] for (int l = L; l >= 1; --l) {
        int inner = LAYER_N[l], outer = LAYER_K[l];
        int ncb = outer / CM_N;
        [[unroll]] for (int i = 0; i < NACC; ++i) acc[i] = ACC_T(0.0);
        tile_mma(inner, outer, uint(WR_OFF[l]));
        uint zbase = uint(Z_COL[l - 1]) * pc.rows_pad;  // layer l-1's block in Z, H16 and D16
        [[unroll]] for (int j = 0; j < NCJ; ++j) {
            int cb = col_block(j);
            if (cb >= ncb) break;
            [[unroll]] for (int rb = 0; rb < NRB; ++rb) {
                int i = j * NRB + rb;
                uint at = zbase + (row0 + uint(row_block(rb) * CM_M)) * uint(outer) + uint(cb * CM_N);
                if (STORE_HIDDEN_Z == 1) {
                    ACC_T z;
                    coopMatLoad(z, Z, at, uint(outer), gl_CooperativeMatrixLayoutRowMajor);
                    [[unroll]] for (int e = 0; e < acc[i].length(); ++e)
                        acc[i][e] = pre_f16(acc[i][e] * activation_grad(HIDDEN_ACT, z[e]));
                } else {
                    ACC16_T h;
                    coopMatLoad(h, H16, at, uint(outer), gl_CooperativeMatrixLayoutRowMajor);
                    [[unroll]] for (int e = 0; e < acc[i].length(); ++e)
                        acc[i][e] = pre_f16(acc[i][e] * activation_grad_flagged(HIDDEN_ACT, float(h[e])));
                }
                ACC16_T d = ACC16_T(acc[i]);
                coopMatStore(d, D16, at, uint(outer), gl_CooperativeMatrixLayoutRowMajor);
                coopMatStore(d, ACT, uint(row_block(rb) * CM_M * AS + cb * CM_N), uint(AS), gl_CooperativeMatrixLayoutRowMajor);
            }
        }
    }
#ifdef GRID_PARTS
    // rnd(delta_0 . W_0), the cpu backend's d_encoded (rows past n_rows have zero deltas, so zero
    // here). The fp16 rounding is the conversion into the activation tile (NVIDIA's compiler folds
    // an f32 -> f16 -> f32 round trip on accumulators away), copied out as fp32, 4 columns a store.
    [[unroll]] for (int i = 0; i < NACC; ++i) acc[i] = ACC_T(0.0);
    tile_mma(LAYER_N[0], IN_PAD, uint(WR_OFF[0]));
    [[unroll]] for (int j = 0; j < NCJ; ++j) {
        int cb = col_block(j);
        if (cb >= IN_PAD / CM_N) break;
        [[unroll]] for (int rb = 0; rb < NRB; ++rb) {
            int i = j * NRB + rb;
            [[unroll]] for (int e = 0; e < acc[i].length(); ++e) acc[i][e] = pre_f16(acc[i][e]);
            ACC16_T d = ACC16_T(acc[i]);
            coopMatStore(d, ACT, uint(row_block(rb) * CM_M * AS + cb * CM_N), uint(AS), gl_CooperativeMatrixLayoutRowMajor);
        }
    }
    barrier();
    [[unroll]] for (int it = 0; it < (R * IN_PAD / 4 + THREADS - 1) / THREADS; ++it) {
        uint i = tid + uint(it * THREADS);
        if (i >= uint(R * IN_PAD / 4)) break;
        uint r = i / uint(IN_PAD / 4), c = (i - r * uint(IN_PAD / 4)) * 4u;
        uint a = r * uint(AS) + c;
        DIN4[(pc.row_base + row0 + r) * uint(IN_PAD / 4) + c / 4u] =
            vec4(float(ACT[a]), float(ACT[a + 1u]), float(ACT[a + 2u]), float(ACT[a + 3u]));
    }
#endif
}
