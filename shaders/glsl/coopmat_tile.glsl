// Tile product of the cooperative-matrix kernels: ACC(R x NOUT) (+)= A(R x KIN) . W(KIN x NOUT)
// with A in shared memory as fp16 and W loaded straight from the fp16 weight copy in global
// memory (small and cache-resident: no shared staging, no barriers in the loop). The output's
// CM_M x CM_N blocks are split among the subgroups: subgroup s owns blocks s*NACC ..
// s*NACC+NACC-1 (row-block major), accumulating in fp32.
// Needs: THREADS, R, KMAX, NACC, CM_M/CM_N/CM_K, a readonly float16_t buffer WALL16[].

#define ACC_T coopmat<float, gl_ScopeSubgroup, CM_M, CM_N, gl_MatrixUseAccumulator>
#define ACC16_T coopmat<float16_t, gl_ScopeSubgroup, CM_M, CM_N, gl_MatrixUseAccumulator>
#define A_T coopmat<float16_t, gl_ScopeSubgroup, CM_M, CM_K, gl_MatrixUseA>
#define B_T coopmat<float16_t, gl_ScopeSubgroup, CM_K, CM_N, gl_MatrixUseB>

shared float16_t ACT[2 * R * KMAX];  // two activation tiles, ping-pong

// block i of this subgroup: (row block, column block), or rb < 0 when past the last block
ivec2 block_of(int i, int nout) {
    int b = int(gl_SubgroupID) * NACC + i;
    int nbc = nout / CM_N;
    if (b >= (R / CM_M) * nbc) return ivec2(-1, 0);
    return ivec2(b / nbc, b - (b / nbc) * nbc);
}

void tile_mma(uint a_base, int kin, int nout, uint w_off, inout ACC_T acc[NACC]) {
    barrier();  // the A tile was written by other subgroups
    for (int kk = 0; kk < kin; kk += CM_K) {
        int last_rb = -1;
        A_T a;
        [[unroll]] for (int i = 0; i < NACC; ++i) {
            ivec2 blk = block_of(i, nout);
            if (blk.x < 0) break;
            if (blk.x != last_rb) {
                coopMatLoad(a, ACT, a_base + uint(blk.x * CM_M * kin + kk), uint(kin),
                            gl_CooperativeMatrixLayoutRowMajor);
                last_rb = blk.x;
            }
            B_T b;
            coopMatLoad(b, WALL16, w_off + uint(kk * nout + blk.y * CM_N), uint(nout),
                        gl_CooperativeMatrixLayoutRowMajor);
            acc[i] = coopMatMulAdd(a, b, acc[i]);
        }
    }
    barrier();  // every subgroup is done reading this A tile before it is overwritten
}
