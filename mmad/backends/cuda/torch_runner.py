"""mmad.torch's modules on CUDA tensors: mmad's mma kernels on torch's current stream.

Every tensor crosses between torch and CuPy through DLPack without a copy, inside a scope where
CuPy's current stream is torch's current stream (so neither side waits for the other and the
launches stay ordered with torch's own); nothing here waits for the device.

:class:`CudaTorchModel` is a device-encoded model (:class:`~mmad.backends.cuda.grids.CudaGridModel`:
every encoding on the device, d loss / d input available) whose parameters come from tinycudann's
flat fp16 buffer on the device: the weights copied into the fp32 masters (their padded layout is
tcnn's) and packed into the kernels' fp16 images, the first layer's bias summed from its padding
columns of 1, and the grid kernels reading the tables straight from the buffer (no copy). Its
gradient comes back in the same flat layout.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np

from mmad.backends.cache import KernelCache
from mmad.backends.cuda.grids import CudaGridModel
from mmad.backends.cuda.toolchain import cupy_module, device_info
from mmad.errors import BackendUnavailable, InvalidInput, LaunchError
from mmad.export import tcnn_bias_columns, tcnn_n_params
from mmad.spec import MLPSpec

import torch

LOAD_THREADS = 256


class CudaTorchModel(CudaGridModel):
    """A device-encoded mma model whose parameters are tinycudann's flat fp16 buffer on the device
    (:meth:`load_tcnn`); the fp16-out forwards accumulate in fp16 (tcnn's fully fused MLP)."""

    def __init__(self, spec: MLPSpec, cp, info: dict[str, Any], cache: KernelCache | None):
        super().__init__(spec, cp, info, cache, forward_acc16=True)
        self._n_weights = self.w_all.size
        if self._n_weights + self.grid_plan.values != tcnn_n_params(spec):
            raise LaunchError("the mma model's padded weights are not tiny-cuda-nn's layout")  # a bug, not input
        self._bias_columns = tcnn_bias_columns(spec)
        self._external_tables: Any = None

    def load_tcnn(self, flat: Any) -> None:
        """Enqueue taking the parameters from ``flat`` (tcnn's flat buffer, fp16, on this device;
        kept referenced: the grid kernels read its tables until the next load): one launch of
        ``mlp_load_tcnn`` (the masters, the images, b0 from the padding columns). The parameters'
        version is left as it is: the caller loads the parameters a forward ran on before its
        backward (mmad.torch saves them with the forward, as tinycudann does)."""
        n_w = self._n_weights
        weights = flat[:n_w].view(self.cp.uint16)
        self._launch("mlp_load_tcnn", (math.ceil(n_w / LOAD_THREADS),), (LOAD_THREADS,),
                     (weights, self.w_all, self.b_all, self.wimage, np.int32(self._bias_columns)))
        self._external_tables = flat[n_w:].view(self.cp.uint16)

    def _training_tables(self) -> Any:
        return self.table_image if self._external_tables is None else self._external_tables

    _inference_tables = _training_tables

    def backward_tcnn(self, ctx: Any, dL_dy: Any, want_input_grad: bool) -> tuple[Any, Any]:
        """(d loss / d input or None, d loss / d params in tcnn's flat layout, fp32): the layers'
        gradients at their padded places, d loss / d b0 in each of the first layer's padding
        columns of 1 (d loss / d each of them), then the tables'."""
        dx, grad_all, grad_b, _ = self._backward_buffers(ctx, dL_dy, want_input_grad, None)
        if self._bias_columns:
            width = self.layers[0][3]
            grad_all[:width * self.k_in].reshape(width, self.k_in)[:, self.spec.n_encoded_dims:] = grad_b[:width, None]
        return dx, grad_all


class _TorchStream:
    """CuPy scopes on torch's current stream of one device (the ExternalStream objects kept per handle)."""

    def __init__(self, cp, device: Any):
        self.cp, self.device = cp, device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._streams: dict[int, Any] = {}

    @contextlib.contextmanager
    def scope(self):
        handle = torch.cuda.current_stream(self.index).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = self.cp.cuda.ExternalStream(handle, self.index)
        with self.cp.cuda.Device(self.index), stream:
            yield


def _cuda_model(spec: MLPSpec, device: Any) -> tuple[Any, CudaTorchModel, _TorchStream]:
    from mmad.backends.cuda import CudaBackend

    rows = {r.variant: r for r in CudaBackend().probe()}
    if not rows["mma"].available:
        raise BackendUnavailable("cuda:mma", rows["mma"].reason)
    if spec.precision != "fp16":
        raise InvalidInput("on CUDA tensors mmad.torch computes in fp16 (the mma kernels); a torch.float32 module "
                           "runs on CPU tensors (mmad's cpu backend)")
    cp = cupy_module()
    streams = _TorchStream(cp, device)
    with cp.cuda.Device(streams.index):
        model = CudaTorchModel(spec, cp, device_info(cp), KernelCache())
    return cp, model, streams


class CudaNetworkRunner:
    """A network on one CUDA device for mmad.torch (see the module's description)."""

    def __init__(self, spec: MLPSpec, device: Any):
        self.spec = spec
        self.cp, self.model, self.streams = _cuda_model(spec, device)
        self._loaded: tuple[Any, int] | None = None  # the params tensor loaded last (kept alive) and its version

    def _load(self, params) -> None:
        if self._loaded is not None and self._loaded[0] is params and self._loaded[1] == params._version:
            return
        self.model.load_tcnn(self.cp.from_dlpack(params.detach()))
        self._loaded = (params, params._version)

    def forward(self, x, params):
        with self.streams.scope():
            self._load(params)
            return torch.from_dlpack(self.model.forward(self.cp.from_dlpack(x.detach()), out_dtype="float16"))

    def forward_train(self, x, params):
        with self.streams.scope():
            self._load(params)
            y, ctx = self.model.forward_train(self.cp.from_dlpack(x.detach()), out_dtype="float16")
            return torch.from_dlpack(y), ctx

    def backward(self, ctx, params, dy, want_input: bool, want_params: bool):
        with self.streams.scope():
            self._load(params)
            dx, flat = self.model.backward_tcnn(ctx, self.cp.from_dlpack(dy.detach()), want_input)
            dparams = torch.from_dlpack(flat).to(params.dtype) if want_params else None
            return (torch.from_dlpack(dx) if want_input else None), dparams


class CudaEncodingRunner:
    """An encoding alone on one CUDA device (tinycudann's Encoding in fp16): the device encoding
    kernels of a device-encoded model (its MLP unused), the output row-major fp16; the backward
    scales d loss / d output by the loss scale and rounds it to fp16, as tcnn's does."""

    def __init__(self, spec: MLPSpec, dtype: Any, device: Any):
        if dtype != torch.float16:
            raise InvalidInput("on CUDA tensors mmad.torch's Encoding computes in fp16; a torch.float32 Encoding runs "
                               "on CPU tensors (mmad's cpu backend)")
        self.spec = spec
        self.cp, self.model, self.streams = _cuda_model(spec, device)
        self.width = spec.n_encoded_dims
        self._loaded: tuple[Any, int] | None = None

    def _load(self, params) -> None:
        if self._loaded is not None and self._loaded[0] is params and self._loaded[1] == params._version:
            return
        flat = self.cp.from_dlpack(params.detach())
        self.model._external_tables = flat.view(self.cp.uint16)
        self._loaded = (params, params._version)

    def _encode(self, x, params):
        cp = self.cp
        self._load(params)
        kin, _ = self.model._kernel_input(cp.from_dlpack(x.detach()))
        rows = kin.shape[0]
        encoded = self.model._new_encoded(rows)
        self.model._encode(kin, rows, encoded, table=self.model._training_tables())
        # pair-major (pairs × rows × 2) to row-major rows × width
        out = cp.ascontiguousarray(encoded.transpose(1, 0, 2).reshape(rows, -1)[:, :self.width])
        return torch.from_dlpack(out), (kin, rows)

    def forward(self, x, params):
        with self.streams.scope():
            return self._encode(x, params)[0]

    def forward_train(self, x, params):
        with self.streams.scope():
            return self._encode(x, params)

    def backward(self, ctx, params, dy, want_input: bool, want_params: bool):
        cp, model = self.cp, self.model
        kin, rows = ctx
        with self.streams.scope():
            self._load(params)
            din = cp.from_dlpack((dy.float() * model.spec.loss_scale).half().contiguous())
            dx = dparams = None
            if want_params and model.grid_plan.values:
                grad = cp.zeros(model.grid_plan.values, dtype=cp.float32)
                if rows:
                    model._grid_gradients(din, self.width, kin, rows, into=grad)
                dparams = torch.from_dlpack(grad).to(params.dtype)
            if want_input:
                out = cp.zeros((rows, self.spec.n_input_dims), dtype=cp.float32)
                if rows:
                    model._input_gradient(din, self.width, kin, rows, out)
                dx = torch.from_dlpack(out)
            return dx, dparams


__all__ = ["CudaEncodingRunner", "CudaNetworkRunner", "CudaTorchModel"]
