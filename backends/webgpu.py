"""wgpu backend: the MLP in WGSL through wgpu-py, on any WebGPU adapter (Vulkan, Metal, D3D12, GL).

One variant, ``default``. Per model spec the backend generates one WGSL module
(``shaders/wgsl/mlp_common.wgsl`` plus generated code) holding:

* ``fwd_infer`` / ``fwd_train``: the fused forward pass, all layers in one dispatch. A workgroup
  owns ``R`` rows; the activations of those rows live in workgroup memory, each layer's weights
  are staged in workgroup memory in chunks of ``KC`` reduction rows (the whole layer when it fits
  the adapter's ``max-compute-workgroup-storage-size``, streamed otherwise). The input encoding
  runs in the kernel, so device arrays hold raw inputs. ``fwd_train`` also keeps each layer's
  input (compute type) and pre-activation (fp32) for the backward pass.
* ``loss_grad`` / ``loss_reduce``: per-element loss and its gradient (× loss scale, × output
  activation derivative, rounded), the mean loss reduced in a fixed order.
* ``bwd``: the fused backward pass through the layers, activation derivatives taken from the
  stored pre-activations.
* ``wgrad_<i>``: weight and bias gradients of layer i as a split-K GEMM over the rows;
  ``grad_reduce`` sums the splits in order (deterministic, no atomics).
* ``optimize``: Adam or SGD on fp32 masters, refreshing the compute-type weight copy.

Numerics follow ``backends/contract.py``: fp16 models store activations and weights as ``f16``
when the adapter has ``shader-f16``; without it they are stored as f32 holding fp16-rounded
values (``pack2x16float``/``unpack2x16float``). bf16 is always emulated in f32 storage (bit
rounding to nearest even); fp32 models round nothing. Every product accumulates in f32.

Batches of any size run in row chunks; each chunk binds its slice of the input/target/output
arrays, so no buffer binding exceeds the adapter's limits. Launch parameters live in one uniform
buffer of 256-byte slots addressed with dynamic offsets, so a whole multi-step training run is
one submission.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmad.backends import numerics as nm
from mmad.backends.contract import (
    Backend, CompiledModel, ProbeRow, check_params, check_rows, init_params, optimizer_state_names, param_shapes,
)
from mmad.errors import BackendUnavailable, CompileError, InvalidInput, LaunchError, SpecError
from mmad.shaders import read_source
from mmad.spec import EncodingSpec, MLPSpec

THREADS = 256              # invocations of the fused forward/backward workgroups
SLOT_BYTES = 256           # uniform slot stride (>= every adapter's uniform offset alignment)
UNIFORM_SLOTS = 1024
STEP_SLOTS = 256           # losses[0:256] per step, losses[256] the running chunk sum
MAX_CHUNK_ROWS = 65536
MAX_EW_WORKGROUPS = 4096   # element-wise kernels stride over their range with at most this many
MAX_ACCUMULATORS = 64      # fp32 accumulators per invocation in the fused kernels
LAYOUT_VERSION = 1

# limits the backend asks for (the adapter's own values, not WebGPU's defaults)
_LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
           "max-storage-buffers-per-shader-stage", "max-compute-invocations-per-workgroup",
           "max-compute-workgroup-size-x", "max-compute-workgroups-per-dimension",
           "max-dynamic-uniform-buffers-per-pipeline-layout")
_INTERESTING_FEATURES = ("shader-f16", "subgroup", "subgroup-barrier", "shader-f64", "shader-int64",
                         "timestamp-query", "pipeline-cache", "immediates", "shader-float32-atomic")


def _import_wgpu():
    try:
        import wgpu  # noqa: PLC0415 - optional stack, imported on use
    except ImportError as exc:
        raise BackendUnavailable("wgpu", f"the wgpu package is not installed ({exc}); pip install wgpu") from exc
    return wgpu


def _native_version(wgpu) -> str:
    try:
        from wgpu.backends import wgpu_native  # noqa: PLC0415
        return getattr(wgpu_native, "__version__", "?")
    except Exception:  # noqa: BLE001 - only for a version string
        return "?"


def _is_software(info: dict) -> bool:
    text = " ".join(str(info.get(k, "")) for k in ("vendor", "device", "description")).lower()
    return info.get("adapter_type") == "CPU" or any(s in text for s in ("llvmpipe", "lavapipe", "swiftshader", "warp"))


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# -- the shape plan -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Stage:
    """One GEMM of a fused kernel: out[R x n] = A[R x k] @ B[k x n]."""

    layer: int
    k: int    # reduction size (padded to 16)
    n: int    # output width (padded to 16)
    kc: int   # reduction rows of B staged per workgroup-memory chunk


@dataclass(frozen=True)
class _Plan:
    n_in: int
    n_enc: int
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
    fwd: tuple[_Stage, ...]
    bwd: tuple[_Stage, ...]
    chunk_rows: int         # largest training chunk
    fwd_chunk_rows: int     # inference chunk
    n_splits_max: int
    woff: tuple[int, ...]
    boff: tuple[int, ...]
    p: int
    hoff: tuple[int, ...]
    zoff: tuple[int, ...]

    @property
    def n_layers(self) -> int:
        return len(self.kp)


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
        stages.append(_Stage(layer, k, n, kc))
        wsh = max(wsh, kc * ng // 4)
    return kcx, tuple(stages), wsh


def make_plan(spec: MLPSpec, limits: dict[str, int], ct_bytes: int, max_stage_rows: int = 4096) -> _Plan:
    """Tile sizes for ``spec`` on an adapter with ``limits``.

    ``max_stage_rows`` caps the weight rows staged per chunk (a multiple of 16). Hardware adapters
    stage whole layers whenever they fit; CPU adapters use 16, because lavapipe's LLVM unrolls a
    whole staged chunk and compile times grow several-fold with it (M: 47 s vs 17 s per pipeline).
    """
    dims = spec.layer_dims
    kp = tuple(_pad16(i) for i, _ in dims)
    op = tuple(_pad16(o) for _, o in dims)
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
        bwd = _fit_stages([(i, op[i], kp[i]) for i in range(n_layers - 1, 0, -1)], rows, act_bytes, budget,
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
    binding = int(limits["max-storage-buffer-binding-size"])
    per_row_z = 4 * sum(op)
    chunk = MAX_CHUNK_ROWS
    while chunk > 256 and (chunk * per_row_z > min(binding, 256 << 20)
                           or chunk * 4 * max(spec.n_input_dims, spec.n_output_dims) > binding):
        chunk //= 2
    fwd_chunk = 256
    max_groups = int(limits["max-compute-workgroups-per-dimension"])
    while (fwd_chunk * 2 <= min(1 << 20, max_groups * rows)
           and fwd_chunk * 2 * 4 * max(spec.n_input_dims, spec.n_output_dims) <= binding):
        fwd_chunk *= 2
    n_splits = max(1, min(128, chunk // 256, (64 << 20) // (4 * p)))
    # row-major scratch: row r of layer i's input at hbuf[r * HS + hoff[i]], its
    # pre-activation / output gradient at zbuf / dbuf[r * ZS + zoff[i]]
    hoff = [sum(kp[:i]) for i in range(n_layers)]
    zoff = [sum(op[:i]) for i in range(n_layers)]
    return _Plan(spec.n_input_dims, spec.n_encoded_dims, spec.n_output_dims, kp, op, hidden, ct_bytes, rows,
                 fwd[0], fwd[2], bwd[0], bwd[2], fwd[1], bwd[1], chunk, fwd_chunk, n_splits, tuple(woff), tuple(boff), p,
                 tuple(hoff), tuple(zoff))


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


def _rounding(spec: MLPSpec, native_f16: bool) -> tuple[str, str]:
    """(WGSL type alias, rnd function) for the spec's precision."""
    if spec.precision == "fp16" and native_f16:
        return "f16", "fn rnd(v: f32) -> CT { return CT(v); }"
    if spec.precision == "fp16":
        # bit-exact round-to-nearest-even to fp16 in f32 storage; pack2x16float's rounding is
        # implementation-defined (lavapipe's differs from RNE), so it is not used for this
        return "f32", ("fn rnd(v: f32) -> CT {\n"
                       "    if (abs(v) >= 65520.0) { return bitcast<f32>((bitcast<u32>(v) & 0x80000000u) | 0x7f800000u); }\n"
                       "    if (abs(v) < 6.103515625e-05) { return round(v * 16777216.0) / 16777216.0; }\n"
                       "    let b = bitcast<u32>(v);\n"
                       "    return bitcast<f32>((b + 0xfffu + ((b >> 13u) & 1u)) & 0xffffe000u);\n}")
    if spec.precision == "bf16":
        return "f32", ("fn rnd(v: f32) -> CT {\n    let b = bitcast<u32>(v);\n"
                       "    return bitcast<f32>((b + 0x7fffu + ((b >> 16u) & 1u)) & 0xffff0000u);\n}")
    return "f32", "fn rnd(v: f32) -> CT { return v; }"


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


def _encoding_parts(encoding: EncodingSpec, n_in: int) -> list[tuple[EncodingSpec, int, int, int]]:
    """(part, first input dim, input dims, first encoded column) of every encoding part."""
    parts = encoding.nested if encoding.otype == "Composite" else (encoding,)
    out, dim, col = [], 0, 0
    for part in parts:
        dims = part.n_dims_to_encode if part.n_dims_to_encode is not None else n_in - dim
        out.append((part, dim, dims, col))
        dim += dims
        col += part.n_output_dims(dims)
    return out


def _encode_wgsl(spec: MLPSpec) -> str:
    """fn encode(row, k): encoded input column k of a chunk row (k < N_ENC)."""
    lines = ["fn encode(row: u32, k: u32) -> f32 {", "    let base = row * N_IN;"]
    for part, dim, dims, col in _encoding_parts(spec.encoding, spec.n_input_dims):
        width = part.n_output_dims(dims)
        lines.append(f"    if (k < {col + width}u) {{")
        lines.append(f"        let j = k - {col}u;")
        if part.otype == "Identity":
            lines.append(f"        return x_in[base + {dim}u + j];")
        elif part.otype == "Frequency":
            nf = part.n_frequencies
            # [dim][frequency][sin, cos]; x * 2^f is exact in f32, the reduction to [-1, 1) too
            lines.append(f"        let v = x_in[base + {dim}u + j / {2 * nf}u];")
            lines.append(f"        let t = ldexp(v, i32((j / 2u) % {nf}u));")
            lines.append("        return select(sin_pi_times(t), cos_pi_times(t), (j & 1u) == 1u);")
        else:
            nb = part.n_bins
            lines.append(f"        let v = x_in[base + {dim}u + j / {nb}u];")
            lines.append(f"        let lo = f32(j % {nb}u) / {_f(nb)};")
            lines.append(f"        let scale = 1.0 / ({_f(1.0 / nb)} * {_f(math.sqrt(2.0))});")
            lines.append(f"        return 0.5 * (erf_approx((lo + {_f(1.0 / nb)} - v) * scale)"
                         " - erf_approx((lo - v) * scale));")
        lines.append("    }")
    lines.append("    return 0.0;")
    lines.append("}")
    return "\n".join(lines)


def _prelude(spec: MLPSpec, plan: _Plan, native_f16: bool) -> str:
    ct, rnd = _rounding(spec, native_f16)
    hidden_act, hidden_dact = _ACT[spec.activation]
    out_act, out_dact = _ACT[spec.output_activation]
    last = plan.n_layers - 1
    consts = {
        "N_IN": plan.n_in, "N_ENC": plan.n_enc, "N_OUT": plan.n_out, "OP_L": plan.op[last], "P": plan.p,
        "ZS": sum(plan.op), "HS": sum(plan.kp), "Z_LAST": plan.zoff[last],
    }
    lines = ["enable f16;" if ct == "f16" else "", f"alias CT = {ct};", rnd]
    lines += [f"const {k}: u32 = {v}u;" for k, v in consts.items()]
    lines.append(f"const LOSS_SCALE: f32 = {_f(spec.loss_scale)};")
    lines.append(f"const L2_REG: f32 = {_f(spec.optimizer.l2_reg)};")
    lines.append(f"fn act_h(z: f32) -> f32 {{ return {hidden_act}; }}")
    lines.append(f"fn dact_h(z: f32) -> f32 {{ return {hidden_dact}; }}")
    lines.append(f"fn act_o(z: f32) -> f32 {{ return {out_act}; }}")
    lines.append(f"fn dact_o(z: f32) -> f32 {{ return {out_dact}; }}")
    lines += [_loss_wgsl(spec), _optimizer_wgsl(spec), _encode_wgsl(spec)]
    return "\n".join(lines) + "\n"


def _gemm_stage(plan: _Plan, st: _Stage, *, backward: bool, a_global: bool, train: bool, epilogue) -> list[str]:
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
        nb = _ceil_div(nblk, T)
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
                out.append("            if (row < n_rows && k < N_ENC) { v = rnd(encode(row, k)); }")
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


def _fused_kernels(spec: MLPSpec, plan: _Plan) -> str:
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
            if prev > 0:
                body.append(f"    bact[lr * HIDDEN + {col} + c] = d;")
            body.append("    if (row < launch.n_rows) { dbuf[zi] = d; }")
            body += ["  }", "}"]
            return body
        return emit

    lines.append("@compute @workgroup_size(256)")
    lines.append("fn bwd(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {")
    lines.append("    let row0 = wid.x * ROWS;")
    for st in plan.bwd:
        lines += _gemm_stage(plan, st, backward=True, a_global=st.layer == L - 1, train=True,
                             epilogue=bwd_epilogue(st.layer))
    lines.append("}")
    return "\n".join(lines)


def _wgrad_kernels(plan: _Plan) -> str:
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


def generate_wgsl(spec: MLPSpec, plan: _Plan, native_f16: bool) -> str:
    """The whole WGSL module for one model."""
    return "\n".join([_prelude(spec, plan, native_f16), read_source("wgsl/mlp_common.wgsl"),
                      _fused_kernels(spec, plan), _wgrad_kernels(plan)])


# -- device arrays --------------------------------------------------------------------------
class WgpuArray:
    """A float32 (rows x cols) array in a wgpu storage buffer."""

    def __init__(self, buffer: Any, shape: tuple[int, int], device: Any):
        self.buffer = buffer
        self.shape = shape
        self.dtype = np.dtype(np.float32)
        self.device = device
        self.bind_groups: dict[tuple, Any] = {}  # per (model, kernel, chunk): its slice's bind group

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * 4

    def __repr__(self) -> str:
        return f"WgpuArray(shape={self.shape}, dtype=float32)"


# -- the compiled model ---------------------------------------------------------------------
_BUFFER_BINDINGS = ("wc", "master", "grad", "mom1", "mom2", "hbuf", "zbuf", "dbuf", "wpart", "lpart", "losses")
# group-0 bindings each kernel uses (binding 0, the launch uniform, is in all of them)
_KERNEL_BINDINGS = {
    "fwd_infer": ("wc", "master"),
    "fwd_train": ("wc", "master", "hbuf", "zbuf"),
    "loss_grad": ("zbuf", "dbuf", "lpart"),
    "loss_reduce": ("lpart", "losses"),
    "bwd": ("wc", "zbuf", "dbuf"),
    "wgrad": ("hbuf", "dbuf", "wpart"),
    "grad_reduce": ("grad", "wpart"),
    "optimize": ("wc", "master", "grad", "mom1", "mom2"),
}
_KERNEL_IO = {"fwd_infer": ("x_in", "y_out"), "fwd_train": ("x_in",), "loss_grad": ("targets",)}
_IO_BINDING = {"x_in": 0, "y_out": 1, "targets": 2}


class _Recorder:
    """Dispatches of one submission plus the uniform slots they read."""

    def __init__(self, model: "WgpuModel"):
        self.model = model
        self.slots = np.zeros((UNIFORM_SLOTS, SLOT_BYTES // 4), dtype=np.uint32)
        self.used = 0
        self.encoder = None
        self.pass_ = None

    def slot(self, n_rows: int, *, rows_per_split: int = 0, first: bool = False, last: bool = False,
             loss_slot: int = 0, inv_count: float = 0.0, lr_t: float = 0.0, n_splits: int = 0,
             n_loss_wg: int = 0) -> int:
        if self.used == UNIFORM_SLOTS:
            self.flush()
        index = self.used
        self.used += 1
        row = self.slots[index]
        row[0:4] = (n_rows, rows_per_split, int(first) | (int(last) << 1), loss_slot)
        row[4:6] = np.array([inv_count, lr_t], dtype=np.float32).view(np.uint32)
        row[6:8] = (n_splits, n_loss_wg)
        return index * SLOT_BYTES

    def dispatch(self, kernel: str, offset: int, groups: tuple[int, int, int], io_group: Any = None) -> None:
        if self.pass_ is None:
            self.encoder = self.model.device.create_command_encoder()
            self.pass_ = self.encoder.begin_compute_pass()
        m = self.model
        self.pass_.set_pipeline(m.pipelines[kernel])
        self.pass_.set_bind_group(0, m.model_groups[kernel], [offset])
        if io_group is not None:
            self.pass_.set_bind_group(1, io_group, [])
        self.pass_.dispatch_workgroups(*groups)

    def flush(self) -> None:
        if self.pass_ is None:
            return
        m = self.model
        try:
            self.pass_.end()
            m.device.queue.write_buffer(m.buffers["uniform"], 0, self.slots[:self.used].tobytes())
            m.device.queue.submit([self.encoder.finish()])
        except Exception as exc:
            raise LaunchError(f"wgpu submission failed: {exc}") from exc
        self.pass_ = self.encoder = None
        self.used = 0


class WgpuModel(CompiledModel):
    backend = "wgpu"
    variant = "default"

    def __init__(self, spec: MLPSpec, device: Any, adapter_info: dict, limits: dict[str, int], native_f16: bool,
                 cache: Any = None, module_cache: dict | None = None, max_stage_rows: int = 4096):
        super().__init__(spec)
        self.device = device
        self.native_f16 = native_f16 and spec.precision == "fp16"
        self.storage = "f16" if self.native_f16 else "f32"
        self.plan = make_plan(spec, limits, 2 if self.native_f16 else 4, max_stage_rows)
        self.source = generate_wgsl(spec, self.plan, self.native_f16)
        if cache is not None:
            # the generated WGSL is this backend's cached artefact (wgpu-native compiles it in-process)
            device_name = f"{adapter_info.get('device', '')} {adapter_info.get('backend_type', '')}"
            self.source = cache.get_or_build(lambda: self.source.encode(), backend="wgpu", device=device_name,
                                             compiler=f"wgpu-native {_native_version(_import_wgpu())}",
                                             options={"storage": self.storage, "layout": LAYOUT_VERSION},
                                             source=self.source).decode()
        self._lock = threading.Lock()
        self._closed = False
        self.pipelines, self.layouts = self._build_pipelines(module_cache)
        self.buffers: dict[str, Any] = {}
        self._alloc()
        self.model_groups = {k: self._model_group(k) for k in self.pipelines}
        self._scratch: dict[str, WgpuArray] = {}
        self._pool: dict[int, list] = {}
        self.set_params(init_params(spec))
        self.set_optimizer_state(self._zero_state())

    # -- set-up ---------------------------------------------------------------------------
    def _build_pipelines(self, module_cache: dict | None):
        import wgpu  # noqa: PLC0415

        key = hashlib.sha256(self.source.encode()).hexdigest()
        cached = module_cache.get(key) if module_cache is not None else None
        if cached is not None:
            return cached
        try:
            module = self.device.create_shader_module(code=self.source)
        except Exception as exc:
            raise CompileError("the wgpu MLP module (WGSL)", str(exc), self.source) from exc
        storage = {"type": wgpu.BufferBindingType.storage}
        uniform = {"type": wgpu.BufferBindingType.uniform, "has_dynamic_offset": True, "min_binding_size": 32}
        binding_index = {name: i + 1 for i, name in enumerate(_BUFFER_BINDINGS)}
        pipelines, layouts = {}, {}
        kernels = [k for k in _KERNEL_BINDINGS if k != "wgrad"] + [f"wgrad_{i}" for i in range(self.plan.n_layers)]
        for kernel in kernels:
            group = kernel.split("_")[0] if kernel.startswith("wgrad") else kernel
            entries = [{"binding": 0, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": uniform}]
            entries += [{"binding": binding_index[n], "visibility": wgpu.ShaderStage.COMPUTE, "buffer": storage}
                        for n in _KERNEL_BINDINGS[group]]
            groups = [self.device.create_bind_group_layout(entries=entries)]
            io = _KERNEL_IO.get(kernel, ())
            if io:
                groups.append(self.device.create_bind_group_layout(entries=[
                    {"binding": _IO_BINDING[n], "visibility": wgpu.ShaderStage.COMPUTE,
                     "buffer": {"type": wgpu.BufferBindingType.storage if n == "y_out"
                                else wgpu.BufferBindingType.read_only_storage}} for n in io]))
            try:
                layout = self.device.create_pipeline_layout(bind_group_layouts=groups)
                pipelines[kernel] = self.device.create_compute_pipeline(
                    layout=layout, compute={"module": module, "entry_point": kernel})
            except Exception as exc:
                raise CompileError(f"the wgpu pipeline {kernel!r}", str(exc), self.source) from exc
            layouts[kernel] = groups
        if module_cache is not None:
            module_cache[key] = (pipelines, layouts)
        return pipelines, layouts

    def _buffer(self, name: str, nbytes: int, extra_usage: int = 0) -> Any:
        import wgpu  # noqa: PLC0415

        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST | extra_usage
        try:
            buf = self.device.create_buffer(size=max(16, (nbytes + 15) // 16 * 16), usage=usage, label=name)
        except Exception as exc:
            raise LaunchError(f"wgpu could not allocate {nbytes} bytes for {name}: {exc}") from exc
        self.buffers[name] = buf
        return buf

    def _alloc(self) -> None:
        import wgpu  # noqa: PLC0415

        plan, cb = self.plan, (2 if self.native_f16 else 4)
        p = plan.p
        self._buffer("wc", p * cb)
        for name in ("master", "grad", "mom1", "mom2"):
            self._buffer(name, p * 4)
        self._scratch_rows = self._scratch_splits = 0
        self._alloc_training_scratch(256, 1)
        self._buffer("lpart", MAX_EW_WORKGROUPS * 4)
        self._buffer("losses", (STEP_SLOTS + 1) * 4)
        try:
            self.buffers["uniform"] = self.device.create_buffer(
                size=UNIFORM_SLOTS * SLOT_BYTES, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
        except Exception as exc:
            raise LaunchError(f"wgpu could not allocate the uniform buffer: {exc}") from exc

    def _alloc_training_scratch(self, rows: int, splits: int) -> None:
        """(Re)allocate the per-chunk training buffers for ``rows`` rows and ``splits`` splits."""
        plan, cb = self.plan, (2 if self.native_f16 else 4)
        for name in ("hbuf", "zbuf", "dbuf", "wpart"):
            old = self.buffers.pop(name, None)
            if old is not None:
                old.destroy()
        self._buffer("hbuf", rows * sum(plan.kp) * cb)
        self._buffer("zbuf", rows * sum(plan.op) * 4)
        self._buffer("dbuf", rows * sum(plan.op) * cb)
        self._buffer("wpart", splits * plan.p * 4)
        self._scratch_rows, self._scratch_splits = rows, splits

    def _ensure_training_scratch(self, rows: int, splits: int) -> None:
        # grown on demand: a model that only serves inference never holds the training scratch
        if rows > self._scratch_rows or splits > self._scratch_splits:
            self._alloc_training_scratch(max(rows, self._scratch_rows), max(splits, self._scratch_splits))
            self.model_groups = {k: self._model_group(k) for k in self.pipelines}

    def _model_group(self, kernel: str) -> Any:
        binding_index = {name: i + 1 for i, name in enumerate(_BUFFER_BINDINGS)}
        group = "wgrad" if kernel.startswith("wgrad") else kernel
        entries = [{"binding": 0, "resource": {"buffer": self.buffers["uniform"], "offset": 0, "size": 32}}]
        entries += [{"binding": binding_index[n], "resource": {"buffer": self.buffers[n], "offset": 0,
                                                               "size": self.buffers[n].size}}
                    for n in _KERNEL_BINDINGS[group]]
        try:
            return self.device.create_bind_group(layout=self.layouts[kernel][0], entries=entries)
        except Exception as exc:
            raise LaunchError(f"wgpu bind group for {kernel}: {exc}") from exc

    def _io_group(self, kernel: str, start: int, rows: int, arrays: dict[str, WgpuArray]) -> Any:
        # cached on the last array (a forward's output), so it lives exactly as long as that array
        holder = list(arrays.values())[-1]
        key = (id(self), kernel, start, rows) + tuple(id(a) for a in arrays.values())
        group = holder.bind_groups.get(key)
        if group is None:
            entries = [{"binding": _IO_BINDING[n], "resource": {"buffer": a.buffer, "offset": start * a.shape[1] * 4,
                                                                 "size": rows * a.shape[1] * 4}}
                       for n, a in arrays.items()]
            try:
                group = self.device.create_bind_group(layout=self.layouts[kernel][1], entries=entries)
            except Exception as exc:
                raise LaunchError(f"wgpu bind group for {kernel} rows {start}..{start + rows}: {exc}") from exc
            holder.bind_groups[key] = group
        return group

    # -- host <-> device ------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise LaunchError("this wgpu model was closed")

    def upload(self, x: Any) -> WgpuArray:
        self._check_open()
        a = np.asarray(x)
        if a.ndim == 1:
            a = a.reshape(-1, 1)
        if a.ndim != 2:
            raise InvalidInput(f"upload expects a 2-D array; got shape {list(a.shape)}")
        a = np.ascontiguousarray(a, dtype=np.float32)
        arr = self._new_array(a.shape)
        self._write(arr, a)
        return arr

    def _new_array(self, shape: tuple[int, int], pooled: bool = False) -> WgpuArray:
        """A device array; ``pooled`` ones hand their buffer back to the model when collected
        (forward outputs: a loop of ``y = forward(x)`` then allocates nothing)."""
        import wgpu  # noqa: PLC0415

        nbytes = max(16, (shape[0] * shape[1] * 4 + 15) // 16 * 16)
        free = self._pool.get(nbytes) if pooled else None
        if free:
            buf = free.pop()
        else:
            usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            try:
                buf = self.device.create_buffer(size=nbytes, usage=usage)
            except Exception as exc:
                raise LaunchError(f"wgpu could not allocate {nbytes} bytes: {exc}") from exc
        arr = WgpuArray(buf, (int(shape[0]), int(shape[1])), self.device)
        if pooled:
            weakref.finalize(arr, self._pool.setdefault(nbytes, []).append, buf)
        return arr

    def _write(self, arr: WgpuArray, a: np.ndarray) -> None:
        if a.size:
            try:
                self.device.queue.write_buffer(arr.buffer, 0, a)
            except Exception as exc:
                raise LaunchError(f"wgpu upload failed: {exc}") from exc

    def download(self, a: Any) -> np.ndarray:
        if not isinstance(a, WgpuArray):
            return np.asarray(a)
        self._check_open()
        if a.nbytes == 0:
            return np.zeros(a.shape, dtype=np.float32)
        return self._read(a.buffer, a.nbytes, np.float32).reshape(a.shape)

    def _read(self, buffer: Any, nbytes: int, dtype) -> np.ndarray:
        try:
            raw = self.device.queue.read_buffer(buffer, 0, nbytes)
        except Exception as exc:
            raise LaunchError(f"wgpu download failed: {exc}") from exc
        return np.frombuffer(raw, dtype=dtype).copy()

    def synchronize(self) -> None:
        # a 4-byte read-back waits for all submitted work (wgpu-py 0.32's
        # on_submitted_work_done_sync does not match wgpu-native 29's callback signature)
        self._check_open()
        self._read(self.buffers["losses"], 4, np.float32)

    def _scratch_array(self, name: str, a: np.ndarray) -> WgpuArray:
        """A model-owned device array holding ``a`` (reused while the shape stays the same)."""
        arr = self._scratch.get(name)
        if arr is None or arr.shape != a.shape:
            arr = self._new_array(a.shape)
            self._scratch[name] = arr
        self._write(arr, a)
        return arr

    def _device_rows(self, a: Any, cols: int, name: str) -> tuple[WgpuArray, bool]:
        if isinstance(a, WgpuArray):
            if a.device is not self.device:
                raise InvalidInput(f"{name} lives on another wgpu device")
            if a.shape[1] != cols:
                raise InvalidInput(f"{name} must have shape [rows, {cols}]; got {list(a.shape)}")
            return a, True
        host = check_rows(a, cols, name)
        return self._scratch_array(name, host), False

    # -- compute --------------------------------------------------------------------------
    def forward(self, x: Any) -> Any:
        self._check_open()
        with self._lock:
            xa, on_device = self._device_rows(x, self.spec.n_input_dims, "input")
            rows = xa.shape[0]
            y = self._new_array((rows, self.spec.n_output_dims), pooled=True) if on_device else \
                self._scratch_out((rows, self.spec.n_output_dims))
            if rows:
                rec = _Recorder(self)
                step = self.plan.fwd_chunk_rows
                for start in range(0, rows, step):
                    n = min(step, rows - start)
                    group = self._io_group("fwd_infer", start, n, {"x_in": xa, "y_out": y})
                    rec.dispatch("fwd_infer", rec.slot(n), (_ceil_div(n, self.plan.rows), 1, 1), group)
                rec.flush()
            return y if on_device else self.download(y)

    def _scratch_out(self, shape: tuple[int, int]) -> WgpuArray:
        arr = self._scratch.get("output")
        if arr is None or arr.shape != shape:
            arr = self._new_array(shape)
            self._scratch["output"] = arr
        return arr

    def _record_step(self, rec: _Recorder, xa: WgpuArray, ya: WgpuArray, loss_slot: int, lr_t: float,
                     optimize: bool) -> None:
        plan = self.plan
        rows = xa.shape[0]
        chunk = min(plan.chunk_rows, (rows + 255) // 256 * 256)
        n_splits = max(1, min(plan.n_splits_max, chunk // 256))
        rows_per_split = _ceil_div(_ceil_div(chunk, n_splits), 16) * 16
        self._ensure_training_scratch(chunk, n_splits)
        inv_count = 1.0 / (rows * self.spec.n_output_dims)
        loss_wg = min(MAX_EW_WORKGROUPS, _ceil_div(chunk * plan.op[-1], 256))
        ew_wg = min(MAX_EW_WORKGROUPS, _ceil_div(plan.p, 256))
        starts = list(range(0, rows, chunk))
        for c, start in enumerate(starts):
            n = min(chunk, rows - start)
            first, last = c == 0, c == len(starts) - 1
            off = rec.slot(n, rows_per_split=rows_per_split, first=first, last=last, loss_slot=loss_slot,
                           inv_count=inv_count, lr_t=lr_t, n_splits=n_splits, n_loss_wg=loss_wg)
            tiles = _ceil_div(n, plan.rows)
            rec.dispatch("fwd_train", off, (tiles, 1, 1), self._io_group("fwd_train", start, n, {"x_in": xa}))
            rec.dispatch("loss_grad", off, (loss_wg, 1, 1), self._io_group("loss_grad", start, n, {"targets": ya}))
            rec.dispatch("loss_reduce", off, (1, 1, 1))
            rec.dispatch("bwd", off, (tiles, 1, 1))
            for i in range(plan.n_layers):
                rec.dispatch(f"wgrad_{i}", off, (_ceil_div(plan.kp[i] + 1, 64), _ceil_div(plan.op[i], 64), n_splits))
            rec.dispatch("grad_reduce", off, (ew_wg, 1, 1))
            if last and optimize:
                rec.dispatch("optimize", off, (ew_wg, 1, 1))

    def _lr_t(self, step: int) -> float:
        opt = self.spec.optimizer
        if opt.otype == "Adam":
            return opt.learning_rate * math.sqrt(1 - opt.beta2 ** step) / (1 - opt.beta1 ** step)
        return opt.learning_rate

    def _train_inputs(self, x: Any, y: Any) -> tuple[WgpuArray, WgpuArray]:
        xa, _ = self._device_rows(x, self.spec.n_input_dims, "input")
        ya, _ = self._device_rows(y, self.spec.n_output_dims, "target")
        if xa.shape[0] != ya.shape[0]:
            raise InvalidInput(f"target has {ya.shape[0]} rows but input has {xa.shape[0]}")
        if xa.shape[0] == 0:
            raise InvalidInput("training needs at least one row")
        return xa, ya

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        self._check_open()
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        with self._lock:
            xa, ya = self._train_inputs(x, y)
            losses = np.empty(steps, dtype=np.float32)
            done = 0
            while done < steps:
                batch = min(STEP_SLOTS, steps - done)
                rec = _Recorder(self)
                for s in range(batch):
                    self.step_count += 1
                    self._record_step(rec, xa, ya, s, self._lr_t(self.step_count), optimize=True)
                rec.flush()
                losses[done:done + batch] = self._read(self.buffers["losses"], batch * 4, np.float32)
                done += batch
            return losses

    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        self._check_open()
        with self._lock:
            xa, ya = self._train_inputs(x, y)
            rec = _Recorder(self)
            self._record_step(rec, xa, ya, 0, 0.0, optimize=False)
            rec.flush()
            loss = float(self._read(self.buffers["losses"], 4, np.float32)[0])
            grad = self._read(self.buffers["grad"], self.plan.p * 4, np.float32) / np.float32(self.spec.loss_scale)
            return loss, self._unpack(grad)

    # -- parameters -----------------------------------------------------------------------
    def _pack(self, params: dict[str, np.ndarray]) -> np.ndarray:
        flat = np.zeros(self.plan.p, dtype=np.float32)
        for i, (fan_in, fan_out) in enumerate(self.spec.layer_dims):
            w = flat[self.plan.woff[i]:self.plan.woff[i] + self.plan.op[i] * self.plan.kp[i]]
            w.reshape(self.plan.op[i], self.plan.kp[i])[:fan_out, :fan_in] = params[f"W{i}"]
            flat[self.plan.boff[i]:self.plan.boff[i] + fan_out] = params[f"b{i}"]
        return flat

    def _unpack(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        out = {}
        for i, (fan_in, fan_out) in enumerate(self.spec.layer_dims):
            w = flat[self.plan.woff[i]:self.plan.woff[i] + self.plan.op[i] * self.plan.kp[i]]
            out[f"W{i}"] = np.ascontiguousarray(w.reshape(self.plan.op[i], self.plan.kp[i])[:fan_out, :fan_in])
            out[f"b{i}"] = flat[self.plan.boff[i]:self.plan.boff[i] + fan_out].copy()
        return out

    def _write_buffer(self, name: str, data: np.ndarray) -> None:
        try:
            self.device.queue.write_buffer(self.buffers[name], 0, np.ascontiguousarray(data))
        except Exception as exc:
            raise LaunchError(f"wgpu upload of {name} failed: {exc}") from exc

    def get_params(self) -> dict[str, np.ndarray]:
        self._check_open()
        with self._lock:
            return self._unpack(self._read(self.buffers["master"], self.plan.p * 4, np.float32))

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        self._check_open()
        flat = self._pack(check_params(self.spec, params))
        with self._lock:
            self._write_buffer("master", flat)
            if self.native_f16:
                self._write_buffer("wc", flat.astype(np.float16))
            else:
                self._write_buffer("wc", nm.round_to(self.spec.precision, flat).astype(np.float32))

    def _slot_buffers(self) -> list[str]:
        return ["mom1", "mom2"] if self.spec.optimizer.otype == "Adam" else ["mom1"]

    def _zero_state(self) -> dict[str, np.ndarray]:
        shapes = param_shapes(self.spec)
        state = {n: np.zeros(shapes[n.split(".", 1)[1]], np.float32) for n in optimizer_state_names(self.spec)}
        state["step"] = np.zeros(1, dtype=np.int64)
        return state

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        self._check_open()
        slots = ("m", "v") if self.spec.optimizer.otype == "Adam" else ("velocity",)
        state: dict[str, np.ndarray] = {}
        with self._lock:
            for slot, buf in zip(slots, self._slot_buffers()):
                for name, value in self._unpack(self._read(self.buffers[buf], self.plan.p * 4, np.float32)).items():
                    state[f"{slot}.{name}"] = value
        state["step"] = np.array([self.step_count], dtype=np.int64)
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        self._check_open()
        shapes = param_shapes(self.spec)
        for name in optimizer_state_names(self.spec):
            if name not in state or np.shape(state[name]) != shapes[name.split(".", 1)[1]]:
                raise InvalidInput(f"optimizer state {name} is missing or has the wrong shape")
        if "step" not in state:
            raise InvalidInput("optimizer state lacks 'step'")
        slots = ("m", "v") if self.spec.optimizer.otype == "Adam" else ("velocity",)
        with self._lock:
            for slot, buf in zip(slots, self._slot_buffers()):
                params = {k.split(".", 1)[1]: np.asarray(v, np.float32) for k, v in state.items()
                          if k.startswith(slot + ".")}
                self._write_buffer(buf, self._pack(params))
            self.step_count = int(np.asarray(state["step"]).reshape(-1)[0])

    def device_bytes(self) -> int:
        return sum(b.size for b in self.buffers.values()) + sum(a.buffer.size for a in self._scratch.values())

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pooled = [b for bufs in self._pool.values() for b in bufs]
            for buf in list(self.buffers.values()) + [a.buffer for a in self._scratch.values()] + pooled:
                buf.destroy()
            self.buffers.clear()
            self._scratch.clear()
            self._pool.clear()
            self.model_groups = {}


# -- the backend ----------------------------------------------------------------------------
class WgpuBackend(Backend):
    name = "wgpu"

    def __init__(self, native_f16: bool | None = None, max_stage_rows: int | None = None):
        # native_f16=False stores fp16 models in f32 with emulated rounding even when the adapter
        # has shader-f16 (to test that path); None uses f16 whenever the adapter offers it
        self.native_f16 = native_f16
        # weight rows staged per chunk: None = whole layers on hardware, 16 on CPU adapters
        self.max_stage_rows = max_stage_rows
        self._adapter = None
        self._device = None
        self._modules: dict[str, Any] = {}  # WGSL hash -> (pipelines, layouts), per device
        self._lock = threading.Lock()

    def _get_adapter(self):
        if self._adapter is None:
            wgpu = _import_wgpu()
            power = os.environ.get("MMAD_WGPU_POWER", "high-performance")
            adapter = wgpu.gpu.request_adapter_sync(power_preference=power)
            if adapter is None:
                raise BackendUnavailable("wgpu", "wgpu found no adapter (no Vulkan/Metal/D3D12/GL driver)")
            self._adapter = adapter
        return self._adapter

    def probe(self) -> list[ProbeRow]:
        try:
            wgpu = _import_wgpu()
            adapter = self._get_adapter()
            info = dict(adapter.info)
            features = sorted(str(f) for f in adapter.features)
            limits = {k: int(adapter.limits[k]) for k in _LIMITS if k in adapter.limits}
        except BackendUnavailable as exc:
            return [ProbeRow("wgpu", "default", False, reason=exc.reason)]
        except Exception as exc:  # noqa: BLE001 - a probe never raises
            return [ProbeRow("wgpu", "default", False, reason=f"wgpu adapter request failed: {exc}")]
        software = _is_software(info)
        f16 = "shader-f16" in features
        details = {
            "adapter_type": info.get("adapter_type", ""), "backend_type": info.get("backend_type", ""),
            "vendor": info.get("vendor", ""), "driver": info.get("description", ""),
            "f16": f16, "subgroup": "subgroup" in features,
            "storage": "f16" if f16 else "f32 (fp16 rounding emulated with pack2x16float)",
            "features": [f for f in features if f in _INTERESTING_FEATURES],
            "limits": limits, "wgpu_py": wgpu.__version__,
        }
        reason = "software adapter (CPU): used only when forced with MMAD_BACKEND=wgpu" if software else ""
        return [ProbeRow("wgpu", "default", True, device=f"{info.get('device', '?')} ({info.get('backend_type', '?')})",
                         api_version=f"wgpu-native {_native_version(wgpu)}", reason=reason, software=software,
                         details=details)]

    def _get_device(self):
        if self._device is None:
            adapter = self._get_adapter()
            features = [f for f in ("shader-f16",) if f in adapter.features]
            limits = {k: adapter.limits[k] for k in _LIMITS if k in adapter.limits}
            try:
                self._device = adapter.request_device_sync(required_features=features, required_limits=limits)
            except Exception as exc:
                raise BackendUnavailable("wgpu", f"wgpu device request failed: {exc}") from exc
        return self._device

    def compile(self, spec: MLPSpec, variant: str | None = None, cache: Any = None) -> WgpuModel:
        if variant not in (None, "default"):
            raise SpecError("variant", f"the wgpu backend has one variant, 'default'; got {variant!r}")
        with self._lock:
            device = self._get_device()
            adapter = self._adapter
            native_f16 = "shader-f16" in device.features and self.native_f16 is not False
            limits = {k: int(device.limits[k]) for k in _LIMITS if k in device.limits}
            info = dict(adapter.info)
            stage_rows = self.max_stage_rows or (16 if _is_software(info) else 4096)
            return WgpuModel(spec, device, info, limits, native_f16, cache, self._modules, stage_rows)

    def close(self) -> None:
        self._modules.clear()
        self._device = None
        self._adapter = None


__all__ = ["WgpuBackend", "WgpuModel", "WgpuArray", "generate_wgsl", "make_plan"]
