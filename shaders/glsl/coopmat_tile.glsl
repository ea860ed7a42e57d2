// Tile product of the cooperative-matrix kernels: ACC(R x NOUT) (+)= A(R x KIN) . W(KIN x NOUT)
// with A in shared memory as fp16 and W streamed from global memory (fp16-rounded fp32) into a
// shared fp16 chunk of KC rows. The output's CM_M x CM_N blocks are split among the subgroups:
// subgroup s owns blocks s*NACC .. s*NACC+NACC-1 (row-block major), accumulating in fp32.
// Needs: THREADS, R, KMAX, NACC, WCHUNK (halves), CM_M/CM_N/CM_K, a readonly float WALL[].

#define ACC_T coopmat<float, gl_ScopeSubgroup, CM_M, CM_N, gl_MatrixUseAccumulator>
#define ACC16_T coopmat<float16_t, gl_ScopeSubgroup, CM_M, CM_N, gl_MatrixUseAccumulator>
#define A_T coopmat<float16_t, gl_ScopeSubgroup, CM_M, CM_K, gl_MatrixUseA>
#define B_T coopmat<float16_t, gl_ScopeSubgroup, CM_K, CM_N, gl_MatrixUseB>

shared float16_t ACT[2 * R * KMAX];  // two activation tiles, ping-pong
shared float16_t WSH[WCHUNK];        // the current chunk of weight rows

// block i of this subgroup: (row block, column block), or rb < 0 when past the last block
ivec2 block_of(int i, int nout) {
    int b = int(gl_SubgroupID) * NACC + i;
    int nbc = nout / CM_N;
    if (b >= (R / CM_M) * nbc) return ivec2(-1, 0);
    return ivec2(b / nbc, b - (b / nbc) * nbc);
}

void tile_mma(uint a_base, int kin, int nout, uint w_off, int kc, inout ACC_T acc[NACC]) {
    uint tid = gl_LocalInvocationID.x;
    for (int k0 = 0; k0 < kin; k0 += kc) {
        int rows = min(kc, kin - k0);
        barrier();
        for (int i = int(tid); i < rows * nout; i += THREADS)
            WSH[i] = float16_t(WALL[w_off + uint(k0 * nout + i)]);
        barrier();
        for (int kk = 0; kk < rows; kk += CM_K) {
            int last_rb = -1;
            A_T a;
            for (int i = 0; i < NACC; ++i) {
                ivec2 blk = block_of(i, nout);
                if (blk.x < 0) break;
                if (blk.x != last_rb) {
                    coopMatLoad(a, ACT, a_base + uint(blk.x * CM_M * kin + k0 + kk), uint(kin),
                                gl_CooperativeMatrixLayoutRowMajor);
                    last_rb = blk.x;
                }
                B_T b;
                coopMatLoad(b, WSH, uint(kk * nout + blk.y * CM_N), uint(nout), gl_CooperativeMatrixLayoutRowMajor);
                acc[i] = coopMatMulAdd(a, b, acc[i]);
            }
        }
    }
}
