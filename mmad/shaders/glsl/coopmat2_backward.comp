#version 450
#extension GL_EXT_control_flow_attributes : enable
// Fused MLP backward with workgroup-scope cooperative matrices (GL_NV_cooperative_matrix2), one tile
// of BM rows per workgroup: the loss and its gradient element-wise from the stored output
// pre-activations (coopmat_backward.comp's loop), staged once in a shared fp16 tile that becomes the
// first A operand, then delta_{l-1} = (delta_l . W_l) * act'(z_{l-1}) as one BM x NN product a layer,
// act' from the fp32 pre-activations (STORE_HIDDEN_Z) or the flagged fp16 activations
// (flag_nonpositive), loaded as accumulators and converted to fp32 so that the element-wise product
// pairs equal positions. Deltas are stored as fp16 (D16; the conversion rounds to nearest even, r16
// first where the device's does not), and the fp16 delta is the next product's operand. Grid models
// (GRID_PARTS) run on through the first layer: d loss / d encoded input, which the grid tables'
// gradients read (grid.comp).
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
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

#include "coopmat2_tile.glsl"
// the output deltas (and, grid models, d loss / d encoded input) as fp16: DS halves a row
shared float16_t DT[BM * DS];
shared float LOSS_SH[THREADS];

// (delta_l . W_l) of the tile done: times act' of layer lz = l - 1, stored as fp16, the next operand
void hidden_delta(inout ACC(NN) g, int lz, uint row0, out OPA(NN) next) {
    uint block = uint(Z_COL[lz]) * pc.rows_pad;  // layer lz's block in Z, H16 and D16
    tensorLayoutNV<2> rows = tile_rows(pc.rows_pad, NN, row0);
    if (STORE_HIDDEN_Z == 1) {
        ACC(NN) z;
        coopMatLoadTensorNV(z, Z, block, rows);
        [[unroll]] for (int e = 0; e < g.length(); ++e) g[e] = pre_f16(g[e] * activation_grad(HIDDEN_ACT, z[e]));
    } else {
        ACC16(NN) h16;
        coopMatLoadTensorNV(h16, H16, block, rows);
        ACC(NN) h = ACC(NN)(h16);
        [[unroll]] for (int e = 0; e < g.length(); ++e) g[e] = pre_f16(g[e] * activation_grad_flagged(HIDDEN_ACT, h[e]));
    }
    ACC16(NN) d = ACC16(NN)(g);
    coopMatStoreTensorNV(d, D16, block, rows);
    next = OPA(NN)(d);
}

void main() {
    uint tile = gl_WorkGroupID.y * pc.tiles_x + gl_WorkGroupID.x;
    uint row0 = tile * uint(BM);
    if (row0 >= pc.rows_pad) return;  // uniform over the workgroup
    uint tid = gl_LocalInvocationID.x;
    const int L = N_LAYERS - 1;
    uint zlast = uint(ZOUT_COL) * pc.rows_pad;
    uint dlast = uint(Z_COL[L]) * pc.rows_pad;
    float inv_count = 1.0 / (float(pc.n_total) * float(pc.n_out));
    float loss_sum = 0.0;
    // 4 columns per item, all items unrolled so that their loads are in flight together (in
    // bounds: rows_pad rows); padded rows and columns then contribute nothing
    const int ITEMS = (BM * OUT_PAD / 4 + THREADS - 1) / THREADS;
    [[unroll]] for (int it = 0; it < ITEMS; ++it) {
        uint i = tid + uint(it * THREADS);
        if (i >= uint(BM * OUT_PAD / 4)) break;
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
            DT[r * uint(DS) + c0 + q] = delta[q];
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
    // the reduction's barriers order the delta tile's writes before this load
    OPA(OUT_PAD) d_out;
    coopMatLoad(d_out, DT, 0, DS, gl_CooperativeMatrixLayoutRowMajor);
    ACC(NN) g = ACC(NN)(0.0);
    {
        OPB(OUT_PAD, NN) w;
        LOAD_WEIGHTS(w, WR_OFF[L], OUT_PAD, NN);
        g = coopMatMulAdd(d_out, w, g);
    }
    OPA(NN) d;
    hidden_delta(g, L - 1, row0, d);
    [[unroll]] for (int l = L - 1; l >= 1; --l) {
        OPB(NN, NN) w;
        LOAD_WEIGHTS(w, WR_OFF[l], NN, NN);
        g = coopMatMulAdd(d, w, ACC(NN)(0.0));
        hidden_delta(g, l - 1, row0, d);
    }
#ifdef GRID_PARTS
    // rnd(delta_0 . W_0), the cpu backend's d_encoded (rows past n_rows have zero deltas, so zero
    // here). The fp16 rounding is the conversion into the shared tile (NVIDIA's compiler folds an
    // f32 -> f16 -> f32 round trip on accumulators away), copied out as fp32, 4 columns a store.
    ACC(IN_PAD) gin = ACC(IN_PAD)(0.0);
    {
        OPB(NN, IN_PAD) w;
        LOAD_WEIGHTS(w, WR_OFF[0], NN, IN_PAD);
        gin = coopMatMulAdd(d, w, gin);
    }
    [[unroll]] for (int e = 0; e < gin.length(); ++e) gin[e] = pre_f16(gin[e]);
    barrier();  // every subgroup has loaded the output deltas from the tile
    coopMatStore(ACC16(IN_PAD)(gin), DT, 0, DS, gl_CooperativeMatrixLayoutRowMajor);
    barrier();
    [[unroll]] for (int it = 0; it < (BM * IN_PAD / 4 + THREADS - 1) / THREADS; ++it) {
        uint i = tid + uint(it * THREADS);
        if (i >= uint(BM * IN_PAD / 4)) break;
        uint r = i / uint(IN_PAD / 4), c = (i - r * uint(IN_PAD / 4)) * 4u;
        uint a = r * uint(DS) + c;
        DIN4[(pc.row_base + row0 + r) * uint(IN_PAD / 4) + c / 4u] =
            vec4(float(DT[a]), float(DT[a + 1u]), float(DT[a + 2u]), float(DT[a + 3u]));
    }
#endif
}
