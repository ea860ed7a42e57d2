"""The ``cublaslt`` variant: per-layer cuBLASLt matmuls with epilogs (nvmath-python) plus
element-wise kernels (``mmad/shaders/cuda/mlp_elementwise.cu``); the fastest on wide models (W),
where every fused kernel is register-bound. See :class:`CublasLtModel`.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import numpy as np

from mmad.backends.cache import KernelCache
from mmad.backends.contract import check_params, init_params, optimizer_slots
from mmad.backends.cuda.mma import DERIVATIVE_FROM_OUTPUT, NVRTC_OPTIONS, f32_literal, optimizer_defines
from mmad.backends.cuda.toolchain import (
    CudaModel, LoadedModule, cached_cubin, device_errors, nvrtc_compile, nvrtc_version,
)
from mmad.errors import InvalidInput, LaunchError, SpecError
from mmad.shaders import read_source
from mmad.spec import ACTIVATION_CODES, LOSS_CODES, MLPSpec, kernel_code_defines

log = logging.getLogger("mmad.backends.cuda")


def cublaslt_availability() -> tuple[bool, str, str]:
    """(usable, reason when not, nvmath version)."""
    try:
        import nvmath
        from nvmath.linalg.advanced import Matmul, MatmulEpilog  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA library it could not load
        return False, f"nvmath-python is not importable ({type(exc).__name__}: {exc})", ""
    return True, "", getattr(nvmath, "__version__", "?")


EW_KERNELS = ("ew_half", "ew_hidden", "ew_output", "ew_loss", "ew_backward", "ew_optimize")
LOSS_BLOCK, LOSS_ITEMS = 256, 8  # ew_loss: threads a block (a multiple of 32), elements a thread (loads in flight)
# a matmul of at least TUNED_MIN_ROWS rows runs the fastest of the heuristic's first
# TUNED_CANDIDATES algorithms, timed once per device, library and shape and kept in the kernel
# cache; smaller ones (and a model without a cache) the heuristic's first. H100, 2^20 rows: L's
# training 247 -> 264 M samples/s, W's 138 -> 142
TUNED_MIN_ROWS = 1 << 16
TUNED_CANDIDATES = 8
TUNED_REPEATS = 5  # timed runs of each candidate (after one warm-up)


def elementwise_source(spec: MLPSpec) -> str:
    """The CUDA source of a model's element-wise kernels (``EW_KERNELS``), as NVRTC gets it."""
    defines = {
        "NIN": spec.n_encoded_dims, "NOUT": spec.n_output_dims, "ACT": ACTIVATION_CODES[spec.activation],
        "OUT_ACT": ACTIVATION_CODES[spec.output_activation], "LOSS": LOSS_CODES[spec.loss],
        "HUBER_DELTA": f32_literal(spec.huber_delta),
        "STORE_DACT": int(spec.activation not in DERIVATIVE_FROM_OUTPUT), "LOSS_BLOCK": LOSS_BLOCK,
        "LOSS_ITEMS": LOSS_ITEMS, **optimizer_defines(spec),
    }
    head = kernel_code_defines() + "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + read_source("cuda/mlp_common.cuh") + read_source("cuda/mlp_elementwise.cu")


class CublasLtModel(CudaModel):
    """Per-layer cuBLASLt matmuls (nvmath-python, planned once per shape) + element-wise kernels.

    Each layer is ``h_{l+1}^T = act(W_l @ h_l^T + b_l)`` (W as A) so that cuBLASLt's bias runs
    along M: ReLU hidden layers use the RELU_BIAS epilog (fp16 out; its bias is the fp16 copy of
    the fp32 master; in training RELU_AUX_BIAS, which also keeps the sign bits of the
    pre-activation), other hidden layers and the output layer an fp32 result type with the BIAS
    epilog (fp32 bias; no C operand to read) and finish in ``shaders/cuda/mlp_elementwise.cu``;
    in training the output layer is fp16 (BIAS epilog, the fp16 bias), the loss's input, as
    tiny-cuda-nn's loss reads its network's fp16 output.
    Backward: weight gradients ``h @ delta^T`` (= dW^T, so that dW comes out row-major like W) as
    an fp32 matmul (fp32 zero C) whose BGRADB epilog sums delta over the rows for the bias
    gradient; input gradients ``W^T @ delta``: with ReLU the DRELU epilog applies the kept sign
    bits and writes the next fp16 delta itself, other activations an fp32 matmul finished by
    ``ew_backward``; then the optimizer kernel. (Unfused, the backward would write and read an fp32
    gradient per hidden layer and sum delta in a kernel of its own: ~1 ms a layer of W's training
    step at 2^20 rows.)

    Layout: every activation, pre-activation and delta is an (features, rows) array in F order,
    i.e. row-major [rows][features] memory. That is the order nvmath gives D whenever a C operand
    is passed (D follows C, and an (M, 1) C counts as column-major) or a bias epilog is used
    (column-major D), so results are used as they come: C-order activations would copy every
    matmul result into C order, which costs far more than the matmul (measured on the H100: a W
    layer 6.4 ms against 0.35 ms). The fp16 input is the fp32 input cast, and the output and loss
    kernels read [rows][outputs] like the targets and the result. ``_mm`` raises if a result ever
    comes back in another layout rather than copying it.
    """

    variant = "cublaslt"

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None):
        super().__init__(spec, cp, info)
        if spec.precision != "fp16":
            raise SpecError("precision", f"the cuda cublaslt variant computes in fp16; got {spec.precision!r}")
        from nvmath.linalg.advanced import Matmul, MatmulEpilog

        from nvmath import CudaDataType

        self._matmul_cls, self._epilog = Matmul, MatmulEpilog
        self._f32_type = CudaDataType.CUDA_R_32F
        self._f32_result: bool | None = None  # fp32 result type + BIAS epilog: untried / works / refused
        self.layers = spec.layer_dims  # (fan_in, fan_out)
        self.n_layers = len(self.layers)
        self.relu_epilog = spec.activation == "ReLU"  # hidden layers by RELU_(AUX_)BIAS, backward by DRELU
        self.store_dact = spec.activation not in DERIVATIVE_FROM_OUTPUT
        self.source = elementwise_source(spec)
        what = f"cuBLASLt element-wise kernels for model {spec.content_hash()}"

        def build() -> bytes:
            return nvrtc_compile(self.source, self.arch_digits, NVRTC_OPTIONS, what)

        cubin = cached_cubin(cache, build, backend="cuda-cublaslt", device=self.arch,
                             compiler=f"nvrtc-{nvrtc_version()}", options=NVRTC_OPTIONS, source=self.source)
        try:
            self._module = LoadedModule(cp, cubin, EW_KERNELS)
            self.w = [cp.zeros((fo, fi), dtype=cp.float32) for fi, fo in self.layers]
            self.b = [cp.zeros(fo, dtype=cp.float32) for _, fo in self.layers]
            self.w16 = [cp.zeros((fo, fi), dtype=cp.float16) for fi, fo in self.layers]
            # W^T in C order for the DRELU input gradients: as an F-order view of w16 the same matmul
            # took 0.71 ms against 0.47 (W layer, 2^20 rows, H100)
            self.w16t = [cp.zeros((fi, fo), dtype=cp.float16) for fi, fo in self.layers]
            self.b16 = [cp.zeros(fo, dtype=cp.float16) for _, fo in self.layers]
            n_slots = len(optimizer_slots(spec))
            self.slot_w = [[cp.zeros_like(w) for w in self.w] for _ in range(n_slots)]
            self.slot_b = [[cp.zeros_like(b) for b in self.b] for _ in range(n_slots)]
            # fp32 C (zeros) for the backward matmuls: fp16 operands with an fp32 C give an fp32 D
            self.zero_cols = {fi: cp.zeros((fi, 1), dtype=cp.float32) for fi, _ in self.layers}
        except device_errors(cp) as exc:
            raise LaunchError(f"setting up the cuBLASLt model failed: {exc}") from exc
        self._plans: dict[tuple, Any] = {}
        self._algorithms: dict[tuple, Any] = {}  # per plan: the stored choice, None for the heuristic's first
        self._cache = cache
        self.set_params(init_params(spec))

    # -- plumbing ---------------------------------------------------------------------------------
    def _launch(self, name: str, grid, block, args) -> None:
        self._launch_from(self._module, name, grid, block, args)

    def _mm_bias32(self, key: tuple, w16, h, bias):
        """fp32 ``w16 @ h + bias``: an fp32 result type with the BIAS epilog, so no C is read
        (an fp32 C broadcast along N, the other way to get fp32 out of fp16 operands, costs 2.5x
        the time of an fp16 layer on the H100). Where nvmath/cuBLASLt refuse that combination, the
        broadcast C, with a warning naming the reason."""
        if self._f32_result is not False:
            try:
                out = self._mm(key, w16, h, epilog=self._epilog.BIAS, epilog_inputs={"bias": bias},
                               options={"result_type": self._f32_type})
                self._f32_result = True
                return out
            except LaunchError as exc:
                if self._f32_result is True:  # it worked before: this is a real failure
                    raise
                self._f32_result = False
                self._plans.pop(key, None)
                log.warning("cublaslt: fp32 results with the BIAS epilog are refused here (%s); using an fp32 C "
                            "broadcast along N instead", exc)
        return self._mm(key, w16, h, c=bias.reshape(-1, 1))

    def _mm(self, key: tuple, a, b, c=None, epilog=None, epilog_inputs=None, options=None):
        """a @ b (+ c, broadcast along N) through a Matmul planned once per key (shapes fixed);
        the result as nvmath returns it, which must be F-contiguous (see the class docstring)."""
        return self._mm_aux(key, a, b, c, epilog, epilog_inputs, options)[0]

    def _mm_aux(self, key: tuple, a, b, c=None, epilog=None, epilog_inputs=None, options=None):
        """``_mm`` and the epilog's auxiliary outputs (nvmath's dict: ``relu_aux``, ``bgradb``)."""
        kind, layer, rows = key
        try:
            mm = self._plans.get(key)
            if mm is None:
                if any(k[2] != rows for k in self._plans):  # plans of one batch size at a time
                    self._free_plans()
                mm = self._matmul_cls(a, b, c=c, beta=None if c is None else 1.0, options=options)
                tuned = rows >= TUNED_MIN_ROWS and self._cache is not None
                mm.plan(epilog=epilog, epilog_inputs=epilog_inputs,
                        preferences={"limit": TUNED_CANDIDATES} if tuned else None)
                self._plans[key] = mm
                self._algorithms[key] = self._stored_algorithm(mm, key, (a, b, c), epilog) if tuned else None
            else:
                mm.reset_operands(a=a, b=b, c=c, epilog_inputs=epilog_inputs)
            result = mm.execute(algorithm=self._algorithms[key])
        except device_errors(self.cp) as exc:
            raise LaunchError(f"cuBLASLt matmul ({kind}, layer {layer}, {rows} rows) failed: {exc}") from exc
        except Exception as exc:  # nvmath reports unsupported shapes, types or epilogs as ValueError & co.
            raise LaunchError(f"cuBLASLt matmul ({kind}, layer {layer}, {rows} rows) was refused by "
                              f"nvmath-python: {type(exc).__name__}: {exc}") from exc
        out, aux = result if isinstance(result, tuple) else (result, {})
        if not out.flags.f_contiguous:  # a copy here would cost more than the matmul itself
            raise LaunchError(f"cuBLASLt matmul ({kind}, layer {layer}, {rows} rows) returned a {out.shape} result "
                              f"with strides {out.strides}; the cublaslt model needs it F-contiguous")
        return out, aux

    def _stored_algorithm(self, mm, key: tuple, operands: tuple, epilog) -> Any:
        """The fastest of a fresh plan's candidate algorithms, by its index in the heuristic's list
        (the same list for the same library, device and operands): timed on the first plan of this
        shape, then read from the kernel cache, so that every process runs the same algorithm and
        rounds the same way (nvmath's own autotune would time again in each)."""
        candidates = mm.algorithms
        if len(candidates) < 2:
            return None
        from nvmath.bindings import cublasLt

        layout = [None if o is None else [list(o.shape), list(o.strides), o.dtype.str] for o in operands]
        parts = dict(backend="cuda-cublaslt-algorithm", device=f"{self.info['name']} {self.arch}",
                     compiler=f"cublasLt {cublasLt.get_version()}",
                     options={"matmul": key[0], "epilog": getattr(epilog, "name", None), "candidates": len(candidates)},
                     source=json.dumps(layout))

        def time_candidates() -> bytes:
            cp = self.cp
            start, end = cp.cuda.Event(), cp.cuda.Event()
            ms = []
            for algorithm in candidates:
                mm.execute(algorithm=algorithm)  # warm-up
                start.record()
                for _ in range(TUNED_REPEATS):
                    mm.execute(algorithm=algorithm)
                end.record()
                end.synchronize()
                ms.append(cp.cuda.get_elapsed_time(start, end) / TUNED_REPEATS)
            return json.dumps({"index": min(range(len(ms)), key=ms.__getitem__), "ms": ms}).encode()

        index = json.loads(self._cache.get_or_build(time_candidates, **parts))["index"]
        return candidates[index]

    def _free_plans(self) -> None:
        for mm in self._plans.values():
            try:
                mm.free()
            except Exception:  # freeing is best effort; the plan is dropped either way
                pass
        self._plans.clear()
        self._algorithms.clear()

    def _forward_t(self, dx, rows: int, train: bool, half_out: bool = False):
        """Output pre-activations z^T (n_out, rows) fp32 (``half_out``: fp16, bias added by the
        matmul), each layer's input h^T, and what the backward needs of each hidden layer (in
        training): ReLU's sign bits (cuBLASLt's relu_aux), else the stored derivative or h."""
        cp = self.cp
        if dx.dtype == cp.float16:
            h16 = dx
        else:
            h16 = cp.empty(dx.shape, dtype=cp.float16)  # dx is [rows][n_in]: h^T is its F-order view
            self._launch("ew_half", (max(1, math.ceil(dx.size / 1024)),), (256,), (dx, np.int64(dx.size), h16))
        h = h16.T
        hs, dacts = [h], []
        for i in range(self.n_layers - 1):
            fo = self.layers[i][1]
            if self.relu_epilog and train:
                h, aux = self._mm_aux(("fwd-aux", i, rows), self.w16[i], h, epilog=self._epilog.RELU_AUX_BIAS,
                                      epilog_inputs={"bias": self.b16[i]})
                dacts.append(aux["relu_aux"])
            elif self.relu_epilog:
                h = self._mm(("fwd", i, rows), self.w16[i], h, epilog=self._epilog.RELU_BIAS,
                             epilog_inputs={"bias": self.b16[i]})
            else:
                z = self._mm_bias32(("fwd", i, rows), self.w16[i], h, self.b[i])
                h = cp.empty((fo, rows), dtype=cp.float16, order="F")
                dact = cp.empty((fo, rows), dtype=cp.float16, order="F") if (train and self.store_dact) else h
                self._launch("ew_hidden", (math.ceil(z.size / 256),), (256,),
                             (z, np.int64(z.size), h, dact, np.int32(train)))
                dacts.append(dact if self.store_dact else h)
            hs.append(h)
        last = self.n_layers - 1
        if half_out:
            zt = self._mm(("fwd16", last, rows), self.w16[last], h, epilog=self._epilog.BIAS,
                          epilog_inputs={"bias": self.b16[last]})
        else:
            zt = self._mm_bias32(("fwd", last, rows), self.w16[last], h, self.b[last])
        return zt, hs, dacts

    # -- compute ------------------------------------------------------------------------------------
    def forward(self, x: Any, out_dtype: Any = np.float32) -> Any:
        """See ``CompiledModel.forward``. ``out_dtype`` float16: without an output activation the
        output layer's matmul writes fp16 itself (BIAS epilog, the fp16 bias); fp16 device inputs
        are used as the first layer's operand without a cast."""
        cp = self.cp
        half_out = self._half_out(out_dtype)
        dx, from_host = self._device_input(x, self.spec.n_input_dims, "input", encode=True, keep_half=half_out)
        rows = dx.shape[0]
        if not rows:
            out = cp.empty((0, self.spec.n_output_dims), dtype=cp.float16 if half_out else cp.float32)
        elif self.spec.output_activation == "None":
            # z^T in F order is out, C order
            out = self._forward_t(dx, rows, train=False, half_out=half_out)[0].T
        else:
            zt, _, _ = self._forward_t(dx, rows, train=False)  # [rows][n_out] memory, like out
            out = cp.empty((rows, self.spec.n_output_dims), dtype=cp.float32)
            self._launch("ew_output", (math.ceil(zt.size / 256),), (256,), (zt, np.int64(zt.size), out))
            if half_out:
                out = out.astype(cp.float16)
        return self.download(out) if from_host else out

    def _grads(self, dx, dy, rows: int, on_layer) -> Any:
        """Forward, loss, backward; ``on_layer(i, dW, db)`` once per layer, last first."""
        cp = self.cp
        n_out = self.spec.n_output_dims
        # the output layer in fp16 (its BIAS epilog, the fp16 bias), as the loss reads it: an fp32
        # z written and read back cost L's step ~0.18 ms of ~4 (H100, 2^20 rows)
        zt, hs, kept = self._forward_t(dx, rows, train=True, half_out=True)
        # zt, dy (rows x n_out, C order) and delta hold [rows][n_out]
        delta = cp.empty((n_out, rows), dtype=cp.float16, order="F")
        blocks = math.ceil(zt.size / (LOSS_BLOCK * LOSS_ITEMS))  # one partial loss sum each
        partial = cp.empty(blocks, dtype=cp.float32)
        grad_scale = np.float32(self.spec.loss_scale / (rows * n_out))
        self._launch("ew_loss", (blocks,), (LOSS_BLOCK,), (zt, dy, np.int64(zt.size), grad_scale, delta, partial))
        loss = partial.sum(dtype=cp.float64)
        for i in reversed(range(self.n_layers)):
            fi = self.layers[i][0]
            # dW^T = h @ delta^T, (fi, fo) F-contiguous: its transpose is dW row-major, like W;
            # BGRADB sums delta^T over the rows (K) into db
            dwt, aux = self._mm_aux(("wgrad", i, rows), hs[i], delta.T, c=self.zero_cols[fi],
                                    epilog=self._epilog.BGRADB)
            dw, db = dwt.T, aux["bgradb"]
            if i > 0:  # the input gradient uses this layer's weights before the update below
                if self.relu_epilog:
                    delta = self._mm(("dgrad", i, rows), self.w16t[i], delta, epilog=self._epilog.DRELU,
                                     epilog_inputs={"relu_aux": kept[i - 1]})
                else:
                    g = self._mm(("dgrad", i, rows), self.w16[i].T, delta, c=self.zero_cols[fi])
                    delta = cp.empty((fi, rows), dtype=cp.float16, order="F")
                    self._launch("ew_backward", (math.ceil(g.size / 256),), (256,),
                                 (g, kept[i - 1], np.int64(g.size), delta))
            on_layer(i, dw, db)
        return loss

    def _optimize(self, i: int, mode: int, dw, db, lr_t: float) -> None:
        w, b = self.w[i], self.b[i]
        s1w, s1b = self.slot_w[0][i], self.slot_b[0][i]
        s2w, s2b = self.slot_w[-1][i], self.slot_b[-1][i]
        total = w.size + b.size
        self._launch("ew_optimize", (math.ceil(total / 256),), (256,),
                     (np.int32(mode), np.int32(w.size), np.int32(b.size), w, b,
                      w if dw is None else dw, b if db is None else db, s1w, s1b, s2w, s2b,
                      self.w16[i], self.w16t[i], self.b16[i], np.int32(self.layers[i][0]), np.float32(lr_t),
                      np.float32(1.0 / self.spec.loss_scale)))

    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        dx, dy, rows = self._prepare_batch(x, y)
        losses = self.cp.zeros(steps, dtype=self.cp.float64)
        for s in range(steps):
            lr_t = self.next_step_rate()
            losses[s] = self._grads(dx, dy, rows, lambda i, dw, db: self._optimize(i, 0, dw, db, lr_t))
            self.step_count += 1
        return (self.download(losses) / (rows * self.spec.n_output_dims)).astype(np.float32)

    def loss_and_grads(self, x: Any, y: Any) -> tuple[float, dict[str, np.ndarray]]:
        dx, dy, rows = self._prepare_batch(x, y)
        grads: dict[str, np.ndarray] = {}

        def keep(i: int, dw, db) -> None:
            grads[f"W{i}"] = self.download(dw) / np.float32(self.spec.loss_scale)
            grads[f"b{i}"] = self.download(db) / np.float32(self.spec.loss_scale)

        loss = self._grads(dx, dy, rows, keep)
        value = float(self.download(loss)) / (rows * self.spec.n_output_dims)
        return value, {k: grads[k] for k in sorted(grads, key=lambda s: (int(s[1:]), s[0]))}

    # -- parameters ---------------------------------------------------------------------------------
    def get_params(self) -> dict[str, np.ndarray]:
        out = {}
        for i in range(self.n_layers):
            out[f"W{i}"] = self.download(self.w[i])
            out[f"b{i}"] = self.download(self.b[i])
        return out

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        params = check_params(self.spec, params)
        try:
            for i in range(self.n_layers):
                self.w[i][...] = self.cp.asarray(params[f"W{i}"])
                self.b[i][...] = self.cp.asarray(params[f"b{i}"])
        except device_errors(self.cp) as exc:
            raise LaunchError(f"uploading parameters failed: {exc}") from exc
        for i in range(self.n_layers):
            self._optimize(i, 2, None, None, 0.0)

    def _read_slot(self, slot: int) -> dict[str, np.ndarray]:
        out = {}
        for i in range(self.n_layers):
            out[f"W{i}"] = self.download(self.slot_w[slot][i])
            out[f"b{i}"] = self.download(self.slot_b[slot][i])
        return out

    def _write_slots(self, slots: list[dict[str, np.ndarray]], step: int) -> None:
        try:
            for j, values in enumerate(slots):
                for i in range(self.n_layers):
                    self.slot_w[j][i][...] = self.cp.asarray(values[f"W{i}"])
                    self.slot_b[j][i][...] = self.cp.asarray(values[f"b{i}"])
        except device_errors(self.cp) as exc:
            raise LaunchError(f"uploading the optimizer state failed: {exc}") from exc

    def device_bytes(self) -> int:
        arrays = [*self.w, *self.b, *self.w16, *self.w16t, *self.b16]
        for slots in (*self.slot_w, *self.slot_b):
            arrays += slots
        return int(sum(a.nbytes for a in arrays))

    def close(self) -> None:
        self._free_plans()
        for name in ("w", "b", "w16", "w16t", "b16", "slot_w", "slot_b", "zero_cols"):
            if hasattr(self, name):
                delattr(self, name)


