#version 450
#extension GL_EXT_control_flow_attributes : enable
// Weight and bias gradients of one layer over one split of the batch with workgroup-scope
// cooperative matrices (GL_NV_cooperative_matrix2): PART[split] (N x K) = D^T (N x rows) . H (rows x K),
// a TN x TK tile of it per workgroup, BK rows a step. D^T is the fp16 deltas (D16, rows x N) read
// through a transposing tensor view; H the flagged fp16 activations (H16: a -0 multiplies as +0) or,
// for the first layer, the input rows (fp32, rounded to fp16 here, or fp16 device arrays). Tensor
// layouts with constant clamping read zeros past the layer's N and K and drop the stores there,
// so one tile shape serves every layer. The bias gradient is D^T times a column of ones (every
// product exact, summed in fp32; BIAS_N columns, the narrowest the device's shapes allow) in the
// workgroups of the first column tile. Accumulation is fp32
// in the hardware's fixed order: the same bits every run.
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
layout(local_size_x = THREADS) in;
#include "mlp_common.glsl"

layout(std430, binding = 0) restrict readonly buffer InputBuf { float X[]; };
layout(std430, binding = 0) restrict readonly buffer InputBuf16 { float16_t XH[]; };  // the same as fp16 (INPUT_F16)
layout(std430, binding = 1) restrict readonly buffer HBuf { float16_t H16[]; };
layout(std430, binding = 2) restrict readonly buffer DBuf { float16_t D16[]; };
layout(std430, binding = 3) restrict writeonly buffer PartBuf { float PART[]; };
// row_base / split_base: this chunk's first input row and first partial-sum slot
layout(push_constant) uniform Push { uint rows_pad; uint layer; uint rows_per_split; uint gsize; int hidden_act; uint row_base; uint split_base; } pc;

#define WACC coopmat<float, gl_ScopeWorkgroup, TN, TK, gl_MatrixUseAccumulator>
#define BACC coopmat<float, gl_ScopeWorkgroup, TN, BIAS_N, gl_MatrixUseAccumulator>
#define OPD coopmat<float16_t, gl_ScopeWorkgroup, TN, BK, gl_MatrixUseA>
#define OPH coopmat<float16_t, gl_ScopeWorkgroup, BK, TK, gl_MatrixUseB>

// rows x cols, row-major; reads past it give 0, stores past it are dropped
tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> clamped(uint rows, uint cols) {
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> t =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    return setTensorLayoutDimensionNV(t, rows, cols);
}

void main() {
    int l = int(pc.layer);
    uint N = uint(LAYER_N[l]), K = uint(LAYER_K[l]);
    uint n0 = gl_WorkGroupID.x * uint(TN), k0 = gl_WorkGroupID.y * uint(TK);
    uint split = gl_WorkGroupID.z;
    uint r_begin = split * pc.rows_per_split;
    uint r_end = min(r_begin + pc.rows_per_split, pc.rows_pad);
    // layer blocks of rows_pad x width halves from column Z_COL on
    uint dbase = uint(Z_COL[l]) * pc.rows_pad;
    uint hbase = l > 0 ? uint(Z_COL[max(l - 1, 0)]) * pc.rows_pad : 0u;
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> deltas = clamped(pc.rows_pad, N);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> acts = clamped(pc.rows_pad, K);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> inputs = clamped(pc.row_base + pc.rows_pad, K);
    tensorViewNV<2, false, 1, 0> transposed = createTensorViewNV(2, false, 1, 0);
    bool bias = gl_WorkGroupID.y == 0u;  // uniform: the first column tile sums the bias gradient too
    coopmat<float16_t, gl_ScopeWorkgroup, BK, BIAS_N, gl_MatrixUseB> ones = coopmat<float16_t, gl_ScopeWorkgroup, BK, BIAS_N, gl_MatrixUseB>(1.0);
    WACC acc = WACC(0.0);
    BACC bacc = BACC(0.0);
    for (uint r = r_begin; r < r_end; r += uint(BK)) {
        OPD d;
        coopMatLoadTensorNV(d, D16, dbase, sliceTensorLayoutNV(deltas, int(r), BK, int(n0), TN), transposed);
        OPH h;
        if (l > 0) {
            coopMatLoadTensorNV(h, H16, hbase, sliceTensorLayoutNV(acts, int(r), BK, int(k0), TK));
        } else if (INPUT_F16 == 1) {
            coopMatLoadTensorNV(h, XH, 0, sliceTensorLayoutNV(inputs, int(pc.row_base + r), BK, int(k0), TK));
        } else {  // the encoded inputs: fp32, fp16 values once rounded
            coopmat<float, gl_ScopeWorkgroup, BK, TK, gl_MatrixUseAccumulator> x32;
            coopMatLoadTensorNV(x32, X, 0, sliceTensorLayoutNV(inputs, int(pc.row_base + r), BK, int(k0), TK));
            [[unroll]] for (int e = 0; e < x32.length(); ++e) x32[e] = pre_f16(x32[e]);
            h = OPH(coopmat<float16_t, gl_ScopeWorkgroup, BK, TK, gl_MatrixUseAccumulator>(x32));
        }
        acc = coopMatMulAdd(d, h, acc);
        if (bias) bacc = coopMatMulAdd(d, ones, bacc);
    }
    uint base = (pc.split_base + split) * pc.gsize;
    coopMatStoreTensorNV(acc, PART, base + uint(GW_OFF[l]), sliceTensorLayoutNV(clamped(N, K), int(n0), TN, int(k0), TK));
    if (bias)  // column 0 of the sums (every column holds them) into the layer's N bias slots
        coopMatStoreTensorNV(bacc, PART, base + uint(GB_OFF[l]), sliceTensorLayoutNV(clamped(N, 1u), int(n0), TN, 0, BIAS_N));
}
