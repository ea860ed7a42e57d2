#version 450
// The bitonic sort of a grid part's table reads (grid.comp, keys) by (table row, read id): ties
// are ordered by read id, so the sorted order is unique and the gather that follows sums in a
// fixed order. SORT_STAGE 0: one compare-exchange pass (merge size k, distance j) over the whole
// array, one invocation per pair. SORT_STAGE 1: the passes whose distance is below SORT_BLOCK stay
// inside aligned blocks of SORT_BLOCK reads, which one workgroup runs in shared memory: with k = 0
// every pass of the merge sizes up to SORT_BLOCK, else the short passes of merge size k.
// No header: one pipeline serves every grid model.
layout(local_size_x = 256) in;

#define SORT_BLOCK 512u

layout(std430, binding = 0) buffer KeyBuf { uint SKEY[]; };
layout(std430, binding = 1) buffer IdBuf { uint SID[]; };
layout(push_constant) uniform Push { uint sort_n; uint j; uint k; } pc;

#if SORT_STAGE == 0
void main() {
    uint j = pc.j, k = pc.k;
    for (uint t = gl_GlobalInvocationID.x; t < pc.sort_n / 2u; t += gl_NumWorkGroups.x * 256u) {
        uint i = ((t & ~(j - 1u)) << 1u) | (t & (j - 1u));  // t with a 0 bit inserted at j
        uint l = i | j;
        uint ki = SKEY[i], kl = SKEY[l], ii = SID[i], il = SID[l];
        bool greater = ki > kl || (ki == kl && ii > il);
        if (greater == ((i & k) == 0u)) {
            SKEY[i] = kl; SKEY[l] = ki; SID[i] = il; SID[l] = ii;
        }
    }
}
#else
shared uint BLOCK_KEY[SORT_BLOCK];
shared uint BLOCK_ID[SORT_BLOCK];

void block_pass(uint lid, uint base, uint j, uint k) {
    uint i = ((lid & ~(j - 1u)) << 1u) | (lid & (j - 1u));
    uint l = i | j;
    uint ki = BLOCK_KEY[i], kl = BLOCK_KEY[l], ii = BLOCK_ID[i], il = BLOCK_ID[l];
    bool greater = ki > kl || (ki == kl && ii > il);
    if (greater == (((base + i) & k) == 0u)) {
        BLOCK_KEY[i] = kl; BLOCK_KEY[l] = ki; BLOCK_ID[i] = il; BLOCK_ID[l] = ii;
    }
    barrier();
}

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint base = gl_WorkGroupID.x * SORT_BLOCK;
    BLOCK_KEY[lid] = SKEY[base + lid]; BLOCK_ID[lid] = SID[base + lid];
    BLOCK_KEY[lid + 256u] = SKEY[base + lid + 256u]; BLOCK_ID[lid + 256u] = SID[base + lid + 256u];
    barrier();
    if (pc.k == 0u) {
        for (uint k = 2u; k <= SORT_BLOCK; k <<= 1u)
            for (uint j = k >> 1u; j > 0u; j >>= 1u) block_pass(lid, base, j, k);
    } else {
        for (uint j = SORT_BLOCK >> 1u; j > 0u; j >>= 1u) block_pass(lid, base, j, pc.k);
    }
    SKEY[base + lid] = BLOCK_KEY[lid]; SID[base + lid] = BLOCK_ID[lid];
    SKEY[base + lid + 256u] = BLOCK_KEY[lid + 256u]; SID[base + lid + 256u] = BLOCK_ID[lid + 256u];
}
#endif
