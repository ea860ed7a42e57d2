// Tile product of the cooperative-matrix kernels: ACC(R x NOUT) (+)= A(R x KIN) . W(KIN x NOUT)
// with A in shared memory as fp16 and W read from the fp16 weight copy in global memory
// (small and cache-resident). Subgroup s owns the output column blocks s % SG_COLS + j * SG_COLS
// (NCJ of them at the widest layer) over the NRB row blocks of its row group s / SG_COLS
// (coopmat_tiling in backends/vulkan): each B block is loaded once per subgroup and layer and
// reused NRB times, each A block once per (row block, k step).
// The activation tile has a padded row stride (AS = KMAX + 8 halves) so that the 16-byte row
// pieces of a block load/store fall in different shared-memory banks.
// Needs: THREADS, SUBGROUPS, SG_COLS, R, KMAX, AS, NRB, NCJ, NACC, CM_M/CM_N/CM_K, a readonly float16_t
// buffer WALL16[].

#define ACC_T coopmat<float, gl_ScopeSubgroup, CM_M, CM_N, gl_MatrixUseAccumulator>
#define ACC16_T coopmat<float16_t, gl_ScopeSubgroup, CM_M, CM_N, gl_MatrixUseAccumulator>
#define A_T coopmat<float16_t, gl_ScopeSubgroup, CM_M, CM_K, gl_MatrixUseA>
#define B_T coopmat<float16_t, gl_ScopeSubgroup, CM_K, CM_N, gl_MatrixUseB>

shared float16_t ACT[R * AS];  // the activation tile: read by every subgroup, then overwritten
ACC_T acc[NACC];               // accumulator j * NRB + rb: column block slot j, row block rb

// column block of this subgroup's slot j
int col_block(int j) {
    return int(gl_SubgroupID) % SG_COLS + j * SG_COLS;
}
// row block of the tile of this subgroup's row block rb
int row_block(int rb) {
    return int(gl_SubgroupID) / SG_COLS * NRB + rb;
}

void tile_mma(int kin, int nout, uint w_off) {
    barrier();  // the A tile was written by other subgroups
    int ncb = nout / CM_N;
    if (col_block(0) < ncb) {  // uniform per subgroup: narrow layers leave some idle
        for (int kk = 0; kk < kin; kk += CM_K) {
            B_T b[NCJ];
            [[unroll]] for (int j = 0; j < NCJ; ++j) {
                if (col_block(j) < ncb)
                    coopMatLoad(b[j], WALL16, w_off + uint(kk * nout + col_block(j) * CM_N), uint(nout),
                                gl_CooperativeMatrixLayoutRowMajor);
            }
            [[unroll]] for (int rb = 0; rb < NRB; ++rb) {
                A_T a;
                coopMatLoad(a, ACT, uint(row_block(rb) * CM_M * AS + kk), uint(AS), gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (int j = 0; j < NCJ; ++j) {
                    if (col_block(j) < ncb) acc[j * NRB + rb] = coopMatMulAdd(a, b[j], acc[j * NRB + rb]);
                }
            }
        }
    }
    barrier();  // every subgroup is done reading the A tile before it is overwritten
}
