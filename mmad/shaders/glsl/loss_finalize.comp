#version 450
// Sums the per-tile loss partials in a fixed order (deterministic), records the step's mean
// loss in the control block and, for a training step, advances the step counter that the
// optimizer's bias correction reads.
layout(local_size_x = 256) in;

layout(std430, binding = 0) readonly buffer LossBuf { float LOSS_PART[]; };
layout(std430, binding = 1) buffer Control { uint step; uint base; uint pad0; uint pad1; float hist[]; } ctrl;
layout(push_constant) uniform Push { uint n_tiles; uint n_rows; uint n_out; uint advance; } pc;

shared float SUM[256];

void main() {
    uint tid = gl_LocalInvocationID.x;
    float s = 0.0;
    for (uint i = tid; i < pc.n_tiles; i += 256u) s += LOSS_PART[i];
    SUM[tid] = s;
    barrier();
    for (uint w = 128u; w > 0u; w >>= 1) {
        if (tid < w) SUM[tid] += SUM[tid + w];
        barrier();
    }
    if (tid == 0u) {
        float loss = SUM[0] / (float(pc.n_rows) * float(pc.n_out));
        if (pc.advance != 0u) {
            ctrl.hist[ctrl.step - ctrl.base] = loss;
            ctrl.step += 1u;
        } else {
            ctrl.hist[0] = loss;
        }
    }
}
