// Tile product of the SIMT kernels: OUT(R x NOUT) = A(R x KIN) . W(KIN x NOUT), A in shared
// memory (fp16-rounded values in fp32 storage), W streamed from global memory through a
// shared chunk of KC rows. Each invocation owns MTPT micro-tiles of MR rows x 4 columns
// (MR = 8 on GPUs: the weight vectors, distinct per invocation, are then reused 8 times).
// Needs: THREADS, R, KMAX, MTPT, MR, WCHUNK4 and a readonly vec4 buffer WALL4[].

shared vec4 ACT4[2 * R * KMAX / 4];   // two activation tiles, ping-pong
shared vec4 WSH4[WCHUNK4];            // the current chunk of weight rows

void tile_product(uint a_base, int kin, int nout, uint w_off, int kc, inout vec4 acc[MTPT * MR]) {
    uint tid = gl_LocalInvocationID.x;
    int ncols4 = nout / 4;
    int n_micro = (R / MR) * ncols4;
    [[unroll]] for (int j = 0; j < MTPT * MR; ++j) acc[j] = vec4(0.0);
    for (int k0 = 0; k0 < kin; k0 += kc) {
        int rows = min(kc, kin - k0);
        barrier();
        for (int i = int(tid); i < rows * ncols4; i += THREADS)
            WSH4[i] = WALL4[(w_off + uint(k0 * nout)) / 4u + uint(i)];
        barrier();
        [[unroll]] for (int j = 0; j < MTPT; ++j) {
            int mt = int(tid) + j * THREADS;
            if (mt >= n_micro) break;
            int rt = mt / ncols4, ct = mt - rt * ncols4;
            uint a_row = a_base / 4u + uint((rt * MR) * kin + k0) / 4u;
            uint a_stride = uint(kin) / 4u;
            for (int k = 0; k < rows; k += 4) {
                vec4 w0 = WSH4[(k + 0) * ncols4 + ct];
                vec4 w1 = WSH4[(k + 1) * ncols4 + ct];
                vec4 w2 = WSH4[(k + 2) * ncols4 + ct];
                vec4 w3 = WSH4[(k + 3) * ncols4 + ct];
                uint kq = uint(k) / 4u;
                [[unroll]] for (int r = 0; r < MR; ++r) {
                    vec4 a = ACT4[a_row + uint(r) * a_stride + kq];
                    acc[j * MR + r] += a.x * w0 + a.y * w1 + a.z * w2 + a.w * w3;
                }
            }
        }
    }
}
