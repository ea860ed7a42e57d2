"""cpu backend: NumPy. Always available, and the oracle every other backend is checked against.

Three numerics modes (``CpuBackend(numerics=...)`` or ``MMAD_CPU_NUMERICS``):

* ``fp32`` (default for serving): everything in float32, no rounding to the compute type.
* ``emulate``: float32 with rounding to the spec's precision (fp16/bf16) at exactly the points
  the device kernels round (see :mod:`mmad.backends.contract`), for tight comparisons.
* ``float64``: everything in float64 — the reference the tolerances of docs/design.md refer to.

Rows are processed in chunks so that activations stay in cache; weight gradients are summed
over chunks in the working precision. A grid encoding's tables (``grid{k}``) are parameters like
the layers': the forward interpolates them (rounded to the compute type in ``emulate``), the
backward scatters d loss / d encoding into them, and Adam steps them as tcnn steps its encoding
parameters (``numerics.grid_adam_update``). ``forward_to_host`` casts each chunk's input and output
on the way (FP16 with the bit-exact converters below) and can spread the chunks over threads.
"""

from __future__ import annotations

import os
import platform
import threading
from concurrent.futures import Executor, wait
from typing import Any

import numpy as np

from mmad.backends import numerics as nm
from mmad.backends.contract import (
    Backend, CompiledModel, DeviceInfo, ProbeRow, check_device_index, check_finite_rows, check_host_output, check_params,
    check_rows_shape, init_params, optimizer_slots, output_dtype,
)
from mmad.errors import InvalidInput, SpecError
from mmad.spec import MLPSpec

NUMERICS_MODES = ("fp32", "emulate", "float64")
CHUNK_ROWS = 8192
TRAIN_CHUNK_ROWS = 2048  # forward + backward of one chunk stay in cache
HOST_CHUNK_ROWS = 4096  # forward_to_host: a chunk's input, activations and output stay in L2
FAST_CAST_MIN_VALUES = 1 << 14  # below this NumPy's single cast call costs less than the converters' calls


# -- FP16 <-> float32 ------------------------------------------------------------------------
# NumPy converts float16 in software (~2 ns a value here, more than the forward's per-value
# cost on the wire's FP16). These do the same conversions with a few whole-vector integer and
# float operations on cache-sized chunks, 2-3x faster, bit-identical to NumPy's casts (round to
# nearest even, subnormals, overflow to Inf); chunks holding Inf/NaN take NumPy's cast, whose
# NaN payload handling they then match by construction.
_HALF_SCALE = np.float32(2.0 ** 112)  # f16 exponent bias 15 -> f32 bias 127
_F16_NONFINITE = np.float32(65536.0)  # what an f16 Inf/NaN becomes on the fast path (max finite: 65504)
_F32_EXPONENT = np.uint32(0x7F800000)
_F16_MIN_NORMAL_BITS = np.uint32(113 << 23)  # 2^-14 as float32 bits: FP16's quantum stops shrinking below
_QUANTUM_TO_MAGIC = np.uint32(13 << 23)  # 2^13 x a value's binade: its sum with the value keeps 10 fraction bits
_F16_ROUNDS_TO_INF_BITS = np.uint32(0x477FF000)  # 65520: from here up the FP16 is Inf (or NaN, past Inf)
_HALF_UNSCALE = np.float32(2.0 ** -112)  # f32 bias 127 -> f16 bias 15 (FP16 subnormals -> f32 subnormals)


def half_to_float(src: np.ndarray, out: np.ndarray) -> None:
    """``out[...] = src`` for float16 ``src`` and float32 ``out`` of one shape, both C-contiguous."""
    bits = out.view(np.int32)
    np.copyto(bits, src.view(np.int16), casting="unsafe")  # sign-extended
    np.left_shift(bits, 13, out=bits)
    np.bitwise_and(bits, np.int32(-0x70002000), out=bits)  # 0x8FFFE000: sign + exponent + mantissa
    np.multiply(out, _HALF_SCALE, out=out)  # exact; also scales f16 subnormals to f32 normals
    if out.size and (out.max() >= _F16_NONFINITE or out.min() <= -_F16_NONFINITE):
        np.copyto(out, src)


def float_to_half(src: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    """``out[...] = src`` for float32 ``src`` and float16 ``out``; ``scratch``: 2 uint32 arrays of src's size.

    The float adder rounds: with ``m = 2^(max(e, -14) + 13)`` for ``|x|``'s binade ``e``,
    ``(|x| + m) - m`` is ``|x|`` rounded to nearest even at FP16's quantum there (2^(e-10), and
    2^-24 for FP16 subnormals), exactly representable in FP16. Scaled by 2^-112 (exact: FP16
    subnormals become float32 subnormals) its float32 bits shifted right by 13 are the FP16's.
    """
    bits = src.view(np.uint32)
    mag, magic = scratch[0].reshape(src.shape), scratch[1].reshape(src.shape)
    np.bitwise_and(bits, np.uint32(0x7FFFFFFF), out=mag)
    if mag.size and mag.max() >= _F16_ROUNDS_TO_INF_BITS:  # Inf, NaN (whose payload NumPy's cast keeps)
        with np.errstate(over="ignore"):  # overflow to Inf is the FP16 result
            np.copyto(out, src)
        return
    np.bitwise_and(mag, _F32_EXPONENT, out=magic)
    np.maximum(magic, _F16_MIN_NORMAL_BITS, out=magic)
    np.add(magic, _QUANTUM_TO_MAGIC, out=magic)
    value, magic_value = mag.view(np.float32), magic.view(np.float32)
    np.add(value, magic_value, out=value)
    np.subtract(value, magic_value, out=value)
    np.multiply(value, _HALF_UNSCALE, out=value)
    np.right_shift(mag, 13, out=mag)
    np.right_shift(bits, 16, out=magic)
    np.bitwise_and(magic, np.uint32(0x8000), out=magic)
    np.bitwise_or(mag, magic, out=mag)
    np.copyto(out.view(np.uint16), mag, casting="unsafe")


def copy_rows(src: np.ndarray, dst: np.ndarray, executor: Executor | None = None) -> None:
    """``dst[...] = src`` for 2-D float16/float32 arrays of one shape, ``HOST_CHUNK_ROWS`` rows at
    a time (on ``executor``'s threads where given: the casts release the GIL), FP16 converted by
    :func:`half_to_float` / :func:`float_to_half` (bit-identical to NumPy's casts, ~2-3x faster)."""

    def chunk(start: int) -> None:
        s, d = src[start:start + HOST_CHUNK_ROWS], dst[start:start + HOST_CHUNK_ROWS]
        contiguous = s.flags.c_contiguous and d.flags.c_contiguous
        if contiguous and s.dtype == np.float16 and d.dtype == np.float32:
            half_to_float(s, d)
        elif contiguous and s.dtype == np.float32 and d.dtype == np.float16:
            float_to_half(s, d, np.empty((2, s.size), np.uint32))
        else:
            np.copyto(d, s, casting="same_kind")

    starts = range(0, src.shape[0], HOST_CHUNK_ROWS)
    if executor is None or len(starts) < 2:
        for start in starts:
            chunk(start)
    else:
        for future in [executor.submit(chunk, start) for start in starts]:
            future.result()


class _Scratch:
    """One thread's reusable buffers, by name, grown when a larger one is needed.

    A fresh NumPy array of a chunk's size (1-2 MiB) is often fresh pages from the kernel:
    measured, up to ~10,000 page faults and +20 ms of CPU per 65,536-row FP16 forward when every
    chunk allocated its input, layer and cast buffers anew.
    """

    def __init__(self) -> None:
        self._flat: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A C-contiguous array of ``shape`` and ``dtype`` over the buffer ``name`` (contents undefined)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        flat = self._flat.get(name)
        if flat is None or flat.size < nbytes:
            flat = self._flat[name] = np.empty(nbytes, dtype=np.uint8)
        return flat[:nbytes].view(dtype).reshape(shape)


class CpuModel(CompiledModel):
    backend = "cpu"
    variant = "numpy"
    supports_ema = True

    def __init__(self, spec: MLPSpec, numerics: str = "fp32"):
        super().__init__(spec)
        if numerics not in NUMERICS_MODES:
            raise SpecError("numerics", f"unknown cpu numerics {numerics!r}; allowed: {', '.join(NUMERICS_MODES)}")
        self.numerics = numerics
        self.dtype = np.float64 if numerics == "float64" else np.float32
        self.compute = spec.precision if numerics == "emulate" else "fp32"
        self._params = {k: v.astype(self.dtype) for k, v in init_params(spec).items()}
        # one dict per optimizer slot (contract.optimizer_slots): parameter name -> array
        self._slots = [{n: np.zeros_like(v) for n, v in self._params.items()} for _ in optimizer_slots(spec)]
        self._grid_names = list(spec.grid_shapes)
        # Adam's step count per grid table entry (tcnn's param_steps: untouched entries do not step)
        self._grid_steps = ({n: np.zeros(self._params[n].shape, np.uint32) for n in self._grid_names}
                            if spec.optimizer.otype == "Adam" else {})
        self._ema_slot = optimizer_slots(spec).index("ema") if spec.optimizer.ema is not None else None
        if self._ema_slot is not None:  # inference serves the initial weights until the first step
            self._slots[self._ema_slot] = {n: v.copy() for n, v in self._params.items()}
        self._refresh_compute_weights()
        self._scratch_by_thread = threading.local()

    # -- parameters -----------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.spec.layer_dims)

    def _refresh_compute_weights(self) -> None:
        # the kernels multiply by a rounded copy of the masters, transposed for row-major h @ W^T,
        # and interpolate a rounded copy of the grid tables (tcnn keeps them in the network's type)
        self._wt = [np.ascontiguousarray(nm.round_to(self.compute, self._params[f"W{i}"]).T)
                    for i in range(self.n_layers)]
        self._grids = [nm.round_to(self.compute, self._params[n]) for n in self._grid_names]
        self._refresh_inference_weights()

    def _refresh_inference_weights(self) -> None:
        # (transposed weights, biases, grid tables) inference uses: with EMA the averages, else the training ones
        if self._ema_slot is None:
            self._infer = (self._wt, [self._params[f"b{i}"] for i in range(self.n_layers)], self._grids)
            return
        ema = self._slots[self._ema_slot]
        self._infer = ([np.ascontiguousarray(nm.round_to(self.compute, ema[f"W{i}"]).T) for i in range(self.n_layers)],
                       [ema[f"b{i}"] for i in range(self.n_layers)],
                       [nm.round_to(self.compute, ema[n]) for n in self._grid_names])

    def get_params(self) -> dict[str, np.ndarray]:
        return {k: v.astype(np.float32) for k, v in self._params.items()}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        checked = check_params(self.spec, params)
        if self.dtype == np.float64:  # the oracle keeps float64 values as given (finite differences step below fp32)
            checked = {k: np.asarray(params[k]) if np.asarray(params[k]).dtype == np.float64 else v
                       for k, v in checked.items()}
        self.params_version += 1
        self._params = {k: np.array(v, dtype=self.dtype) for k, v in checked.items()}
        if self._ema_slot is not None:  # inference serves the weights just set (an EMA checkpoint follows when restoring)
            self._slots[self._ema_slot] = {n: v.copy() for n, v in self._params.items()}
        self._refresh_compute_weights()

    def _read_slot(self, slot: int) -> dict[str, np.ndarray]:
        return {name: value.astype(np.float32) for name, value in self._slots[slot].items()}

    def _write_slots(self, slots: list[dict[str, np.ndarray]], step: int) -> None:
        self._slots = [{name: value.astype(self.dtype) for name, value in values.items()} for values in slots]
        self._refresh_inference_weights()

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        """The contract's state plus ``steps.grid{k}``: Adam's per-entry step counts (uint32)."""
        state = super().get_optimizer_state()
        state.update({f"steps.{name}": steps.copy() for name, steps in self._grid_steps.items()})
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        """Restore what ``get_optimizer_state`` returned. A state without ``steps.grid{k}`` (written
        by another backend) counts the optimizer's steps for every entry Adam has moved (v ≠ 0)."""
        super().set_optimizer_state(state)
        for name, steps in self._grid_steps.items():
            steps[...] = nm.grid_steps_from_state(state, name, steps.shape, self.step_count)

    def device_bytes(self) -> int:
        return (sum(a.nbytes for a in self._params.values()) + sum(a.nbytes for s in self._slots for a in s.values())
                + sum(a.nbytes for a in self._grid_steps.values()))

    # -- compute --------------------------------------------------------------------------
    def _forward_chunk(self, x: np.ndarray, keep: bool, scratch: _Scratch | None = None,
                       out: np.ndarray | None = None):
        """(output, inputs of every layer, pre-activations, grid lookups) for rows ``x``; the last
        three only with ``keep``.

        ``keep`` is training: it runs on the training weights, without it on the inference
        weights (they differ only under EMA). Without ``keep`` the activations run in place, each
        layer's result in ``scratch``'s two alternating buffers (fresh arrays without one) and the
        output layer's in ``out`` if given.
        """
        wts, biases, grids = ((self._wt, [self._params[f"b{i}"] for i in range(self.n_layers)], self._grids)
                              if keep else self._infer)
        encoded, lookups = nm.encode_with_lookups(self.spec.encoding, np.asarray(x, dtype=self.dtype), grids)
        h = nm.round_to(self.compute, encoded)
        hs, zs = [h], []
        for i in range(self.n_layers):
            last = i == self.n_layers - 1
            shape = (h.shape[0], wts[i].shape[1])
            if last and out is not None:
                z = out
            elif scratch is not None and not keep:
                z = scratch.array(f"layer{i % 2}", shape, self.dtype)
            else:
                z = np.empty(shape, self.dtype)
            np.matmul(h, wts[i], out=z)
            z += biases[i]
            act = self.spec.output_activation if last else self.spec.activation
            h = nm.activate(act, z) if keep else nm.activate_in_place(act, z)
            if not last:
                h = nm.round_to(self.compute, h)
            if keep:
                zs.append(z)
                hs.append(h)
        return h, hs, zs, lookups

    def _scratch(self) -> _Scratch:
        """This thread's buffers for :meth:`forward_to_host`'s chunks."""
        scratch = getattr(self._scratch_by_thread, "scratch", None)
        if scratch is None:
            scratch = self._scratch_by_thread.scratch = _Scratch()
        return scratch

    def forward(self, x: np.ndarray, out_dtype: Any = np.float32) -> np.ndarray:
        dtype = output_dtype(out_dtype)
        x = self.check_input(x)
        out = np.empty((x.shape[0], self.spec.n_output_dims), dtype=np.float32)
        for start in range(0, x.shape[0], CHUNK_ROWS):
            out[start:start + CHUNK_ROWS] = self._forward_chunk(x[start:start + CHUNK_ROWS], keep=False)[0]
        return out if dtype == np.float32 else out.astype(dtype)

    def forward_to_host(self, x: np.ndarray, out: np.ndarray, executor: Executor | None = None,
                        check_finite: bool = False) -> None:
        """``forward(x)`` written into ``out``, chunk by chunk, each chunk's casts fused with its forward.

        ``x`` may be float16 (the wire's FP16) or float32, ``out`` float16 or float32: no
        whole-array cast or copy is made. With an ``executor`` the chunks run on its threads
        (NumPy's matmul and casts release the GIL) and this call waits for all of them.
        """
        x = self.check_host_input(x)
        out = check_host_output(out, x.shape[0], self.spec.n_output_dims)
        if check_finite:
            check_finite_rows(x)
        starts = range(0, x.shape[0], HOST_CHUNK_ROWS)

        def chunk(start: int) -> None:
            stop = min(start + HOST_CHUNK_ROWS, x.shape[0])
            xc, oc = x[start:stop], out[start:stop]
            scratch = self._scratch()
            if xc.dtype == np.float16 and self.dtype == np.float32 and xc.size >= FAST_CAST_MIN_VALUES:
                h = scratch.array("input", xc.shape, np.float32)
                half_to_float(xc, h)
                xc = h
            if oc.dtype == self.dtype and oc.flags.c_contiguous:
                self._forward_chunk(xc, False, scratch, out=oc)  # the output layer writes straight into out
                return
            y = self._forward_chunk(xc, False, scratch)[0]
            if oc.dtype == np.float16 and y.dtype == np.float32 and y.size >= FAST_CAST_MIN_VALUES:
                float_to_half(y, oc, scratch.array("cast", (2, y.size), np.uint32))
            else:
                np.copyto(oc, y, casting="same_kind")

        if executor is None or len(starts) < 2:
            for start in starts:
                chunk(start)
            return
        futures = [executor.submit(chunk, start) for start in starts]
        wait(futures)  # all of them, even after an error: none may still write into ``out`` after this returns
        for future in futures:
            future.result()  # the first error, if any

    def check_host_input(self, x: np.ndarray) -> np.ndarray:
        """Like ``check_input``, but float16 stays float16 (cast per chunk)."""
        x = np.asarray(x)
        if x.dtype == np.float16 and x.ndim == 2 and x.shape[1] == self.spec.n_input_dims:
            return np.ascontiguousarray(x)
        return self.check_input(x)

    def _loss_and_grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        spec = self.spec
        grads = {k: np.zeros_like(v) for k, v in self._params.items()}
        # Every loss is element-wise (relative losses normalise by their own row), so each chunk's
        # gradient needs only that chunk: forward and backward run chunk by chunk while its
        # activations are still in cache.
        scale = spec.loss_scale / y.size
        loss_sum = 0.0
        for start in range(0, x.shape[0], TRAIN_CHUNK_ROWS):
            stop = start + TRAIN_CHUNK_ROWS
            pred, hs, zs, lookups = self._forward_chunk(x[start:stop], keep=True)
            values, dpred = nm.loss_terms(spec.loss, pred, y[start:stop].astype(self.dtype),
                                          delta=spec.huber_delta)
            loss_sum += float(values.sum(dtype=np.float64))
            self._backprop_chunk(dpred * scale, hs, zs, lookups, grads)
        for g in grads.values():
            g /= spec.loss_scale
        return loss_sum / y.size, grads

    def _backprop_chunk(self, dpred: np.ndarray, hs: list[np.ndarray], zs: list[np.ndarray], lookups: list,
                        grads: dict[str, np.ndarray], want_encoded: bool = False) -> np.ndarray | None:
        """Add one chunk's loss-scaled gradients into ``grads`` from the loss-scaled d loss / d
        output ``dpred``; returns d loss / d encoded input (rounded to the compute type, loss-scaled)
        when the grids need it or ``want_encoded``."""
        spec = self.spec
        delta = nm.round_to(self.compute, dpred * nm.activation_grad(spec.output_activation, zs[-1]))
        for i in reversed(range(self.n_layers)):
            grads[f"W{i}"] += delta.T @ hs[i]
            grads[f"b{i}"] += delta.sum(axis=0)
            if i:
                delta = (delta @ self._wt[i].T) * nm.activation_grad(spec.activation, zs[i - 1])
                delta = nm.round_to(self.compute, delta)
        if not (lookups or want_encoded):
            return None
        # on through the first layer into the grid tables (and the encoding's inputs)
        d_encoded = nm.round_to(self.compute, delta @ self._wt[0].T)
        if lookups:
            tables = nm.grid_gradients(spec.encoding, spec.n_input_dims, lookups, d_encoded, self._grids)
            for name, g in zip(self._grid_names, tables):
                grads[name] += g
        return d_encoded

    def forward_train(self, x: Any, out_dtype: Any = np.float32, stream: Any = None) -> tuple[np.ndarray, Any]:
        """See ``CompiledModel.forward_train``: every chunk's layer inputs, pre-activations and
        grid lookups kept for ``backward``."""
        exact = self.dtype == np.float64 and np.dtype(out_dtype) == np.float64  # the oracle's own precision
        dtype = np.dtype(np.float64) if exact else output_dtype(out_dtype)
        x = self._train_input(x)
        out = np.empty((x.shape[0], self.spec.n_output_dims), dtype=self.dtype)
        chunks = []
        for start in range(0, x.shape[0], TRAIN_CHUNK_ROWS):
            xc = x[start:start + TRAIN_CHUNK_ROWS]
            pred, hs, zs, lookups = self._forward_chunk(xc, keep=True)
            out[start:start + TRAIN_CHUNK_ROWS] = pred
            chunks.append((xc, hs, zs, lookups))
        return out.astype(dtype, copy=False), self._forward_context(x.shape[0], chunks)

    def _train_input(self, x: Any) -> np.ndarray:
        """``check_input``, except that the float64 numerics keep float64 inputs as they are (a
        finite-difference or torch.autograd.gradcheck step is below float32's resolution)."""
        x = np.asarray(x)
        if self.dtype == np.float64 and x.dtype == np.float64:
            return np.ascontiguousarray(check_rows_shape(x, self.spec.n_input_dims, "input"))
        return self.check_input(x)

    def backward(self, ctx: Any, dL_dy: Any, want_input_grad: bool = False,
                 stream: Any = None) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
        """See ``CompiledModel.backward``: chunk by chunk from the activations ``forward_train`` kept."""
        self.check_forward_context(ctx, dL_dy)
        dL_dy = np.asarray(check_rows_shape(np.asarray(dL_dy), self.spec.n_output_dims, "dL_dy"), dtype=self.dtype)
        spec = self.spec
        grads = {k: np.zeros_like(v) for k, v in self._params.items()}
        dL_dx = np.zeros((ctx.rows, spec.n_input_dims), self.dtype) if want_input_grad else None
        scale = self.dtype(spec.loss_scale)
        start = 0
        for xc, hs, zs, lookups in ctx.state:
            stop = start + xc.shape[0]
            d_encoded = self._backprop_chunk(dL_dy[start:stop] * scale, hs, zs, lookups, grads, want_input_grad)
            if want_input_grad:
                dL_dx[start:stop] = nm.encode_input_gradient(spec.encoding, np.asarray(xc, self.dtype), d_encoded,
                                                             lookups, self._grids) / scale
            start = stop
        for g in grads.values():
            g /= scale
        if self.dtype == np.float32 and dL_dx is not None:
            dL_dx = dL_dx.astype(np.float32)
        return dL_dx, grads

    def loss_and_grads(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        x = self.check_input(x)
        y = self.check_target(y, x.shape[0])
        loss, grads = self._loss_and_grads(x, y)
        return loss, {k: v.astype(np.float32) for k, v in grads.items()}

    def train_step(self, x: np.ndarray, y: np.ndarray, steps: int = 1) -> np.ndarray:
        x = self.check_input(x)
        y = self.check_target(y, x.shape[0])
        if steps < 1:
            raise InvalidInput(f"steps must be at least 1; got {steps}")
        losses = np.empty(steps, dtype=np.float32)
        for s in range(steps):
            losses[s], grads = self._loss_and_grads(x, y)
            self._step(grads)
        return losses

    def apply_gradients(self, grads: dict[str, np.ndarray]) -> None:
        missing = sorted(set(self._params) - set(grads))
        if missing:
            raise InvalidInput(f"gradients are missing for parameters {missing}")
        self._step({name: np.asarray(grads[name], dtype=self.dtype) for name in self._params})

    def _step(self, grads: dict[str, np.ndarray]) -> None:
        """One optimizer step on the masters with ``grads`` (unscaled), then the compute copies."""
        self.step_count += 1
        for name, w in self._params.items():
            slots = {slot: values[name] for slot, values in zip(optimizer_slots(self.spec), self._slots)}
            if name in self._grid_steps:
                nm.grid_adam_update(self.spec.optimizer, self.step_count, w, grads[name], slots, self._grid_steps[name])
            else:
                nm.optimizer_update(self.spec.optimizer, self.step_count, w, grads[name], slots)
        if self._ema_slot is not None:
            self._update_ema()
        self._refresh_compute_weights()

    def _update_ema(self) -> None:
        # tcnn averages the weights the network computes with (fp16 copies under fp16 training)
        # and, without full_precision, keeps the average in that precision too
        ema, average = self.spec.optimizer.ema, self._slots[self._ema_slot]
        for name, w in self._params.items():
            rounding = "fp32" if name.startswith("b") else self.compute  # biases are never rounded here
            nm.ema_update(ema, self.step_count, nm.round_to(rounding, w), average[name])
            if not ema.full_precision:
                average[name][...] = nm.round_to(rounding, average[name])


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


DEVICES_ENV = "MMAD_CPU_DEVICES"
MAX_VIRTUAL_DEVICES = 64


def _virtual_devices() -> int:
    """``MMAD_CPU_DEVICES``: how many devices the cpu backend presents (default 1). Each is the
    same processor; several let model placement, replicas and data-parallel training run (and be
    tested) on a machine without GPUs, as JAX's forced host device count does."""
    value = os.environ.get(DEVICES_ENV, "").strip() or "1"
    if not value.isdigit() or not 1 <= int(value) <= MAX_VIRTUAL_DEVICES:
        raise SpecError(DEVICES_ENV, f"must be a whole number from 1 to {MAX_VIRTUAL_DEVICES}; got {value!r}")
    return int(value)


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, numerics: str | None = None, devices: int | None = None):
        self.numerics = numerics or os.environ.get("MMAD_CPU_NUMERICS", "fp32")
        if self.numerics not in NUMERICS_MODES:
            raise SpecError("MMAD_CPU_NUMERICS",
                            f"unknown value {self.numerics!r}; allowed: {', '.join(NUMERICS_MODES)}")
        self.n_devices = devices if devices is not None else _virtual_devices()

    def probe(self) -> list[ProbeRow]:
        details: dict[str, Any] = {"numerics": self.numerics}
        if self.n_devices > 1:
            details["virtual_devices"] = self.n_devices
        return [ProbeRow("cpu", "numpy", True, device=f"{_cpu_name()} ({os.cpu_count()} threads)",
                         api_version=f"numpy {np.__version__}", details=details)]

    def devices(self) -> list[DeviceInfo]:
        name = f"{_cpu_name()} ({os.cpu_count()} threads)"
        if self.n_devices == 1:
            return [DeviceInfo(0, name)]
        return [DeviceInfo(i, f"{name}, virtual device {i}") for i in range(self.n_devices)]

    def compile(self, spec: MLPSpec, variant: str | None = None, cache=None, device: int = 0,
                batch_rows: int | None = None) -> CpuModel:
        if variant not in (None, "numpy"):
            raise SpecError("variant", f"the cpu backend has one variant, 'numpy'; got {variant!r}")
        check_device_index(device, self.n_devices, "cpu")
        model = CpuModel(spec, self.numerics)
        model.device_index = device
        return model
