// mmad wgpu backend: the kernels that are the same for every MLP shape.
//
// backends/webgpu.py prepends a generated prelude (the `CT` storage type, the rounding function
// `rnd`, the activations, the loss, the optimizer step and the shape constants P, N_OUT, OP_L,
// LOSS_SCALE, the scratch row strides ZS/HS and the last layer's column Z_LAST, ...) and appends
// the input encoding (with grid encodings their kernels), the fused forward/backward kernels and
// one weight-gradient entry point per layer.
//
// Everything is deterministic: reductions run in a fixed order, never with atomics.

struct Launch {
    n_rows: u32,          // valid rows of this chunk
    rows_per_split: u32,  // weight-gradient rows per split (multiple of 16)
    flags: u32,           // bit 0: first chunk of the step, bit 1: last chunk of the step
    loss_slot: u32,       // where the step's mean loss goes in `losses`
    inv_count: f32,       // 1 / (rows of the whole batch * n_output_dims)
    lr_t: f32,            // step size (Adam: bias-corrected) for this step
    n_splits: u32,        // weight-gradient splits of this chunk
    n_loss_wg: u32,       // workgroups the loss kernel ran with
    ema_keep: f32,        // EMA models: average·ema_keep + weights·ema_take (numerics.ema_factors)
    ema_take: f32,
    lr_base: f32,         // the step's rate without Adam's bias correction (grid tables: per-entry steps)
    sort_n: u32,          // grid models: table reads sorted this chunk (a power of two)
    sort_j: u32,          // grid_sort: the pass's compare distance
    sort_k: u32,          // grid_sort: the pass's merge size
}

@group(0) @binding(0) var<uniform> launch: Launch;
@group(0) @binding(1) var<storage, read_write> wc: array<CT>;        // compute-type weights
@group(0) @binding(2) var<storage, read_write> master: array<f32>;   // fp32 master params
@group(0) @binding(3) var<storage, read_write> grad: array<f32>;     // scaled gradient sums
@group(0) @binding(4) var<storage, read_write> mom1: array<f32>;     // Adam m / SGD velocity
@group(0) @binding(5) var<storage, read_write> mom2: array<f32>;     // Adam v
@group(0) @binding(6) var<storage, read_write> hbuf: array<CT>;      // layer inputs (chunk)
@group(0) @binding(7) var<storage, read_write> zbuf: array<f32>;     // pre-activations (chunk)
@group(0) @binding(8) var<storage, read_write> dbuf: array<CT>;      // layer output gradients
@group(0) @binding(9) var<storage, read_write> wpart: array<f32>;    // per-split weight grads
@group(0) @binding(10) var<storage, read_write> lpart: array<f32>;   // per-workgroup loss sums
@group(0) @binding(11) var<storage, read_write> losses: array<f32>;  // per-step mean losses
@group(1) @binding(0) var<storage, read> x_in: array<f32>;           // inputs (rows x N_IN)
@group(1) @binding(1) var<storage, read_write> y_out: array<f32>;    // outputs (rows x N_OUT)
@group(1) @binding(2) var<storage, read> targets: array<f32>;        // targets (rows x N_OUT)

const EW_WG: u32 = 256u;    // workgroup size of the element-wise kernels
const LOSS_ACC: u32 = 256u; // index in `losses` of the running sum over chunks

var<workgroup> red: array<f32, 256>;

fn sigmoid(z: f32) -> f32 {
    let e = exp(-abs(z));
    return select(e / (1.0 + e), 1.0 / (1.0 + e), z >= 0.0);
}

fn log1p_exp_neg_abs(z: f32) -> f32 {
    // log(1 + exp(-|z|)) without losing the small values (the log1p trick)
    let e = exp(-abs(z));
    let u = 1.0 + e;
    return select(log(u) * e / (u - 1.0), e, u == 1.0);
}

fn workgroup_sum(lid: u32, value: f32) -> f32 {
    red[lid] = value;
    workgroupBarrier();
    for (var stride = 128u; stride > 0u; stride = stride >> 1u) {
        if (lid < stride) {
            red[lid] = red[lid] + red[lid + stride];
        }
        workgroupBarrier();
    }
    let total = red[0];
    workgroupBarrier();
    return total;
}

// Loss of the last layer's output: writes the rounded, scaled output gradient (zero in the
// padding columns; rows past n_rows are left alone: the backward pass never reads them) and one partial loss sum per workgroup.
@compute @workgroup_size(256)
fn loss_grad(@builtin(global_invocation_id) gid: vec3<u32>,
             @builtin(local_invocation_index) lid: u32,
             @builtin(workgroup_id) wid: vec3<u32>,
             @builtin(num_workgroups) nwg: vec3<u32>) {
    let total = launch.n_rows * OP_L;
    var partial = 0.0;
    for (var e = gid.x; e < total; e = e + nwg.x * EW_WG) {
        let row = e / OP_L;
        let col = e % OP_L;
        var delta = 0.0;
        if (col < N_OUT) {
            let z = zbuf[row * ZS + Z_LAST + col];
            let pred = act_o(z);
            let lt = loss_terms(pred, targets[row * N_OUT + col], row);
            partial = partial + lt.x;
            delta = lt.y * launch.inv_count * LOSS_SCALE * dact_o(z);
        }
        dbuf[row * ZS + Z_LAST + col] = rnd(delta);
    }
    let s = workgroup_sum(lid, partial);
    if (lid == 0u) {
        lpart[wid.x] = s;
    }
}

// Sum of the loss partials of one chunk, carried over chunks; the last chunk stores the mean.
@compute @workgroup_size(256)
fn loss_reduce(@builtin(local_invocation_index) lid: u32) {
    var partial = 0.0;
    for (var i = lid; i < launch.n_loss_wg; i = i + EW_WG) {
        partial = partial + lpart[i];
    }
    let s = workgroup_sum(lid, partial);
    if (lid == 0u) {
        var acc = s;
        if ((launch.flags & 1u) == 0u) {
            acc = acc + losses[LOSS_ACC];
        }
        losses[LOSS_ACC] = acc;
        if ((launch.flags & 2u) != 0u) {
            losses[launch.loss_slot] = acc * launch.inv_count;
        }
    }
}

// grad (+)= sum of the per-split weight gradients of this chunk, splits in order.
@compute @workgroup_size(256)
fn grad_reduce(@builtin(global_invocation_id) gid: vec3<u32>,
               @builtin(num_workgroups) nwg: vec3<u32>) {
    for (var p = gid.x; p < P; p = p + nwg.x * EW_WG) {
        var s = 0.0;
        for (var k = 0u; k < launch.n_splits; k = k + 1u) {
            s = s + wpart[k * P + p];
        }
        if ((launch.flags & 1u) == 0u) {
            s = s + grad[p];
        }
        grad[p] = s;
    }
}

// One optimizer step on the fp32 masters (the MLP's, then the grid tables'); refreshes the
// compute-type copy (and, with tcnn's EMA wrapper, the average and its compute-type copy: the
// generated ema_update). The generated param_delta is the step of one parameter.
@compute @workgroup_size(256)
fn optimize(@builtin(global_invocation_id) gid: vec3<u32>,
            @builtin(num_workgroups) nwg: vec3<u32>) {
    for (var p = gid.x; p < P_ALL; p = p + nwg.x * EW_WG) {
        var w = master[p];
        w = w - param_delta(p, w);
        master[p] = w;
        wc[p] = rnd(w);
        ema_update(p, w);
    }
}
