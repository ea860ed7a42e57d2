"""WGSL generation for the wgpu backend: the shape plan (rows per workgroup, weight stages that
fit the adapter's workgroup memory) and one WGSL module per model (``generate_wgsl``), built
from ``mmad/shaders/wgsl/mlp_common.wgsl`` plus generated kernels (see the package docstring).
Needs no adapter: the plan and the source are pure functions of the spec and the limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmad.backends import numerics as nm
from mmad.backends.encodings import HASH_PRIMES, GridPart, grid_input_layout
from mmad.errors import SpecError
from mmad.shaders import read_source
from mmad.spec import MLPSpec

THREADS = 256              # invocations of the fused forward/backward workgroups
MAX_CHUNK_ROWS = 65536
MAX_ACCUMULATORS = 64      # fp32 accumulators per invocation in the fused kernels
# a grid model's training chunk holds at most this many table reads (rows × levels × corners),
# the entries its gradient reduction sorts (webgpu/__init__.py sizes the sort buffers for it)
MAX_GRID_LOOKUPS = 1 << 22
SORT_BLOCK = 512           # the table reads one workgroup sorts in workgroup memory (2 per invocation)


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- the shape plan -------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    """One GEMM of a fused kernel: out[R x n] = A[R x k] @ B[k x n]."""

    layer: int
    k: int    # reduction size (padded to 16)
    n: int    # output width (padded to 16)
    kc: int   # reduction rows of B staged per workgroup-memory chunk


@dataclass(frozen=True)
class Plan:
    n_in: int               # the encoded width: columns of the first layer's input
    n_out: int
    kp: tuple[int, ...]     # padded fan_in per layer
    op: tuple[int, ...]     # padded fan_out per layer
    hidden: int
    ct_bytes: int
    rows: int               # R: rows per fused workgroup
    fwd_kcx: int            # columns of the streamed A chunk (first forward stage)
    fwd_wsh: int            # vec4 slots of the forward weight staging area
    bwd_kcx: int
    bwd_wsh: int
    fwd: tuple[Stage, ...]
    bwd: tuple[Stage, ...]
    chunk_rows: int         # largest training chunk
    fwd_chunk_rows: int     # inference chunk
    n_splits_max: int
    woff: tuple[int, ...]
    boff: tuple[int, ...]
    p: int
    hoff: tuple[int, ...]
    zoff: tuple[int, ...]
    # the kernel input's columns: the encoded width when the host encodes everything; with grid
    # parts the raw input dims, then the host-encoded columns of the parameter-free parts
    n_x: int = 0
    grids: tuple[GridPart, ...] = ()
    # (first encoded column, width, column in the kernel input) of each host-encoded part (grid models)
    host_parts: tuple[tuple[int, int, int], ...] = ()
    p_all: int = 0          # p plus the grid tables' values (they follow the MLP's parameters)

    @property
    def n_layers(self) -> int:
        return len(self.kp)

    @property
    def max_lookups(self) -> int:
        """Table reads per row of the grid part that reads the most (0 without grids)."""
        return max((g.lookups for g in self.grids), default=0)


def _fit_stages(dims: list[tuple[int, int, int]], rows: int, act_bytes: int, budget: int, cb: int,
                max_kc: int):
    """Chunk sizes for stages (layer, k, n); None when they cannot fit at this row count."""
    first_k, first_n = dims[0][1], min(dims[0][2], 256)
    kcx = 0
    for kc in range(min(first_k, 256, max_kc), 15, -16):
        if act_bytes + kc * (rows + first_n) * cb <= budget:
            kcx = kc
            break
    if not kcx:
        return None
    room = budget - act_bytes - rows * kcx * cb
    stages, wsh = [], 0
    for layer, k, n in dims:
        ng = min(n, 256)
        kc = kcx if layer == dims[0][0] else min(k, max_kc, (room // (ng * cb)) // 16 * 16)
        if kc < 16:
            return None
        stages.append(Stage(layer, k, n, kc))
        wsh = max(wsh, kc * ng // 4)
    return kcx, tuple(stages), wsh


def make_plan(spec: MLPSpec, limits: dict[str, int], ct_bytes: int, max_stage_rows: int = 4096) -> Plan:
    """Tile sizes for ``spec`` on an adapter with ``limits``.

    ``max_stage_rows`` caps the weight rows staged per chunk (a multiple of 16). Hardware adapters
    stage whole layers whenever they fit; CPU adapters use 16, because lavapipe's LLVM unrolls a
    whole staged chunk and compile times grow several-fold with it (M: 47 s vs 17 s per pipeline).
    """
    dims = spec.layer_dims
    kp = tuple(pad16(i) for i, _ in dims)
    op = tuple(pad16(o) for _, o in dims)
    hidden = spec.n_neurons
    budget = int(limits["max-compute-workgroup-storage-size"])
    n_layers = len(dims)
    widest = max(max(op), max(kp[1:]))
    for rows in (128, 64, 32, 16, 8, 4):
        if rows * min(widest, 256) // THREADS > MAX_ACCUMULATORS:
            continue
        act_bytes = rows * hidden * ct_bytes
        fwd = _fit_stages([(i, kp[i], op[i]) for i in range(n_layers)], rows, act_bytes, budget, ct_bytes,
                          max_stage_rows)
        # with grid parts the backward also runs through the first layer: d loss / d encoded input
        last_bwd = -1 if spec.grid_shapes else 0
        bwd = _fit_stages([(i, op[i], kp[i]) for i in range(n_layers - 1, last_bwd, -1)], rows, act_bytes, budget,
                          ct_bytes, max_stage_rows)
        if fwd and bwd:
            break
    else:
        raise SpecError("network", f"the model does not fit the adapter's {budget} bytes of workgroup memory")
    woff, boff, p = [], [], 0
    for i in range(n_layers):
        woff.append(p)
        p += op[i] * kp[i]
        boff.append(p)
        p += op[i]
    # without grids the host encodes everything: the kernel input is the encoded input
    grids, host_parts, n_x = grid_input_layout(spec, p) if spec.grid_shapes else ((), (), spec.n_encoded_dims)
    binding = int(limits["max-storage-buffer-binding-size"])
    p_all = p + sum(g.entries * g.features for g in grids)
    if p_all * 4 > binding:  # every parameter buffer (masters, gradients, moments) is bound whole
        raise SpecError("encoding", f"the layers and grid tables hold {p_all:,} values; this adapter binds at most "
                                    f"{binding // 4:,} fp32 values in one buffer (max-storage-buffer-binding-size): "
                                    "use a smaller log2_hashmap_size or fewer levels on wgpu")
    per_row_z = 4 * sum(op)
    max_lookups = max((g.lookups for g in grids), default=0)
    chunk = MAX_CHUNK_ROWS
    while chunk > 256 and (chunk * per_row_z > min(binding, 256 << 20)
                           or chunk * 4 * max(n_x, spec.n_output_dims) > binding
                           or chunk * max_lookups > MAX_GRID_LOOKUPS):
        chunk //= 2
    fwd_chunk = 256
    max_groups = int(limits["max-compute-workgroups-per-dimension"])
    while (fwd_chunk * 2 <= min(1 << 20, max_groups * rows)
           and fwd_chunk * 2 * 4 * max(n_x, spec.n_output_dims) <= binding):
        fwd_chunk *= 2
    n_splits = max(1, min(128, chunk // 256, (64 << 20) // (4 * p)))
    # row-major scratch: row r of layer i's input at hbuf[r * HS + hoff[i]], its
    # pre-activation / output gradient at zbuf / dbuf[r * ZS + zoff[i]]
    hoff = [sum(kp[:i]) for i in range(n_layers)]
    zoff = [sum(op[:i]) for i in range(n_layers)]
    return Plan(spec.n_encoded_dims, spec.n_output_dims, kp, op, hidden, ct_bytes, rows,
                 fwd[0], fwd[2], bwd[0], bwd[2], fwd[1], bwd[1], chunk, fwd_chunk, n_splits, tuple(woff), tuple(boff), p,
                 tuple(hoff), tuple(zoff), n_x, grids, host_parts, p_all)


# -- WGSL generation ------------------------------------------------------------------------
_ACT = {
    "None": ("z", "1.0"),
    "ReLU": ("max(z, 0.0)", "select(0.0, 1.0, z > 0.0)"),
    "LeakyReLU": (f"select(z * {nm.LEAKY_SLOPE}, z, z > 0.0)", f"select({nm.LEAKY_SLOPE}, 1.0, z > 0.0)"),
    "Sigmoid": ("sigmoid(z)", "sigmoid(z) * (1.0 - sigmoid(z))"),
    "Tanh": ("tanh(clamp(z, -20.0, 20.0))", "1.0 - tanh(clamp(z, -20.0, 20.0)) * tanh(clamp(z, -20.0, 20.0))"),
    "SiLU": ("z * sigmoid(z)", "sigmoid(z) * (1.0 + z * (1.0 - sigmoid(z)))"),
    "Softplus": ("max(z, 0.0) + log1p_exp_neg_abs(z)", "sigmoid(z)"),
    "Squareplus": ("select(0.5 * (z + sqrt(z * z + 4.0)), 2.0 / (sqrt(z * z + 4.0) - z), z < 0.0)",
                   "0.5 * (1.0 + z / sqrt(z * z + 4.0))"),
    "Exponential": ("exp(z)", "exp(z)"),
    "Sine": ("sin(z)", "cos(z)"),
}

_LOSS_NORMALISER = {  # normalisers of the relative losses (tiny-cuda-nn holds them constant)
    "RelativeL2": f"p * p + {nm.LOSS_EPSILON}",
    "RelativeL1": f"abs(p) + {nm.LOSS_EPSILON}",
    "MAPE": f"abs(t) + {nm.LOSS_EPSILON}",
    "SMAPE": f"abs(p) + abs(t) + {nm.LOSS_EPSILON}",
}


def _f(v: float) -> str:
    """A WGSL f32 literal."""
    text = repr(float(v))
    if "inf" in text or "nan" in text:
        raise SpecError("(constant)", f"{v} cannot be used in a kernel")
    return text if ("e" in text or "." in text) else text + ".0"


def _f32_rounding(precision: str, name: str, result: str) -> str:
    """A WGSL function ``name(v: f32) -> result`` rounding to ``precision`` in f32 arithmetic."""
    if precision == "fp16":
        # bit-exact round-to-nearest-even to fp16 in f32 storage; pack2x16float's rounding is
        # implementation-defined (lavapipe's differs from RNE), so it is not used for this
        return (f"fn {name}(v: f32) -> {result} {{\n"
                "    if (abs(v) >= 65520.0) { return bitcast<f32>((bitcast<u32>(v) & 0x80000000u) | 0x7f800000u); }\n"
                "    if (abs(v) < 6.103515625e-05) { return round(v * 16777216.0) / 16777216.0; }\n"
                "    let b = bitcast<u32>(v);\n"
                "    return bitcast<f32>((b + 0xfffu + ((b >> 13u) & 1u)) & 0xffffe000u);\n}")
    if precision == "bf16":
        return (f"fn {name}(v: f32) -> {result} {{\n    let b = bitcast<u32>(v);\n"
                "    return bitcast<f32>((b + 0x7fffu + ((b >> 16u) & 1u)) & 0xffff0000u);\n}")
    return f"fn {name}(v: f32) -> {result} {{ return v; }}"


def _rounding(spec: MLPSpec, native_f16: bool) -> tuple[str, str]:
    """(WGSL type alias, rnd function) for the spec's precision."""
    if spec.precision == "fp16" and native_f16:
        return "f16", "fn rnd(v: f32) -> CT { return CT(v); }"
    return "f32", _f32_rounding(spec.precision, "rnd", "CT")


def _loss_wgsl(spec: MLPSpec) -> str:
    name = spec.loss
    eps = _f(nm.LOSS_EPSILON)
    lines = ["fn loss_terms(p: f32, t: f32, row: u32) -> vec2<f32> {", "    let d = p - t;"]
    if name == "L2":
        lines.append("    return vec2<f32>(d * d, 2.0 * d);")
    elif name == "L1":
        lines.append("    return vec2<f32>(abs(d), sign(d));")
    elif name == "Huber":
        delta = _f(spec.huber_delta)
        lines.append(f"    if (abs(d) <= {delta}) {{ return vec2<f32>(0.5 * d * d, d); }}")
        lines.append(f"    return vec2<f32>({delta} * (abs(d) - 0.5 * {delta}), {delta} * sign(d));")
    else:
        if name == "RelativeL2Luminance":
            base = "row * ZS + Z_LAST"
            if spec.n_output_dims >= 3:
                lines.append(f"    let lum = 0.299 * act_o(zbuf[{base}]) + 0.587 * act_o(zbuf[{base} + 1u])"
                             f" + 0.114 * act_o(zbuf[{base} + 2u]);")
            else:
                terms = " + ".join(f"abs(act_o(zbuf[{base} + {c}u]))" for c in range(spec.n_output_dims))
                lines.append(f"    let lum = ({terms}) / {_f(spec.n_output_dims)};")
            lines.append(f"    let n = lum * lum + {eps};")
        else:
            lines.append(f"    let n = {_LOSS_NORMALISER[name]};")
        if name in ("RelativeL2", "RelativeL2Luminance"):
            lines.append("    return vec2<f32>(d * d / n, 2.0 * d / n);")
        elif name == "SMAPE":
            lines.append("    return vec2<f32>(2.0 * abs(d) / n, 2.0 * sign(d) / n);")
        else:
            lines.append("    return vec2<f32>(abs(d) / n, sign(d) / n);")
    lines.append("}")
    return "\n".join(lines)


def _optimizer_wgsl(spec: MLPSpec) -> str:
    opt = spec.optimizer
    if opt.otype == "Adam":
        return "\n".join([
            "fn optimizer_delta(p: u32, g: f32) -> f32 {",
            f"    let m = {_f(opt.beta1)} * mom1[p] + {_f(1 - opt.beta1)} * g;",
            f"    let v = {_f(opt.beta2)} * mom2[p] + {_f(1 - opt.beta2)} * (g * g);",
            "    mom1[p] = m;", "    mom2[p] = v;",
            f"    return launch.lr_t * m / (sqrt(v) + {_f(opt.epsilon)});", "}"])
    return "\n".join([
        "fn optimizer_delta(p: u32, g: f32) -> f32 {",
        f"    let vel = {_f(opt.momentum)} * mom1[p] + g;", "    mom1[p] = vel;",
        "    return launch.lr_t * vel;", "}"])


def _param_delta_wgsl(spec: MLPSpec, plan: Plan) -> str:
    """``param_delta(p, w)``: the step ``optimize`` takes on parameter ``p`` (value ``w``). A grid
    table's entries under Adam (p ≥ P) follow tcnn's non-matrix rules as numerics.grid_adam_update
    does: no l2_reg, an entry whose gradient is exactly 0 is not stepped (moments and step count
    stay), and the bias correction uses the entry's own step count (``gsteps``). SGD steps a table
    like the layers (tcnn's SGD applies l2_reg to every parameter)."""
    lines = []
    opt = spec.optimizer
    grid_adam = bool(plan.grids) and opt.otype == "Adam"
    if grid_adam:
        lines += [
            "@group(0) @binding(18) var<storage, read_write> gsteps: array<u32>;  // Adam steps per grid value",
            "fn grid_adam_delta(p: u32, g: f32) -> f32 {",
            "    if (g == 0.0) { return 0.0; }",
            f"    let m = {_f(opt.beta1)} * mom1[p] + {_f(1 - opt.beta1)} * g;",
            f"    let v = {_f(opt.beta2)} * mom2[p] + {_f(1 - opt.beta2)} * (g * g);",
            "    mom1[p] = m;", "    mom2[p] = v;",
            "    let t = gsteps[p - P] + 1u;", "    gsteps[p - P] = t;",
            f"    let lr_t = launch.lr_base * sqrt(1.0 - pow({_f(opt.beta2)}, f32(t))) / (1.0 - pow({_f(opt.beta1)}, f32(t)));",
            f"    return lr_t * m / (sqrt(v) + {_f(opt.epsilon)});", "}"]
    lines.append("fn param_delta(p: u32, w: f32) -> f32 {")
    if grid_adam:
        lines.append("    if (p >= P) { return grid_adam_delta(p, grad[p] / LOSS_SCALE); }")
    lines += ["    return optimizer_delta(p, grad[p] / LOSS_SCALE + L2_REG * w);", "}"]
    return "\n".join(lines)


def _ema_wgsl(spec: MLPSpec, plan: Plan) -> str:
    """``ema_update(p, w)``, which ``optimize`` calls after the step: nothing without tcnn's EMA
    wrapper; with it, the debiased average of parameter ``p`` (buffer ``ema``, laid out like
    ``master``) and its compute-type copy ``ema_wc``, which inference binds in place of
    ``master`` / ``wc``. Like the cpu backend it averages the weights the network computes with
    (rounded; biases stay f32) and without ``full_precision`` rounds the weights' average too."""
    ema = spec.optimizer.ema
    if ema is None:
        return "fn ema_update(p: u32, w: f32) {}"
    biases = " || ".join(f"(p >= {b}u && p < {b + n}u)" for b, n in zip(plan.boff, plan.op))
    lines = ["@group(0) @binding(12) var<storage, read_write> ema: array<f32>;     // EMA averages",
             "@group(0) @binding(13) var<storage, read_write> ema_wc: array<CT>;   // their compute-type copy",
             # rounding in f32 arithmetic: lavapipe was seen to drop an f32(f16(v)) round trip
             _f32_rounding(spec.precision, "rnd_f32", "f32"),
             f"fn is_bias(p: u32) -> bool {{ return {biases}; }}",
             "fn ema_update(p: u32, w: f32) {",
             "    let bias = is_bias(p);",
             "    var e = ema[p] * launch.ema_keep + select(rnd_f32(w), w, bias) * launch.ema_take;"]
    if not ema.full_precision:
        lines.append("    if (!bias) { e = rnd_f32(e); }")
    lines += ["    ema[p] = e;", "    ema_wc[p] = rnd(e);", "}"]
    return "\n".join(lines)


def _prelude(spec: MLPSpec, plan: Plan, native_f16: bool) -> str:
    ct, rnd = _rounding(spec, native_f16)
    hidden_act, hidden_dact = _ACT[spec.activation]
    out_act, out_dact = _ACT[spec.output_activation]
    last = plan.n_layers - 1
    consts = {
        "N_IN": plan.n_in, "N_X": plan.n_x, "N_OUT": plan.n_out, "OP_L": plan.op[last], "P": plan.p,
        "P_ALL": plan.p_all, "KP0": plan.kp[0], "ZS": sum(plan.op), "HS": sum(plan.kp), "Z_LAST": plan.zoff[last],
    }
    lines = ["enable f16;" if ct == "f16" else "", f"alias CT = {ct};", rnd]
    lines += [f"const {k}: u32 = {v}u;" for k, v in consts.items()]
    lines.append(f"const LOSS_SCALE: f32 = {_f(spec.loss_scale)};")
    lines.append(f"const L2_REG: f32 = {_f(spec.optimizer.l2_reg)};")
    lines.append(f"fn act_h(z: f32) -> f32 {{ return {hidden_act}; }}")
    lines.append(f"fn dact_h(z: f32) -> f32 {{ return {hidden_dact}; }}")
    lines.append(f"fn act_o(z: f32) -> f32 {{ return {out_act}; }}")
    lines.append(f"fn dact_o(z: f32) -> f32 {{ return {out_dact}; }}")
    lines += [_loss_wgsl(spec), _optimizer_wgsl(spec), _param_delta_wgsl(spec, plan), _ema_wgsl(spec, plan)]
    return "\n".join(lines) + "\n"


def _gemm_stage(plan: Plan, st: Stage, *, backward: bool, a_global: bool, train: bool, epilogue) -> list[str]:
    """WGSL for one stage of a fused kernel: acc = A @ B over st.k in chunks, then ``epilogue``.

    A is the activation tile ``act`` (stride HIDDEN) or, for the first stage, chunks streamed from
    global memory into ``xsh``. B is layer ``st.layer``'s weights: W^T for the forward pass,
    W for the backward pass, staged as vec4 columns in ``wsh``. The backward kernel has its own
    workgroup arrays (``bact``, ``bxsh``, ``bwsh``), sized for its stages.
    """
    act, xsh, wsh = ("bact", "bxsh", "bwsh") if backward else ("act", "xsh", "wsh")
    R, T = plan.rows, THREADS
    i = st.layer
    kp = plan.kp[i]
    out: list[str] = []
    for col0 in range(0, st.n, 256):
        ncols = min(256, st.n - col0)
        ncq = ncols // 4
        nblk = (R // 4) * ncq
        nb = ceil_div(nblk, T)
        guard = nblk % T != 0
        out.append("    {")
        out += [f"    var a{j}_{r} = vec4<f32>(0.0);" for j in range(nb) for r in range(4)]
        out.append(f"    for (var k0 = 0u; k0 < {st.k}u; k0 = k0 + {st.kc}u) {{")
        out.append("        workgroupBarrier();")
        # stage B: wsh[kk * ncq + cq] = four output columns of reduction row k0 + kk
        out.append(f"        for (var e = lid; e < {st.kc * ncq}u; e = e + {T}u) {{")
        out.append(f"            let kk = e / {ncq}u; let cq = e % {ncq}u; let k = k0 + kk;")
        out.append("            var w = vec4<CT>(CT(0.0));")
        out.append(f"            if (k < {st.k}u) {{")
        if backward:  # W[o = k][kcol..kcol+3], contiguous
            out.append(f"                let b = {plan.woff[i]}u + k * {kp}u + {col0}u + cq * 4u;")
            out.append("                w = vec4<CT>(wc[b], wc[b + 1u], wc[b + 2u], wc[b + 3u]);")
        else:  # W^T: W[o..o+3][k]
            out.append(f"                let b = {plan.woff[i]}u + ({col0}u + cq * 4u) * {kp}u + k;")
            out.append(f"                w = vec4<CT>(wc[b], wc[b + {kp}u], wc[b + {2 * kp}u], wc[b + {3 * kp}u]);")
        out.append("            }")
        out.append(f"            {wsh}[e] = w;")
        out.append("        }")
        if a_global:
            out.append(f"        for (var e = lid; e < {R * st.kc}u; e = e + {T}u) {{")
            out.append(f"            let lr = e / {st.kc}u; let k = k0 + e % {st.kc}u; let row = row0 + lr;")
            out.append("            var v = CT(0.0);")
            if backward:  # the last layer's output gradient, written by loss_grad
                out.append(f"            if (row < launch.n_rows && k < {st.k}u) {{ v = dbuf[row * ZS + Z_LAST + k]; }}")
            else:
                out.append("            if (row < n_rows && k < N_IN) { v = rnd(encoded_input(row, k)); }")
                if train:
                    out.append(f"            if (row < n_rows && k < {kp}u) {{ hbuf[row * HS + k] = v; }}")
            out.append(f"            {xsh}[e] = v;")
            out.append("        }")
        out.append("        workgroupBarrier();")
        for j in range(nb):
            indent = "            "
            out.append(f"        if (lid + {j * T}u < {nblk}u) {{" if guard else "        {")
            out.append(f"{indent}let rb = (lid + {j * T}u) / {ncq}u * 4u; let cq = (lid + {j * T}u) % {ncq}u;")
            out.append(f"{indent}for (var kk = 0u; kk < {st.kc}u; kk = kk + 1u) {{")
            out.append(f"{indent}    let w = vec4<f32>({wsh}[kk * {ncq}u + cq]);")
            for r in range(4):
                a_index = (f"(rb + {r}u) * {st.kc}u + kk" if a_global else f"(rb + {r}u) * HIDDEN + k0 + kk")
                out.append(f"{indent}    a{j}_{r} = a{j}_{r} + f32({xsh if a_global else act}[{a_index}]) * w;")
            out.append(f"{indent}}}")
            out.append("        }")
        out.append("    }")
        out.append("    workgroupBarrier();")
        for j in range(nb):
            indent = "    "
            if guard:
                out.append(f"    if (lid + {j * T}u < {nblk}u) {{")
                indent += "    "
            out.append(f"{indent}let rb{j} = (lid + {j * T}u) / {ncq}u * 4u;"
                       f" let col{j} = {col0}u + (lid + {j * T}u) % {ncq}u * 4u;")
            for r in range(4):
                out += [indent + line for line in epilogue(f"a{j}_{r}", f"rb{j} + {r}u", f"col{j}")]
            if guard:
                out.append("    }")
        out.append("    }")
    return out


def _fused_kernels(spec: MLPSpec, plan: Plan) -> str:
    R, L = plan.rows, plan.n_layers
    lines = [
        f"const ROWS: u32 = {R}u;", f"const HIDDEN: u32 = {plan.hidden}u;",
        f"var<workgroup> act: array<CT, {R * plan.hidden}>;",
        f"var<workgroup> xsh: array<CT, {R * plan.fwd_kcx}>;",
        f"var<workgroup> wsh: array<vec4<CT>, {plan.fwd_wsh}>;",
        f"var<workgroup> bact: array<CT, {R * plan.hidden}>;",
        f"var<workgroup> bxsh: array<CT, {R * plan.bwd_kcx}>;",
        f"var<workgroup> bwsh: array<vec4<CT>, {plan.bwd_wsh}>;",
    ]

    def bias(i: int, col: str) -> str:
        b = f"{plan.boff[i]}u + {col}"
        return f"vec4<f32>(master[{b}], master[{b} + 1u], master[{b} + 2u], master[{b} + 3u])"

    def fwd_epilogue(i: int, train: bool):
        last = i == L - 1

        def emit(acc: str, lr: str, col: str) -> list[str]:
            body = [f"{{ let lr = {lr}; let row = row0 + lr; let z = {acc} + {bias(i, col)};"]
            if last:
                if train:
                    body.append(f"  if (row < n_rows) {{ for (var c = 0u; c < 4u; c = c + 1u) {{"
                                f" zbuf[row * ZS + {plan.zoff[i]}u + {col} + c] = z[c]; }} }}")
                else:
                    body.append(f"  for (var c = 0u; c < 4u; c = c + 1u) {{ if (row < n_rows && {col} + c < N_OUT) {{"
                                f" y_out[row * N_OUT + {col} + c] = act_o(z[c]); }} }}")
            else:
                body.append("  for (var c = 0u; c < 4u; c = c + 1u) {")
                body.append("    let h = rnd(act_h(z[c]));")
                body.append(f"    act[lr * HIDDEN + {col} + c] = h;")
                if train:
                    body.append(f"    if (row < n_rows) {{ zbuf[row * ZS + {plan.zoff[i]}u + {col} + c] = z[c];"
                                f" hbuf[row * HS + {plan.hoff[i + 1]}u + {col} + c] = h; }}")
                body.append("  }")
            body.append("}")
            return body
        return emit

    for train in (False, True):
        name = "fwd_train" if train else "fwd_infer"
        lines.append("@compute @workgroup_size(256)")
        lines.append(f"fn {name}(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {{")
        lines.append("    let n_rows = launch.n_rows;")
        lines.append("    let row0 = wid.x * ROWS;")
        for st in plan.fwd:
            lines += _gemm_stage(plan, st, backward=False, a_global=st.layer == 0, train=train,
                                 epilogue=fwd_epilogue(st.layer, train))
        lines.append("}")

    def bwd_epilogue(i: int):
        # delta_{i-1} = rnd((delta_i @ W_i) * act_h'(z_{i-1}))
        prev = i - 1

        def emit(acc: str, lr: str, col: str) -> list[str]:
            body = [f"{{ let lr = {lr}; let row = row0 + lr;",
                    "  for (var c = 0u; c < 4u; c = c + 1u) {",
                    f"    let zi = row * ZS + {plan.zoff[prev]}u + {col} + c;",
                    f"    let d = rnd({acc}[c] * dact_h(zbuf[zi]));"]
            if prev > 0 or plan.grids:  # the next stage reads it (with grids: the first layer's)
                body.append(f"    bact[lr * HIDDEN + {col} + c] = d;")
            body.append("    if (row < launch.n_rows) { dbuf[zi] = d; }")
            body += ["  }", "}"]
            return body
        return emit

    def input_grad_epilogue(acc: str, lr: str, col: str) -> list[str]:
        # d loss / d encoded input = rnd(delta_0 @ W_0), for the grid tables' gradients
        return [f"{{ let row = row0 + {lr};",
                "  if (row < launch.n_rows) { for (var c = 0u; c < 4u; c = c + 1u) {"
                f" dinbuf[row * KP0 + {col} + c] = rnd({acc}[c]); }} }}", "}"]

    lines.append("@compute @workgroup_size(256)")
    lines.append("fn bwd(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {")
    lines.append("    let row0 = wid.x * ROWS;")
    for st in plan.bwd:
        lines += _gemm_stage(plan, st, backward=True, a_global=st.layer == L - 1, train=True,
                             epilogue=input_grad_epilogue if st.layer == 0 else bwd_epilogue(st.layer))
    lines.append("}")
    return "\n".join(lines)


def _wgrad_kernels(plan: Plan) -> str:
    """Per layer: wpart[split] = delta^T @ [h, 1] over the split's rows (64 x 64 tiles, 16 rows a step)."""
    lines = ["var<workgroup> dt: array<vec4<f32>, 256>;", "var<workgroup> ht: array<vec4<f32>, 256>;"]
    for i in range(plan.n_layers):
        kp, op = plan.kp[i], plan.op[i]
        lines += [
            "@compute @workgroup_size(256)",
            f"fn wgrad_{i}(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {{",
            "    let k0 = wid.x * 64u; let o0 = wid.y * 64u; let split = wid.z;",
            "    let r_begin = split * launch.rows_per_split;",
            "    let r_end = min(r_begin + launch.rows_per_split, launch.n_rows);",
            "    let ty = lid / 16u; let tx = lid % 16u;",
            "    let lrow = lid / 16u; let q = lid % 16u;",
            "    var acc0 = vec4<f32>(0.0); var acc1 = vec4<f32>(0.0);",
            "    var acc2 = vec4<f32>(0.0); var acc3 = vec4<f32>(0.0);",
            "    for (var r0 = split * launch.rows_per_split; r0 < split * launch.rows_per_split + launch.rows_per_split; r0 = r0 + 16u) {",
            "        workgroupBarrier();",
            "        let row = r0 + lrow;",
            "        var d = vec4<f32>(0.0); var h = vec4<f32>(0.0);",
            "        if (row >= r_begin && row < r_end) {",
            "            for (var c = 0u; c < 4u; c = c + 1u) {",
            "                let o = o0 + q * 4u + c; let k = k0 + q * 4u + c;",
            f"                if (o < {op}u) {{ d[c] = f32(dbuf[row * ZS + {plan.zoff[i]}u + o]); }}",
            f"                if (k < {kp}u) {{ h[c] = f32(hbuf[row * HS + {plan.hoff[i]}u + k]); }}",
            f"                if (k == {kp}u) {{ h[c] = 1.0; }}",
            "            }",
            "        }",
            "        dt[lid] = d; ht[lid] = h;",
            "        workgroupBarrier();",
            "        for (var rr = 0u; rr < 16u; rr = rr + 1u) {",
            "            let dv = dt[rr * 16u + ty]; let hv = ht[rr * 16u + tx];",
            "            acc0 = acc0 + dv.x * hv; acc1 = acc1 + dv.y * hv;",
            "            acc2 = acc2 + dv.z * hv; acc3 = acc3 + dv.w * hv;",
            "        }",
            "    }",
            "    let base = split * P;",
            "    for (var a = 0u; a < 4u; a = a + 1u) {",
            "        let o = o0 + ty * 4u + a;",
            "        var v = acc0;",
            "        if (a == 1u) { v = acc1; } if (a == 2u) { v = acc2; } if (a == 3u) { v = acc3; }",
            f"        if (o < {op}u) {{",
            "            for (var b = 0u; b < 4u; b = b + 1u) {",
            "                let k = k0 + tx * 4u + b;",
            f"                if (k < {kp}u) {{ wpart[base + {plan.woff[i]}u + o * {kp}u + k] = v[b]; }}",
            f"                if (k == {kp}u) {{ wpart[base + {plan.boff[i]}u + o] = v[b]; }}",
            "            }",
            "        }",
            "    }",
            "}",
        ]
    return "\n".join(lines)


def _encoding_wgsl(plan: Plan) -> str:
    """``encoded_input(row, k)``: column k of the first layer's input for row ``row`` of the
    kernel input ``x_in``. Without grids the host encoded it; with grids a grid column is
    interpolated from the table (its compute-type copy in ``wc``), the other columns were encoded
    on the host. With grids also the training kernels of the tables' gradient: see _grid_wgsl."""
    if not plan.grids:
        return "fn encoded_input(row: u32, k: u32) -> f32 { return x_in[row * N_X + k]; }"
    lines = [_grid_wgsl(plan), "fn encoded_input(row: u32, k: u32) -> f32 {"]
    for g in plan.grids:
        lines.append(f"    if (k >= {g.column}u && k < {g.column + g.width}u) {{"
                     f" return grid{g.index}_value(row, k - {g.column}u); }}")
    for column, width, host in plan.host_parts:
        lines.append(f"    if (k >= {column}u && k < {column + width}u) {{ return x_in[row * N_X + {host}u + k - {column}u]; }}")
    lines += ["    return 0.0;", "}"]
    return "\n".join(lines)


def _grid_wgsl(plan: Plan) -> str:
    """The grid parts' kernels.

    Forward: ``grid{k}_corner(row, level, corner)`` is encodings.grid_lookup for one table read
    (tcnn's fmaf position, floor, smoothstep, dense index / coherent prime hash / index 0 per the
    level's mode, modulo the level's rows; the weight multiplies the dims' factors in dim order)
    and ``grid{k}_value`` interpolates one output column from the compute-type table.

    Training (WGSL has no float atomics, so tcnn's scatter-add becomes a sort and a gather, with
    the same sums in a fixed order): ``grid_keys_{k}`` writes every table read of the chunk as
    (table row, read id) with its weight, read id = (row · levels + level) · corners + corner;
    ``grid_sort_block``, ``grid_sort`` and ``grid_merge_block`` bitonic-sort those pairs (ties
    ordered by read id, so the sorted order is unique; the short passes in workgroup memory, a
    global dispatch for each long one); ``grid_gather_{k}`` gives each table row its run of
    the sorted reads (binary search) and sums weight × d loss / d encoded input over it in read-id
    order (the order of the cpu backend's bincount) into ``grad``. A row no read touched gets
    exactly 0, which the Adam step skips as tcnn does."""
    primes = ", ".join(f"{p}u" for p in HASH_PRIMES[:4])
    mode_code = {"dense": 0, "hash": 1, "zero": 2}
    lines = [
        "@group(0) @binding(14) var<storage, read_write> dinbuf: array<CT>;   // d loss / d encoded input (chunk)",
        "@group(0) @binding(15) var<storage, read_write> skey: array<u32>;    // table row of each read (sorted)",
        "@group(0) @binding(16) var<storage, read_write> sid: array<u32>;     // read id of each read (sorted with skey)",
        "@group(0) @binding(17) var<storage, read_write> gweight: array<f32>; // interpolation weight, by read id",
        "struct GridCorner { entry: u32, weight: f32 }",
        "fn lower_bound(key: u32) -> u32 {",
        "    var lo = 0u; var hi = launch.sort_n;",
        "    while (lo < hi) { let mid = (lo + hi) / 2u; if (skey[mid] < key) { lo = mid + 1u; } else { hi = mid; } }",
        "    return lo;", "}",
        # one compare-exchange pass (merge size k, distance j) over the whole array
        "@compute @workgroup_size(256)",
        "fn grid_sort(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {",
        "    let j = launch.sort_j; let k = launch.sort_k;",
        "    for (var t = gid.x; t < launch.sort_n / 2u; t = t + nwg.x * EW_WG) {",
        "        let i = ((t & ~(j - 1u)) << 1u) | (t & (j - 1u));  // t with a 0 bit inserted at j",
        "        let l = i | j;",
        "        let ki = skey[i]; let kl = skey[l]; let ii = sid[i]; let il = sid[l];",
        "        let greater = ki > kl || (ki == kl && ii > il);",
        "        if (greater == ((i & k) == 0u)) { skey[i] = kl; skey[l] = ki; sid[i] = il; sid[l] = ii; }",
        "    }", "}",
        # the passes whose distance is below SORT_BLOCK stay inside aligned blocks of SORT_BLOCK
        # pairs: a workgroup runs them in workgroup memory. grid_sort_block: every pass of the
        # merge sizes up to SORT_BLOCK; grid_merge_block: the short passes of merge size sort_k.
        f"const SORT_BLOCK: u32 = {SORT_BLOCK}u;",
        f"var<workgroup> block_key: array<u32, {SORT_BLOCK}>;",
        f"var<workgroup> block_id: array<u32, {SORT_BLOCK}>;",
        "fn block_pass(lid: u32, base: u32, j: u32, k: u32) {",
        "    let i = ((lid & ~(j - 1u)) << 1u) | (lid & (j - 1u));",
        "    let l = i | j;",
        "    let ki = block_key[i]; let kl = block_key[l]; let ii = block_id[i]; let il = block_id[l];",
        "    let greater = ki > kl || (ki == kl && ii > il);",
        "    if (greater == (((base + i) & k) == 0u)) { block_key[i] = kl; block_key[l] = ki; block_id[i] = il; block_id[l] = ii; }",
        "    workgroupBarrier();", "}",
        "fn block_load(lid: u32, base: u32) {",
        "    block_key[lid] = skey[base + lid]; block_id[lid] = sid[base + lid];",
        "    block_key[lid + 256u] = skey[base + lid + 256u]; block_id[lid + 256u] = sid[base + lid + 256u];",
        "    workgroupBarrier();", "}",
        "fn block_store(lid: u32, base: u32) {",
        "    skey[base + lid] = block_key[lid]; sid[base + lid] = block_id[lid];",
        "    skey[base + lid + 256u] = block_key[lid + 256u]; sid[base + lid + 256u] = block_id[lid + 256u];", "}",
        "@compute @workgroup_size(256)",
        "fn grid_sort_block(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {",
        "    let base = wid.x * SORT_BLOCK;",
        "    block_load(lid, base);",
        "    for (var k = 2u; k <= SORT_BLOCK; k = k << 1u) {",
        "        for (var j = k >> 1u; j > 0u; j = j >> 1u) { block_pass(lid, base, j, k); }",
        "    }",
        "    block_store(lid, base);", "}",
        "@compute @workgroup_size(256)",
        "fn grid_merge_block(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {",
        "    let base = wid.x * SORT_BLOCK;",
        "    block_load(lid, base);",
        "    for (var j = SORT_BLOCK >> 1u; j > 0u; j = j >> 1u) { block_pass(lid, base, j, launch.sort_k); }",
        "    block_store(lid, base);", "}",
    ]
    for g in plan.grids:
        n, f, c, lc = len(g.levels), g.features, g.corners, g.lookups
        nearest = g.interpolation == "Nearest"
        arrays = {
            "scale": ("f32", [_f(lv.scale) for lv in g.levels]),
            "resolution": ("u32", [f"{lv.resolution}u" for lv in g.levels]),
            "start": ("u32", [f"{lv.offset}u" for lv in g.levels]),
            "rows": ("u32", [f"{lv.entries}u" for lv in g.levels]),
            "mode": ("u32", [f"{mode_code[m]}u" for m in g.modes]),
        }
        lines.append(f"// grid part {g.index}: input dims {g.begin}..{g.begin + g.dims - 1}, encoded columns "
                     f"{g.column}..{g.column + g.width - 1}, table grid{g.index} at {g.offset} ({g.entries} x {f})")
        lines.append(f"fn grid{g.index}_corner(row: u32, level: u32, corner: u32) -> GridCorner {{")
        lines += [f"    var {name} = array<{t}, {n}>({', '.join(values)});" for name, (t, values) in arrays.items()]
        lines += [f"    var primes = array<u32, 4>({primes});",
                  "    var index = 0u; var stride = 1u; var weight = 1.0;",
                  f"    for (var d = 0u; d < {g.dims}u; d = d + 1u) {{",
                  f"        let pos = fma(x_in[row * N_X + {g.begin}u + d], scale[level], 0.5);",
                  "        let cell = floor(pos);",
                  "        var frac = pos - cell;"]
        if g.interpolation == "Smoothstep":
            lines.append("        frac = frac * frac * (3.0 - 2.0 * frac);")
        lines += ["        let bit = (corner >> d) & 1u;",
                  "        let c = u32(i32(cell)) + bit;  // tcnn's (uint32_t)(int)floorf(pos), wrapping",
                  "        if (mode[level] == 1u) { index = index ^ (c * primes[d]); }",
                  "        else { index = index + c * stride; stride = stride * resolution[level]; }"]
        if not nearest:
            lines.append("        weight = weight * select(1.0 - frac, frac, bit == 1u);")
        lines += ["    }",
                  "    if (mode[level] == 2u) { index = 0u; }",
                  "    return GridCorner(start[level] + index % rows[level], weight);", "}"]
        lines += [f"fn grid{g.index}_value(row: u32, j: u32) -> f32 {{",
                  f"    let level = j / {f}u; let f = j % {f}u;",
                  "    var acc = 0.0;",
                  f"    for (var c = 0u; c < {c}u; c = c + 1u) {{",
                  f"        let r = grid{g.index}_corner(row, level, c);",
                  f"        acc = acc + r.weight * f32(wc[{g.offset}u + r.entry * {f}u + f]);",
                  "    }", "    return acc;", "}"]
        lines += ["@compute @workgroup_size(256)",
                  f"fn grid_keys_{g.index}(@builtin(global_invocation_id) gid: vec3<u32>,"
                  " @builtin(num_workgroups) nwg: vec3<u32>) {",
                  f"    let reads = launch.n_rows * {lc}u;",
                  "    for (var i = gid.x; i < launch.sort_n; i = i + nwg.x * EW_WG) {",
                  "        sid[i] = i;",
                  "        if (i < reads) {",
                  f"            let r = grid{g.index}_corner(i / {lc}u, (i % {lc}u) / {c}u, i % {c}u);",
                  "            skey[i] = r.entry; gweight[i] = r.weight;",
                  "        } else { skey[i] = 0xffffffffu; }  // padding to the power of two: sorts last",
                  "    }", "}"]
        lines += ["@compute @workgroup_size(256)",
                  f"fn grid_gather_{g.index}(@builtin(global_invocation_id) gid: vec3<u32>,"
                  " @builtin(num_workgroups) nwg: vec3<u32>) {",
                  f"    for (var e = gid.x; e < {g.entries}u; e = e + nwg.x * EW_WG) {{",
                  f"        var acc: array<f32, {f}>;",
                  "        let end = lower_bound(e + 1u);",
                  "        for (var s = lower_bound(e); s < end; s = s + 1u) {",
                  "            let id = sid[s];",
                  f"            let base = (id / {lc}u) * KP0 + {g.column}u + (id % {lc}u) / {c}u * {f}u;",
                  "            let w = gweight[id];",
                  f"            for (var f = 0u; f < {f}u; f = f + 1u) {{ acc[f] = acc[f] + w * f32(dinbuf[base + f]); }}",
                  "        }",
                  f"        for (var f = 0u; f < {f}u; f = f + 1u) {{",
                  f"            let p = {g.offset}u + e * {f}u + f;",
                  "            var s = acc[f];",
                  "            if ((launch.flags & 1u) == 0u) { s = s + grad[p]; }",
                  "            grad[p] = s;",
                  "        }", "    }", "}"]
    return "\n".join(lines)


def generate_wgsl(spec: MLPSpec, plan: Plan, native_f16: bool) -> str:
    """The whole WGSL module for one model."""
    return "\n".join([_prelude(spec, plan, native_f16), read_source("wgsl/mlp_common.wgsl"), _encoding_wgsl(plan),
                      _fused_kernels(spec, plan), _wgrad_kernels(plan)])
