"""The ``mma-f16acc+cublaslt`` and ``wgmma+cublaslt`` variants: trained by the cuBLASLt
matmuls, served by the mma-f16acc or the wgmma fused forward. See :class:`CublasLtTrainedModel`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmad.backends.cache import KernelCache
from mmad.backends.cuda.cublaslt import CublasLtModel
from mmad.backends.cuda.knobs import CudaKnobs
from mmad.backends.cuda.mma import CudaMmaModel
from mmad.backends.cuda.wgmma import CudaWgmmaModel
from mmad.spec import MLPSpec

# variant -> the variant whose forwards it serves with
SPLIT_VARIANTS = {"mma-f16acc+cublaslt": "mma-f16acc", "wgmma+cublaslt": "wgmma"}


class CublasLtTrainedModel(CublasLtModel):
    """A model whose training is the cublaslt variant's (this class is that model: its fp32
    masters, optimizer state, steps and gradients) and whose forwards are another variant's
    fused kernel (``SPLIT_VARIANTS``), on a second model that holds only a copy of the
    parameters.

    Where the fastest training and the fastest forward of a model come from different variants
    (L on the H100: cuBLASLt trains at 281 M samples/s against 189 for the fused kernels, whose
    forward runs at 1,763-1,817 against cuBLASLt's 955-1,076),
    the dispatcher measures this pair as one more candidate. Every call that changes the
    parameters marks the copy stale; the next forward first copies the masters on the device
    (``CudaMmaModel.load_device_params``: one copy and one image refresh a layer)."""

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None, knobs: CudaKnobs,
                 variant: str = "mma-f16acc+cublaslt"):
        self._engine_stale = True  # CublasLtModel's constructor sets the parameters
        self.variant = variant  # first: the constructor's refusals name it
        super().__init__(spec, cp, info, cache)
        self.forward_engine = (CudaWgmmaModel(spec, cp, info, cache, knobs, wgmma_training=False)
                               if SPLIT_VARIANTS[variant] == "wgmma"
                               else CudaMmaModel(spec, cp, info, cache, knobs, forward_acc16=True))

    def _engine(self) -> CudaMmaModel:
        """The forward model, holding the current parameters."""
        if self._engine_stale:
            self.forward_engine.load_device_params(self.w, self.b)
            self._engine_stale = False
        return self.forward_engine

    # -- forwards: the fused kernel's, on the current parameters ------------------------------
    def forward(self, x: Any, out_dtype: Any = np.float32) -> Any:
        return self._engine().forward(x, out_dtype)

    def forward_into(self, x: Any, out: Any) -> None:
        self._engine().forward_into(x, out)

    def forward_group(self, pairs: list[tuple[Any, Any]], nonfinite: Any = None) -> None:
        self._engine().forward_group(pairs, nonfinite)

    def forward_to_host(self, x: np.ndarray, out: np.ndarray, executor: Any = None,
                        check_finite: bool = False) -> None:
        self._engine().forward_to_host(x, out, executor, check_finite)

    # -- what changes the parameters ------------------------------------------------------------
    def train_step(self, x: Any, y: Any, steps: int = 1) -> np.ndarray:
        self._engine_stale = True  # first: a step that fails half way may have changed weights
        return super().train_step(x, y, steps)

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        self._engine_stale = True
        super().set_params(params)

    def device_bytes(self) -> int:
        return super().device_bytes() + self.forward_engine.device_bytes()

    def close(self) -> None:
        if hasattr(self, "forward_engine"):
            self.forward_engine.close()
        super().close()
