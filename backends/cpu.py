"""cpu backend: NumPy. Always available, and the oracle every other backend is checked against.

Three numerics modes (``CpuBackend(numerics=...)`` or ``MMAD_CPU_NUMERICS``):

* ``fp32`` (default for serving): everything in float32, no rounding to the compute type.
* ``emulate``: float32 with rounding to the spec's precision (fp16/bf16) at exactly the points
  the device kernels round (see :mod:`mmad.backends.contract`), for tight comparisons.
* ``float64``: everything in float64 — the reference the tolerances of DESIGN.md refer to.

Rows are processed in chunks so that activations stay in cache; weight gradients are summed
over chunks in the working precision.
"""

from __future__ import annotations

import os
import platform

import numpy as np

from mmad.backends import numerics as nm
from mmad.backends.contract import (
    Backend, CompiledModel, ProbeRow, check_params, init_params, optimizer_state_names,
)
from mmad.errors import InvalidInput, SpecError
from mmad.spec import MLPSpec

NUMERICS_MODES = ("fp32", "emulate", "float64")
CHUNK_ROWS = 8192
TRAIN_CHUNK_ROWS = 2048  # forward + backward of one chunk stay in cache


class CpuModel(CompiledModel):
    backend = "cpu"
    variant = "numpy"

    def __init__(self, spec: MLPSpec, numerics: str = "fp32"):
        super().__init__(spec)
        if numerics not in NUMERICS_MODES:
            raise SpecError("numerics", f"unknown cpu numerics {numerics!r}; allowed: {', '.join(NUMERICS_MODES)}")
        self.numerics = numerics
        self.dtype = np.float64 if numerics == "float64" else np.float32
        self.compute = spec.precision if numerics == "emulate" else "fp32"
        self._params = {k: v.astype(self.dtype) for k, v in init_params(spec).items()}
        self._slots = {n: np.zeros_like(self._params[n.split(".", 1)[1]]) for n in optimizer_state_names(spec)}
        self._refresh_compute_weights()

    # -- parameters -----------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.spec.layer_dims)

    def _refresh_compute_weights(self) -> None:
        # the kernels multiply by a rounded copy of the masters, transposed for row-major h @ W^T
        self._wt = [np.ascontiguousarray(nm.round_to(self.compute, self._params[f"W{i}"]).T)
                    for i in range(self.n_layers)]

    def get_params(self) -> dict[str, np.ndarray]:
        return {k: v.astype(np.float32) for k, v in self._params.items()}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        self._params = {k: v.astype(self.dtype) for k, v in check_params(self.spec, params).items()}
        self._refresh_compute_weights()

    def get_optimizer_state(self) -> dict[str, np.ndarray]:
        state = {k: v.astype(np.float32) for k, v in self._slots.items()}
        state["step"] = np.array([self.step_count], dtype=np.int64)
        return state

    def set_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        for name, slot in self._slots.items():
            if name not in state or np.shape(state[name]) != slot.shape:
                raise InvalidInput(f"optimizer state {name} is missing or has the wrong shape")
        if "step" not in state:
            raise InvalidInput("optimizer state lacks 'step'")
        self._slots = {k: np.asarray(state[k], dtype=self.dtype).copy() for k in self._slots}
        self.step_count = int(np.asarray(state["step"]).reshape(-1)[0])

    def device_bytes(self) -> int:
        return sum(a.nbytes for a in self._params.values()) + sum(a.nbytes for a in self._slots.values())

    # -- compute --------------------------------------------------------------------------
    def _forward_chunk(self, x: np.ndarray, keep: bool):
        h = nm.round_to(self.compute, nm.encode(self.spec.encoding, x.astype(self.dtype)))
        hs, zs = [h], []
        for i in range(self.n_layers):
            z = h @ self._wt[i]
            z += self._params[f"b{i}"]
            last = i == self.n_layers - 1
            act = self.spec.output_activation if last else self.spec.activation
            h = nm.activate(act, z)
            if not last:
                h = nm.round_to(self.compute, h)
            if keep:
                zs.append(z)
                hs.append(h)
        return h, hs, zs

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = self.check_input(x)
        out = np.empty((x.shape[0], self.spec.n_output_dims), dtype=np.float32)
        for start in range(0, x.shape[0], CHUNK_ROWS):
            out[start:start + CHUNK_ROWS] = self._forward_chunk(x[start:start + CHUNK_ROWS], keep=False)[0]
        return out

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
            pred, hs, zs = self._forward_chunk(x[start:stop], keep=True)
            values, dpred = nm.loss_terms(spec.loss, pred, y[start:stop].astype(self.dtype),
                                          delta=spec.huber_delta)
            loss_sum += float(values.sum(dtype=np.float64))
            delta = dpred * scale * nm.activation_grad(spec.output_activation, zs[-1])
            delta = nm.round_to(self.compute, delta)
            for i in reversed(range(self.n_layers)):
                grads[f"W{i}"] += delta.T @ hs[i]
                grads[f"b{i}"] += delta.sum(axis=0)
                if i:
                    delta = (delta @ self._wt[i].T) * nm.activation_grad(spec.activation, zs[i - 1])
                    delta = nm.round_to(self.compute, delta)
        for g in grads.values():
            g /= spec.loss_scale
        return loss_sum / y.size, grads

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
            self.step_count += 1
            for name, w in self._params.items():
                slots = {k.split(".", 1)[0]: v for k, v in self._slots.items() if k.endswith("." + name)}
                nm.optimizer_update(self.spec.optimizer, self.step_count, w, grads[name], slots)
            self._refresh_compute_weights()
        return losses


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, numerics: str | None = None):
        self.numerics = numerics or os.environ.get("MMAD_CPU_NUMERICS", "fp32")
        if self.numerics not in NUMERICS_MODES:
            raise SpecError("MMAD_CPU_NUMERICS",
                            f"unknown value {self.numerics!r}; allowed: {', '.join(NUMERICS_MODES)}")

    def probe(self) -> list[ProbeRow]:
        return [ProbeRow("cpu", "numpy", True, device=f"{_cpu_name()} ({os.cpu_count()} threads)",
                         api_version=f"numpy {np.__version__}",
                         details={"numerics": self.numerics})]

    def compile(self, spec: MLPSpec, variant: str | None = None, cache=None) -> CpuModel:
        if variant not in (None, "numpy"):
            raise SpecError("variant", f"the cpu backend has one variant, 'numpy'; got {variant!r}")
        return CpuModel(spec, self.numerics)
