#version 450
// tiny-cuda-nn's grid encodings (HashGrid, DenseGrid, TiledGrid) on the device: one source, three
// kernels chosen by GRID_STAGE (backends/vulkan/__init__.py grid_header defines it and the parts'
// constants: GRID_* per grid part, LV_* per level of every part, HOST_* per parameter-free part).
//
// GRID_STAGE 0, encode: the first layer's input, rows_pad x IN_PAD fp32, from the kernel input
//   (rows x X_COLS: the raw input dims, then the host-encoded columns of the parameter-free parts):
//   a grid column interpolates the table's compute-type copy (encodings.grid_lookup: tcnn's fmaf
//   position (``position``), floor, smoothstep, dense index / coherent prime hash / index 0 per level, modulo the
//   level's rows, the weight multiplying the dims' factors in dim order); a host column is copied;
//   the padding columns are 0; an invocation per (row, level) computes the level's cell once and
//   all its features. The forward and layer 0's weight gradient read this buffer.
// GRID_STAGE 1, keys: every table read of grid part pc.part for rows row_base .. row_base + n_rows - 1
//   as (table row, read id) with its weight, read id = (row * levels + level) * corners + corner;
//   padded to the power of two sort_n with key 0xffffffff (sorts last). grid_sort.comp sorts them.
// GRID_STAGE 2, gather: each table row of part pc.part finds its run of the sorted reads (binary
//   search) and sums weight x d loss / d encoded input over it in read-id order (the order of the
//   cpu backend's bincount) into GGRAD (set on the first row chunk, added after). A row no read
//   touched gets exactly 0, which tcnn's grid Adam skips. No float atomics: deterministic.
// GRID_STAGE 3, scatter (devices with shaderBufferFloat32AtomicAdd, unless the sorted path is
//   asked for): every table read of part pc.part for rows row_base .. row_base + n_rows - 1 adds
//   weight x d loss / d encoded input into GGRAD with atomicAdd, as tiny-cuda-nn's backward does
//   (an invocation per (row, level): the cell once, then each corner's reads);
//   the order of the adds, so the last bits, varies from run to run.
// GRID_STAGE 4, zero: part pc.part's values of GGRAD set to 0 before its first scatter (a row no
//   read touched keeps exactly 0).
#if GRID_STAGE == 3
#extension GL_EXT_shader_atomic_float : require
#endif
layout(local_size_x = 256) in;

const uint PRIMES[4] = uint[4](1u, 2654435761u, 805459861u, 3674653429u);

#if GRID_STAGE == 0
layout(std430, binding = 0) readonly buffer InputBuf { float X[]; };      // rows_pad x X_COLS
layout(std430, binding = 1) readonly buffer TableBuf { float TABLE[]; };  // compute-type tables
layout(std430, binding = 2) writeonly buffer EncBuf { float ENC[]; };     // rows_pad x IN_PAD
layout(push_constant) uniform Push { uint rows_pad; } pc;
#elif GRID_STAGE == 1
layout(std430, binding = 0) readonly buffer InputBuf { float X[]; };
layout(std430, binding = 1) writeonly buffer KeyBuf { uint SKEY[]; };
layout(std430, binding = 2) writeonly buffer IdBuf { uint SID[]; };
layout(std430, binding = 3) writeonly buffer WeightBuf { float GWEIGHT[]; };  // by read id
layout(push_constant) uniform Push { uint row_base; uint n_rows; uint sort_n; uint part; } pc;
#elif GRID_STAGE == 2
layout(std430, binding = 0) readonly buffer KeyBuf { uint SKEY[]; };
layout(std430, binding = 1) readonly buffer IdBuf { uint SID[]; };
layout(std430, binding = 2) readonly buffer WeightBuf { float GWEIGHT[]; };
layout(std430, binding = 3) readonly buffer DinBuf { float DIN[]; };      // rows_pad x IN_PAD, x LOSS_SCALE
layout(std430, binding = 4) buffer GradBuf { float GGRAD[]; };            // the tables' gradients, x LOSS_SCALE
layout(push_constant) uniform Push { uint row_base; uint sort_n; uint part; uint first; } pc;
#elif GRID_STAGE == 3
layout(std430, binding = 0) readonly buffer InputBuf { float X[]; };
layout(std430, binding = 1) readonly buffer DinBuf { float DIN[]; };      // rows_pad x IN_PAD, x LOSS_SCALE
layout(std430, binding = 2) buffer GradBuf { float GGRAD[]; };            // the tables' gradients, x LOSS_SCALE
layout(push_constant) uniform Push { uint row_base; uint n_rows; uint part; } pc;
#else
layout(std430, binding = 0) writeonly buffer GradBuf { float GGRAD[]; };
layout(push_constant) uniform Push { uint part; } pc;
#endif

#if GRID_STAGE < 2 || GRID_STAGE == 3
// tcnn's fmaf(x, scale, 0.5): x * scale + 0.5 rounded once. GLSL's fma() need not be fused (lavapipe
// computes a multiply and an add, 0.07182813 for 0.07182801), so the product is made exact
// instead: Dekker's product (Veltkamp splits at 2^12 + 1) gives x * scale = p + e exactly, Knuth's
// sum p + 0.5 = s + t exactly, and s + (t + e) rounds the whole once but in rare ties. ``precise``
// keeps every operation as written (no contraction, no reassociation).
float position(float x, float scale) {
    precise float cx = 4097.0 * x, xh = cx - (cx - x), xl = x - xh;
    precise float cs = 4097.0 * scale, sh = cs - (cs - scale), sl = scale - sh;
    precise float p = x * scale;
    precise float e = ((xh * sh - p) + xh * sl + xl * sh) + xl * sl;
    precise float s = p + 0.5;
    precise float b = s - p;
    precise float t = (p - (s - b)) + (0.5 - b);
    precise float pos = s + (t + e);
    return pos;
}

// one (grid part k, input row, level): per dim the cell's low corner coordinate and the weights
// of the low and the high corner (tcnn's position, floor, smoothstep), computed once for all of
// the level's corners
struct LevelCell { uint c[4]; float lo[4]; float hi[4]; };

LevelCell level_cell(uint k, uint row, uint level) {
    LevelCell cell;
    float scale = LV_SCALE[uint(GRID_LEVEL0[k]) + level];
    for (uint d = 0u; d < uint(GRID_DIMS[k]); ++d) {
        float pos = position(X[row * uint(X_COLS) + uint(GRID_BEGIN[k]) + d], scale);
        float fl = floor(pos);
        precise float frac = pos - fl;
        if (GRID_INTERP[k] == 2) frac = frac * frac * (3.0 - 2.0 * frac);  // Smoothstep
        precise float low = 1.0 - frac;
        cell.c[d] = uint(int(fl));  // tcnn's (uint32_t)(int)floorf(pos), wrapping
        cell.lo[d] = low;
        cell.hi[d] = frac;
    }
    return cell;
}

// (table row of the whole parameter, weight) of one corner of a level's cell
void cell_corner(uint k, uint level, LevelCell cell, uint corner, out uint entry, out float weight) {
    uint lv = uint(GRID_LEVEL0[k]) + level;
    uint index = 0u, stride = 1u;
    precise float w = 1.0;
    for (uint d = 0u; d < uint(GRID_DIMS[k]); ++d) {
        uint bit = (corner >> d) & 1u;
        uint c = cell.c[d] + bit;
        if (LV_MODE[lv] == 1u) {
            index ^= c * PRIMES[d];
        } else {
            index += c * stride;
            stride *= LV_RES[lv];
        }
        if (GRID_INTERP[k] != 1) w *= bit == 1u ? cell.hi[d] : cell.lo[d];  // Nearest: weight 1
    }
    weight = w;
    if (LV_MODE[lv] == 2u) index = 0u;  // tcnn's stride 2^32 - 1 past 32 bits
    entry = LV_START[lv] + index % LV_ROWS[lv];
}

// (table row of the whole parameter, weight) of one read: grid part k, input row ``row``
void grid_corner(uint k, uint row, uint level, uint corner, out uint entry, out float weight) {
    cell_corner(k, level, level_cell(k, row, level), corner, entry, weight);
}

// the grid part and level of the j-th level of every part's levels
uint part_of_level(uint j) {
    uint k = 0u;
    while (k + 1u < uint(GRID_PARTS) && j >= uint(GRID_LEVEL0[k + 1u])) ++k;
    return k;
}
#endif

#if GRID_STAGE == 0
// a host-encoded part's column, or 0 (padding)
float other_value(uint row, uint c) {
    for (int h = 0; h < HOST_PARTS; ++h) {
        if (c >= uint(HOST_COLUMN[h]) && c < uint(HOST_COLUMN[h] + HOST_WIDTH[h]))
            return X[row * uint(X_COLS) + uint(HOST_SRC[h]) + c - uint(HOST_COLUMN[h])];
    }
    return 0.0;
}

// an item per (row, level of any grid part): the level's cell once, its features summed in fp32
// in corner order (no fused multiply-add: the oracle's products and sums); then an item per
// (row, other column): copied or zero
void main() {
    uint per_row = uint(GRID_TOTAL_LEVELS + OTHER_COLS);
    uint total = pc.rows_pad * per_row;
    for (uint i = gl_GlobalInvocationID.x; i < total; i += gl_NumWorkGroups.x * 256u) {
        uint row = i / per_row, j = i - row * per_row;
        if (j >= uint(GRID_TOTAL_LEVELS)) {
            uint c = uint(OTHER_COLUMN[j - uint(GRID_TOTAL_LEVELS)]);
            ENC[row * uint(IN_PAD) + c] = other_value(row, c);
            continue;
        }
        uint k = part_of_level(j);
        uint level = j - uint(GRID_LEVEL0[k]), features = uint(GRID_FEATURES[k]);
        LevelCell cell = level_cell(k, row, level);
        precise float acc[MAX_FEATURES];
        for (uint f = 0u; f < features; ++f) acc[f] = 0.0;
        for (uint corner = 0u; corner < uint(GRID_CORNERS[k]); ++corner) {
            uint entry;
            float weight;
            cell_corner(k, level, cell, corner, entry, weight);
            uint at = uint(GRID_TABLE[k]) + entry * features;
            for (uint f = 0u; f < features; ++f) acc[f] += weight * TABLE[at + f];
        }
        uint out_col = row * uint(IN_PAD) + uint(GRID_COLUMN[k]) + level * features;
        for (uint f = 0u; f < features; ++f) ENC[out_col + f] = acc[f];
    }
}
#elif GRID_STAGE == 1
void main() {
    uint k = pc.part;
    uint lc = uint(GRID_LEVELS[k] * GRID_CORNERS[k]);
    uint reads = pc.n_rows * lc;
    for (uint i = gl_GlobalInvocationID.x; i < pc.sort_n; i += gl_NumWorkGroups.x * 256u) {
        SID[i] = i;
        if (i < reads) {
            uint entry;
            float weight;
            grid_corner(k, pc.row_base + i / lc, (i % lc) / uint(GRID_CORNERS[k]), i % uint(GRID_CORNERS[k]),
                        entry, weight);
            SKEY[i] = entry;
            GWEIGHT[i] = weight;
        } else {
            SKEY[i] = 0xffffffffu;
        }
    }
}
#elif GRID_STAGE == 2
uint lower_bound(uint key) {
    uint lo = 0u, hi = pc.sort_n;
    while (lo < hi) {
        uint mid = (lo + hi) / 2u;
        if (SKEY[mid] < key) lo = mid + 1u; else hi = mid;
    }
    return lo;
}

void main() {
    uint k = pc.part;
    uint features = uint(GRID_FEATURES[k]), corners = uint(GRID_CORNERS[k]);
    uint lc = uint(GRID_LEVELS[k]) * corners;
    for (uint e = gl_GlobalInvocationID.x; e < uint(GRID_ENTRIES[k]); e += gl_NumWorkGroups.x * 256u) {
        float acc[MAX_FEATURES];
        for (uint f = 0u; f < features; ++f) acc[f] = 0.0;
        uint end = lower_bound(e + 1u);
        for (uint s = lower_bound(e); s < end; ++s) {
            uint id = SID[s];
            uint base = (pc.row_base + id / lc) * uint(IN_PAD) + uint(GRID_COLUMN[k]) + (id % lc) / corners * features;
            float w = GWEIGHT[id];
            for (uint f = 0u; f < features; ++f) acc[f] += w * DIN[base + f];
        }
        for (uint f = 0u; f < features; ++f) {
            uint p = uint(GRID_TABLE[k]) + e * features + f;
            GGRAD[p] = pc.first != 0u ? acc[f] : GGRAD[p] + acc[f];
        }
    }
}
#elif GRID_STAGE == 3
// an item per (row, level): the level's cell once, then every corner's adds
void main() {
    uint k = pc.part;
    uint features = uint(GRID_FEATURES[k]), levels = uint(GRID_LEVELS[k]);
    uint items = pc.n_rows * levels;
    for (uint i = gl_GlobalInvocationID.x; i < items; i += gl_NumWorkGroups.x * 256u) {
        uint row = pc.row_base + i / levels, level = i % levels;
        LevelCell cell = level_cell(k, row, level);
        uint base = row * uint(IN_PAD) + uint(GRID_COLUMN[k]) + level * features;
        for (uint corner = 0u; corner < uint(GRID_CORNERS[k]); ++corner) {
            uint entry;
            float weight;
            cell_corner(k, level, cell, corner, entry, weight);
            for (uint f = 0u; f < features; ++f)
                atomicAdd(GGRAD[uint(GRID_TABLE[k]) + entry * features + f], weight * DIN[base + f]);
        }
    }
}
#else
void main() {
    uint k = pc.part;
    uint values = uint(GRID_ENTRIES[k]) * uint(GRID_FEATURES[k]);
    for (uint e = gl_GlobalInvocationID.x; e < values; e += gl_NumWorkGroups.x * 256u)
        GGRAD[uint(GRID_TABLE[k]) + e] = 0.0;
}
#endif
