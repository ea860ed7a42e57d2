#version 450
// The next batch of a held dataset, in the epoch's order (numerics.epoch_rows), copied into the
// training batch buffers in their padded layout: rows_pad x IN_PAD fp32 inputs and
// rows_pad x OUT_PAD fp32 targets, zero in the padding rows and columns (what _stage_batch
// writes). One workgroup per batch row; its invocations walk the same order, then copy the
// columns. The position comes from the control block, so one recorded program draws
// consecutive batches when it is submitted several times: step k of a submission
// (ctrl.step - ctrl.base, read before loss_finalize advances ctrl.step) takes batch
// pos_batch + k counted from epoch pos_epoch (both written by the host once per submission).
// The dataset is stored compact (x_cols / y_cols columns a row): fp32 words, or fp16 packed
// two to a word (read with unpackHalf2x16: exact, no 16-bit storage needed).
layout(local_size_x = 64) in;

layout(std430, binding = 0) readonly buffer DataX { uint DX[]; };
layout(std430, binding = 1) readonly buffer DataY { uint DY[]; };
layout(std430, binding = 2) writeonly buffer BatchX { float BX[]; };
layout(std430, binding = 3) writeonly buffer BatchY { float BY[]; };
layout(std430, binding = 4) readonly buffer Control { uint step; uint base; uint pos_epoch; uint pos_batch; } ctrl;
layout(push_constant) uniform Push {
    uint rows; uint half_bits; uint batch; uint per_epoch; uint seed;
    uint x_cols; uint x_half; uint in_pad; uint y_cols; uint y_half; uint out_pad; uint groups_x;
} pc;

uint mix32(uint x) {  // lowbias32 (numerics.mix32)
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}

// numerics.epoch_rows, one position: a keyed four-round Feistel network on 2*half_bits bits,
// cycle-walked into [0, rows)
uint epoch_row(uint seed, uint epoch, uint rows, uint half_bits, uint position) {
    uint keys[4];
    for (uint r = 0u; r < 4u; ++r) keys[r] = mix32(seed ^ mix32(epoch * 4u + r + 1u));
    uint mask = (1u << half_bits) - 1u;
    uint v = position;
    do {
        uint left = v >> half_bits, right = v & mask;
        for (uint r = 0u; r < 4u; ++r) {
            uint next = left ^ (mix32(right ^ keys[r]) & mask);
            left = right;
            right = next;
        }
        v = (left << half_bits) | right;
    } while (v >= rows);
    return v;
}

float read_x(uint e) {
    if (pc.x_half != 0u) {
        vec2 pair = unpackHalf2x16(DX[e >> 1]);
        return (e & 1u) != 0u ? pair.y : pair.x;
    }
    return uintBitsToFloat(DX[e]);
}

float read_y(uint e) {
    if (pc.y_half != 0u) {
        vec2 pair = unpackHalf2x16(DY[e >> 1]);
        return (e & 1u) != 0u ? pair.y : pair.x;
    }
    return uintBitsToFloat(DY[e]);
}

void main() {
    uint r = gl_WorkGroupID.y * pc.groups_x + gl_WorkGroupID.x;  // the batch row (padded rows too)
    uint lane = gl_LocalInvocationID.x;
    if (r < pc.batch) {
        uint done = ctrl.pos_batch + (ctrl.step - ctrl.base);
        uint epoch = ctrl.pos_epoch + done / pc.per_epoch;
        uint position = (done % pc.per_epoch) * pc.batch + r;
        uint src = epoch_row(pc.seed, epoch, pc.rows, pc.half_bits, position);
        for (uint c = lane; c < pc.in_pad; c += 64u)
            BX[r * pc.in_pad + c] = c < pc.x_cols ? read_x(src * pc.x_cols + c) : 0.0;
        for (uint c = lane; c < pc.out_pad; c += 64u)
            BY[r * pc.out_pad + c] = c < pc.y_cols ? read_y(src * pc.y_cols + c) : 0.0;
    } else {
        for (uint c = lane; c < pc.in_pad; c += 64u) BX[r * pc.in_pad + c] = 0.0;
        for (uint c = lane; c < pc.out_pad; c += 64u) BY[r * pc.out_pad + c] = 0.0;
    }
}
