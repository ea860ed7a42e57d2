#version 450
#extension GL_EXT_control_flow_attributes : enable
// Weight and bias gradients of one layer over one split of the batch, with cooperative
// matrices: PART[split] (N x K) = D^T (N x rows) . H (rows x K). A 64 x 64 output tile per
// workgroup, its CM_M x CM_N blocks split among the subgroups; rows are staged RC at a time in
// shared memory as fp16 with a padded row stride (WS) against bank conflicts, and D^T is read
// with a column-major load. Deltas (D16) and hidden activations (H16, flagged: a -0 multiplies
// as +0) are stored as fp16 by the fused kernels and copied 8 halves at a time; the first
// layer's inputs are fp32 (rounded to fp16 here).
// The bias gradient sums the staged deltas' columns, even and odd rows in two thread groups
// where the workgroup has the threads. Accumulation is fp32 in a fixed order.
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = THREADS) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) restrict readonly buffer InputBuf { vec4 X4[]; };
layout(std430, binding = 0) restrict readonly buffer InputBuf16 { uvec2 XH4[]; };  // the same as fp16 (INPUT_F16)
layout(std430, binding = 1) restrict readonly buffer HBuf { uvec4 H8[]; };  // 8 fp16 activations each
layout(std430, binding = 2) restrict readonly buffer DBuf { uvec4 D8[]; };  // 8 fp16 deltas each
layout(std430, binding = 3) restrict writeonly buffer PartBuf { float PART[]; };
// row_base / split_base: this chunk's first input row and first partial-sum slot
layout(push_constant) uniform Push { uint rows_pad; uint layer; uint rows_per_split; uint gsize; int hidden_act; uint row_base; uint split_base; } pc;

#define RC 64
#define TILE 64
#define WS (TILE + 8)
#define BGROUPS (THREADS >= 2 * TILE ? 2 : 1)
#define WG_BLOCKS ((TILE / CM_M) * (TILE / CM_N))
#define WACC ((WG_BLOCKS + SUBGROUPS - 1) / SUBGROUPS)  // the blocks of a subgroup
shared float16_t DS[RC * WS];
shared float16_t HS[RC * WS];
shared float BSUM[TILE];

void main() {
    int l = int(pc.layer);
    int N = LAYER_N[l], K = LAYER_K[l];
    uint tid = gl_LocalInvocationID.x;
    int n0 = int(gl_WorkGroupID.x) * TILE, k0 = int(gl_WorkGroupID.y) * TILE;
    uint split = gl_WorkGroupID.z;
    uint r_begin = split * pc.rows_per_split;
    uint r_end = min(r_begin + pc.rows_per_split, pc.rows_pad);
    // layer blocks of rows_pad x width halves from column Z_COL on (multiples of 16 halves)
    uint dbase = uint(Z_COL[l]) * pc.rows_pad / 8u;
    uint hbase = l > 0 ? uint(Z_COL[max(l - 1, 0)]) * pc.rows_pad / 8u : 0u;
    coopmat<float, gl_ScopeSubgroup, CM_M, CM_N, gl_MatrixUseAccumulator> acc[WACC];
    [[unroll]] for (int i = 0; i < WACC; ++i) acc[i] = coopmat<float, gl_ScopeSubgroup, CM_M, CM_N, gl_MatrixUseAccumulator>(0.0);
    float bias_acc = 0.0;
    for (uint r = r_begin; r < r_end; r += uint(RC)) {
        barrier();
        [[unroll]] for (int it = 0; it < (RC * TILE / 8 + THREADS - 1) / THREADS; ++it) {  // loads in flight together
            uint i = tid + uint(it * THREADS);
            if (i >= uint(RC * TILE / 8)) break;
            uint rr = i / uint(TILE / 8), q = i - rr * uint(TILE / 8);
            uint row = r + rr;
            int cn = n0 + int(q) * 8, ck = k0 + int(q) * 8;
            uvec4 d = cn < N ? D8[dbase + row * uint(N / 8) + uint(cn / 8)] : uvec4(0u);
            uvec4 h = l > 0 && ck < K ? H8[hbase + row * uint(K / 8) + uint(ck / 8)] : uvec4(0u);
            [[unroll]] for (uint c = 0u; c < 4u; ++c) {
                f16vec2 dp = unpackFloat2x16(d[c]);
                DS[rr * uint(WS) + q * 8u + 2u * c] = dp.x;
                DS[rr * uint(WS) + q * 8u + 2u * c + 1u] = dp.y;
                if (l > 0) {
                    f16vec2 hp = unpackFloat2x16(h[c]);
                    HS[rr * uint(WS) + q * 8u + 2u * c] = hp.x;
                    HS[rr * uint(WS) + q * 8u + 2u * c + 1u] = hp.y;
                }
            }
        }
        if (l == 0) {  // the encoded inputs: fp32, fp16 values once rounded
            [[unroll]] for (int it = 0; it < (RC * TILE / 4 + THREADS - 1) / THREADS; ++it) {
                uint i = tid + uint(it * THREADS);
                if (i >= uint(RC * TILE / 4)) break;
                uint rr = i / uint(TILE / 4), q = i - rr * uint(TILE / 4);
                int ck = k0 + int(q) * 4;
                uint at = (pc.row_base + r + rr) * uint(IN_PAD / 4) + uint(ck / 4);
                vec4 h = ck >= K ? vec4(0.0) : INPUT_F16 == 1 ? unpack_halves(XH4[at]) : pre_f16(X4[at]);
                [[unroll]] for (uint c = 0u; c < 4u; ++c) HS[rr * uint(WS) + q * 4u + c] = float16_t(h[c]);
            }
        }
        barrier();
        if (gl_WorkGroupID.y == 0u && tid < uint(BGROUPS * TILE))
            for (int rr = int(tid) / TILE; rr < RC; rr += BGROUPS) bias_acc += float(DS[rr * WS + int(tid) % TILE]);
        for (int kk = 0; kk < RC; kk += CM_K) {
            [[unroll]] for (int i = 0; i < WACC; ++i) {
                int b = int(gl_SubgroupID) * WACC + i;
                if (b >= WG_BLOCKS) break;
                int nb = b / (TILE / CM_N), kb = b - nb * (TILE / CM_N);
                if (n0 + nb * CM_M >= N || k0 + kb * CM_N >= K) continue;
                coopmat<float16_t, gl_ScopeSubgroup, CM_M, CM_K, gl_MatrixUseA> a;
                coopmat<float16_t, gl_ScopeSubgroup, CM_K, CM_N, gl_MatrixUseB> bm;
                coopMatLoad(a, DS, uint(kk * WS + nb * CM_M), uint(WS), gl_CooperativeMatrixLayoutColumnMajor);
                coopMatLoad(bm, HS, uint(kk * WS + kb * CM_N), uint(WS), gl_CooperativeMatrixLayoutRowMajor);
                acc[i] = coopMatMulAdd(a, bm, acc[i]);
            }
        }
    }
    uint base = (pc.split_base + split) * pc.gsize;
    [[unroll]] for (int i = 0; i < WACC; ++i) {
        int b = int(gl_SubgroupID) * WACC + i;
        if (b >= WG_BLOCKS) break;
        int nb = b / (TILE / CM_N), kb = b - nb * (TILE / CM_N);
        int n = n0 + nb * CM_M, k = k0 + kb * CM_N;
        if (n >= N || k >= K) continue;
        coopMatStore(acc[i], PART, base + uint(GW_OFF[l] + n * K + k), uint(K), gl_CooperativeMatrixLayoutRowMajor);
    }
    if (BGROUPS == 2) {  // the odd rows' sums join the even rows' (a fixed order)
        barrier();
        if (tid >= uint(TILE) && tid < uint(2 * TILE)) BSUM[tid - uint(TILE)] = bias_acc;
        barrier();
        if (tid < uint(TILE)) bias_acc += BSUM[tid];
    }
    if (gl_WorkGroupID.y == 0u && tid < uint(TILE) && n0 + int(tid) < N)
        PART[base + uint(GB_OFF[l] + n0 + int(tid))] = bias_acc;
}
