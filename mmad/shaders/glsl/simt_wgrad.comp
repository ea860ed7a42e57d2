#version 450
// Weight and bias gradients of one layer over one split of the batch (SIMT):
// PART[split] (N x K) = sum over the split's rows of delta (N) x h (K), h being the layer's
// fp16-rounded input (the encoded input for layer 0, act(z) of the previous layer otherwise).
// Splits are summed in a fixed order by the optimizer kernel: the reduction is deterministic.
layout(local_size_x = 256) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) readonly buffer InputBuf { vec4 X4[]; };
layout(std430, binding = 0) readonly buffer InputBuf16 { uvec2 XH4[]; };  // the same as fp16 (INPUT_F16)
layout(std430, binding = 1) readonly buffer ZBuf { vec4 Z4[]; };
layout(std430, binding = 2) readonly buffer DBuf { vec4 D4[]; };
layout(std430, binding = 3) writeonly buffer PartBuf { vec4 PART4[]; };
// row_base / split_base: this chunk's first input row and first partial-sum slot
layout(push_constant) uniform Push { uint rows_pad; uint layer; uint rows_per_split; uint gsize; int hidden_act; uint row_base; uint split_base; } pc;

shared vec4 DS[16 * 16];  // 16 rows x 64 delta columns
shared vec4 HS[16 * 16];  // 16 rows x 64 input columns

void main() {
    int l = int(pc.layer);
    int N = LAYER_N[l], K = LAYER_K[l];
    uint tid = gl_LocalInvocationID.x;
    int tn = int(tid) / 16, tk = int(tid) % 16;
    int n0 = int(gl_WorkGroupID.x) * 64, k0 = int(gl_WorkGroupID.y) * 64;
    uint split = gl_WorkGroupID.z;
    uint r_begin = split * pc.rows_per_split;
    uint r_end = min(r_begin + pc.rows_per_split, pc.rows_pad);
    uint dbase = uint(Z_COL[l]) * pc.rows_pad / 4u;
    uint zprev = l > 0 ? uint(Z_COL[max(l - 1, 0)]) * pc.rows_pad / 4u : 0u;
    int lrow = int(tid) / 16, q = int(tid) % 16;
    int load_n = n0 + q * 4, load_k = k0 + q * 4;
    vec4 acc[4] = vec4[4](vec4(0.0), vec4(0.0), vec4(0.0), vec4(0.0));
    vec4 bias_acc = vec4(0.0);
    for (uint r = r_begin; r < r_end; r += 16u) {
        uint row = r + uint(lrow);
        barrier();
        DS[tid] = load_n < N ? D4[dbase + row * uint(N / 4) + uint(load_n / 4)] : vec4(0.0);
        vec4 h = vec4(0.0);
        if (load_k < K) {
            uint at = (pc.row_base + row) * uint(IN_PAD / 4) + uint(load_k / 4);
            if (l == 0) h = r16(INPUT_F16 == 1 ? unpack_halves(XH4[at]) : X4[at]);
            else h = r16(activate4(HIDDEN_ACT, Z4[zprev + row * uint(K / 4) + uint(load_k / 4)]));
        }
        HS[tid] = h;
        barrier();
        for (int rr = 0; rr < 16; ++rr) {
            vec4 d = DS[rr * 16 + tn];
            vec4 hv = HS[rr * 16 + tk];
            acc[0] += d.x * hv;
            acc[1] += d.y * hv;
            acc[2] += d.z * hv;
            acc[3] += d.w * hv;
            bias_acc += d;
        }
    }
    int n = n0 + tn * 4, k = k0 + tk * 4;
    uint base = (pc.split_base + split) * pc.gsize;
    if (k < K) {
        for (int i = 0; i < 4; ++i)
            if (n + i < N) PART4[(base + uint(GW_OFF[l] + (n + i) * K + k)) / 4u] = acc[i];
    }
    if (gl_WorkGroupID.y == 0u && tk == 0 && n < N) PART4[(base + uint(GB_OFF[l] + n)) / 4u] = bias_acc;
}
