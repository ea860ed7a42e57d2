#version 450
#extension GL_EXT_control_flow_attributes : enable
// Fused MLP backward (SIMT), one tile of R rows per workgroup: the loss and its gradient from
// the stored output pre-activations, then the layer gradients (deltas, w.r.t. each layer's
// pre-activation) through every layer, each rounded to fp16 and written for the weight-gradient
// kernel. Rows at or past n_rows (the valid rows of this chunk) get zero deltas; the mean
// divides by n_total, the rows of the whole batch. Per-tile loss sums go to LOSS_PART.
layout(local_size_x = THREADS) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) readonly buffer TargetBuf { vec4 Y4[]; };     // rows_pad x OUT_PAD
layout(std430, binding = 1) readonly buffer WeightBuf { vec4 WALL4[]; };
layout(std430, binding = 2) readonly buffer ZBuf { vec4 Z4[]; };
layout(std430, binding = 3) writeonly buffer DBuf { vec4 D4[]; };         // deltas, layer blocks
layout(std430, binding = 4) writeonly buffer LossBuf { float LOSS_PART[]; };
#ifdef GRID_PARTS
// grid models: d loss / d encoded input (x LOSS_SCALE), rows_pad x IN_PAD over the whole batch,
// what the tables' gradients gather (grid.comp)
layout(std430, binding = 5) writeonly buffer DinBuf { vec4 DIN4[]; };
#endif
layout(push_constant) uniform Push {
    uint rows_pad; uint tiles_x; uint n_rows; uint n_out;
    int hidden_act; int output_act; int loss_id; float huber_delta;
    uint row_base; uint tile_base; uint n_total;  // chunk's first row and tile; rows in the whole batch
} pc;

#include "simt_tile.glsl"
shared float LOSS_SH[THREADS];

void main() {
    uint tile = gl_WorkGroupID.y * pc.tiles_x + gl_WorkGroupID.x;
    uint row0 = tile * uint(R);
    if (row0 >= pc.rows_pad) return;
    uint tid = gl_LocalInvocationID.x;
    const int L = N_LAYERS - 1;
    uint zlast = uint(Z_COL[L]) * pc.rows_pad / 4u;
    uint cur = 0u, nxt = uint(R * KMAX);
    // predictions of the tile into the second buffer (the luminance needs whole rows)
    for (uint i = tid; i < uint(R * OUT_PAD / 4); i += uint(THREADS))
        ACT4[nxt / 4u + i] = activate4(OUTPUT_ACT, Z4[zlast + row0 * uint(OUT_PAD / 4) + i]);
    barrier();
    float inv_count = 1.0 / (float(pc.n_total) * float(pc.n_out));
    float loss_sum = 0.0;
    for (uint i = tid; i < uint(R * OUT_PAD); i += uint(THREADS)) {
        uint r = i / uint(OUT_PAD), c = i - r * uint(OUT_PAD);
        uint row = row0 + r;
        float delta = 0.0;
        if (row < pc.n_rows && c < pc.n_out) {
            uint pbase = nxt + r * uint(OUT_PAD);
            float pred = ACT4[(pbase + c) / 4u][(pbase + c) % 4u];
            float lum;
            if (pc.n_out >= 3u) {
                lum = 0.299 * ACT4[pbase / 4u].x + 0.587 * ACT4[pbase / 4u].y + 0.114 * ACT4[pbase / 4u].z;
            } else {
                lum = 0.0;
                for (uint q = 0u; q < pc.n_out; ++q) lum += abs(ACT4[(pbase + q) / 4u][(pbase + q) % 4u]);
                lum /= float(pc.n_out);
            }
            float target = Y4[((pc.row_base + row) * uint(OUT_PAD) + c) / 4u][c % 4u];
            vec2 term = loss_term(LOSS_ID, pc.huber_delta, pred, target, lum);
            loss_sum += term.x;
            float z = Z4[zlast + (row * uint(OUT_PAD) + c) / 4u][c % 4u];
            delta = r16(term.y * inv_count * LOSS_SCALE * activation_grad(OUTPUT_ACT, z));
        }
        ACT4[(cur + i) / 4u][i % 4u] = delta;
    }
    LOSS_SH[tid] = loss_sum;
    barrier();
    for (uint s = uint(THREADS) / 2u; s > 0u; s >>= 1) {   // fixed-order tree: deterministic
        if (tid < s) LOSS_SH[tid] += LOSS_SH[tid + s];
        barrier();
    }
    if (tid == 0u) LOSS_PART[pc.tile_base + tile] = LOSS_SH[0];
    uint dlast = uint(Z_COL[L]) * pc.rows_pad / 4u;
    for (uint i = tid; i < uint(R * OUT_PAD / 4); i += uint(THREADS))
        D4[dlast + row0 * uint(OUT_PAD / 4) + i] = ACT4[cur / 4u + i];
    vec4 acc[MTPT * MR];
    for (int l = L; l >= 1; --l) {
        // delta_{l-1} = (delta_l . W_l) * act'(z_{l-1}); W_l stored (N_l x K_l) is the (inner x outer) operand
        int inner = LAYER_N[l], outer = LAYER_K[l];
        tile_product(cur, inner, outer, uint(WR_OFF[l]), KC_BWD[l], acc);
        int ncols4 = outer / 4;
        uint zbase = uint(Z_COL[l - 1]) * pc.rows_pad / 4u;
        [[unroll]] for (int j = 0; j < MTPT; ++j) {
            int mt = int(tid) + j * THREADS;
            if (mt >= (R / MR) * ncols4) break;
            int rt = mt / ncols4, ct = mt - rt * ncols4;
            [[unroll]] for (int r = 0; r < MR; ++r) {
                uint row = uint(rt * MR + r);
                uint at = zbase + (row0 + row) * uint(ncols4) + uint(ct);
                vec4 d = row0 + row < pc.n_rows ? r16(acc[j * MR + r] * activation_grad4(HIDDEN_ACT, Z4[at])) : vec4(0.0);
                D4[at] = d;
                ACT4[nxt / 4u + row * uint(ncols4) + uint(ct)] = d;
            }
        }
        uint t = cur; cur = nxt; nxt = t;
    }
#ifdef GRID_PARTS
    // on through the first layer: rnd(delta_0 . W_0), the cpu backend's d_encoded (rows past
    // n_rows have zero deltas, so zero here)
    tile_product(cur, LAYER_N[0], IN_PAD, uint(WR_OFF[0]), KC_BWD[0], acc);
    [[unroll]] for (int j = 0; j < MTPT; ++j) {
        int mt = int(tid) + j * THREADS;
        if (mt >= (R / MR) * (IN_PAD / 4)) break;
        int rt = mt / (IN_PAD / 4), ct = mt - rt * (IN_PAD / 4);
        [[unroll]] for (int r = 0; r < MR; ++r) {
            uint row = pc.row_base + row0 + uint(rt * MR + r);
            DIN4[row * uint(IN_PAD / 4) + uint(ct)] = r16(acc[j * MR + r]);
        }
    }
#endif
}
