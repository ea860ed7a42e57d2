// Shared-memory geometry of wgmma K-major fp16 operands, for the kernel and for host tests.
//
// A tile of ROWS (M or N) x COLS (K) halves is stored as CUTLASS's canonical GMMA layout
// (backends/layouts.py, wgmma_smem_operand): atoms of 8 rows x SWZ bytes, contiguous, tiled
// along the rows first, then along K; Swizzle<log2(SWZ/16), 4, 3> on byte offsets (bits 7..
// XORed into bits 4..). SWZ is 32, 64 or 128 and a tile starts on an 8 * SWZ byte boundary.
// tests/test_cuda_wgmma.py compiles this file with the host compiler and compares both
// functions with layouts.wgmma_smem_operand / wgmma_smem_descriptor for every geometry used.
#ifndef MMAD_WGMMA_LAYOUT_CUH
#define MMAD_WGMMA_LAYOUT_CUH

#ifdef __CUDACC__
#define MMAD_HD __host__ __device__ __forceinline__
#else
#define MMAD_HD static inline
#endif

// log2(SWZ / 16): the number of swizzled 16-byte-unit bits
MMAD_HD unsigned swizzle_bits(unsigned swz) { return swz == 128u ? 3u : (swz == 64u ? 2u : 1u); }

// byte offset of element (row, col) in a ROWS x K K-major tile with SWZ-byte swizzle
MMAD_HD unsigned kmajor_offset(unsigned row, unsigned col, unsigned rows, unsigned swz) {
    const unsigned width = swz / 2u;  // halves per atom row
    const unsigned o = ((col / width) * rows * width + (row / 8u) * 8u * width + (row % 8u) * width + col % width) * 2u;
    return o ^ (((o >> 7) & ((1u << swizzle_bits(swz)) - 1u)) << 4);
}

// the 64-bit matrix descriptor of k16 step ks of that tile, placed at shared address base
// (fields: start >> 4 in bits 0-13, LBO >> 4 in 16-29 (unused when swizzled: 16 B), SBO >> 4 in
// 32-45 (one 8-row atom, 8 * SWZ bytes), layout type in 62-63: 1 = 128B, 2 = 64B, 3 = 32B)
MMAD_HD unsigned long long kmajor_desc(unsigned base, unsigned ks, unsigned rows, unsigned swz) {
    const unsigned width = swz / 2u;
    const unsigned k = ks * 16u;
    const unsigned start = base + ((k / width) * rows * width + k % width) * 2u;
    const unsigned long long mode = swz == 128u ? 1ull : (swz == 64u ? 2ull : 3ull);
    return (unsigned long long)((start & 0x3FFFFu) >> 4) | (unsigned long long)(16u >> 4) << 16
           | (unsigned long long)(((8u * swz) & 0x3FFFFu) >> 4) << 32 | mode << 62;
}

// A descriptor from its fields (byte offsets; start a shared address): MN-major operands name
// both strides (LBO: between atom-wide blocks along M or N; SBO: between 8-row groups along K)
MMAD_HD unsigned long long smem_desc(unsigned start, unsigned lbo, unsigned sbo, unsigned swz) {
    const unsigned long long mode = swz == 128u ? 1ull : (swz == 64u ? 2ull : 3ull);
    return (unsigned long long)((start & 0x3FFFFu) >> 4) | (unsigned long long)((lbo & 0x3FFFFu) >> 4) << 16
           | (unsigned long long)((sbo & 0x3FFFFu) >> 4) << 32 | mode << 62;
}

// The transpose of a ROWS x K K-major tile (kmajor_offset) read as an MN-major K' x N' operand
// (K' = the tile's rows, N' = its K): k16 step ks covers rows [16 ks, 16 ks + 16). The tile's
// 8-row groups are the operand's 8-row K groups (SBO = 8 * SWZ) and its atom-wide column blocks
// the operand's N blocks (LBO = ROWS * SWZ). The backward reads each layer's resident forward
// weights this way: W^T without a second image.
MMAD_HD unsigned long long kmajor_as_mn_desc(unsigned base, unsigned ks, unsigned rows, unsigned swz) {
    return smem_desc(base + ks * 16u * swz, rows * swz, 8u * swz, swz);
}

// byte offset of element (row, col) of a ROWS-row fp16 tile stored as 128-byte-swizzled rows in
// blocks of 64 columns: the MN-major atoms (64 M or N x 8 K) of an operand whose K runs along
// the rows (the tile starts on a 1024-byte boundary)
MMAD_HD unsigned mn_rows_offset(unsigned row, unsigned col, unsigned rows) {
    return (col / 64u) * rows * 128u + row * 128u + ((((col % 64u) / 8u) ^ (row % 8u)) << 4) + (col % 8u) * 2u;
}

// the descriptor of k16 step ks (rows [16 ks, 16 ks + 16)) of that tile at shared address base
MMAD_HD unsigned long long mn_rows_desc(unsigned base, unsigned ks, unsigned rows) {
    return smem_desc(base + ks * 16u * 128u, rows * 128u, 1024u, 128u);
}

#endif  // MMAD_WGMMA_LAYOUT_CUH
