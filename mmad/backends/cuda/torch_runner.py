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

A network's forward and backward are a dozen launches each, and from Python each launch and each
hand-off costs tens of microseconds: at 2^18 rows the host took three times the GPU's time (H200:
about 1.4 ms a step against 0.43 ms of kernels). So a batch size seen again on the same stream is
captured (:class:`CapturedShape`): its forward and backward become one CUDA graph each, over
buffers of their own, and a step is a few copies into and out of those buffers and two graph
launches. ``MMAD_CUDA_GRAPHS=0`` launches every kernel instead.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np

from mmad.backends.cache import KernelCache
from mmad.backends.cuda.grids import ELEMENTWISE_THREADS, CudaGridModel
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
        self.read_tables_from(flat)

    def read_tables_from(self, flat: Any) -> None:
        """The grid kernels read the tables from ``flat`` (tcnn's flat buffer) from now on."""
        self._external_tables = flat[self._n_weights:].view(self.cp.uint16)

    def _training_tables(self) -> Any:
        return self.table_image if self._external_tables is None else self._external_tables

    _inference_tables = _training_tables

    def round_half(self, grad: Any) -> None:
        """Enqueue rounding the fp32 device array ``grad`` to fp16 values in place (tinycudann's fp16
        parameter gradient, as torch's cast hands it to fp32 masters)."""
        if grad.size:
            self._grid_launch("grid_round_half", (math.ceil(grad.size / (4 * ELEMENTWISE_THREADS)),),
                              (ELEMENTWISE_THREADS,), (np.int64(grad.size), grad))

    def backward_tcnn(self, ctx: Any, dL_dy: Any, want_input_grad: bool) -> tuple[Any, Any]:
        """(d loss / d input or None, d loss / d params in tcnn's flat layout, fp32 holding fp16
        values: tinycudann's fp16 gradient): the layers' gradients at their padded places, d loss /
        d b0 in each of the first layer's padding columns of 1 (d loss / d each of them), then the
        tables'."""
        dx, grad_all, grad_b, _ = self._backward_buffers(ctx, dL_dy, want_input_grad, None)
        if self._bias_columns:
            width = self.layers[0][3]
            grad_all[:width * self.k_in].reshape(width, self.k_in)[:, self.spec.n_encoded_dims:] = grad_b[:width, None]
        self.round_half(grad_all)
        return dx, grad_all


class _TorchStream:
    """CuPy scopes on torch's current stream of one device (the ExternalStream objects kept per handle)."""

    def __init__(self, cp, device: Any):
        self.cp, self.device = cp, device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._streams: dict[int, Any] = {}

    @contextlib.contextmanager
    def scope(self):
        """CuPy on torch's current stream (yielded, as CuPy's stream object)."""
        handle = torch.cuda.current_stream(self.index).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = self.cp.cuda.ExternalStream(handle, self.index)
        with self.cp.cuda.Device(self.index), stream:
            yield stream


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


GRAPH_AFTER_CALLS = 2  # a batch size is captured at its second call: one seen once may not come back
KEPT_SHAPES = 4  # captured batch sizes kept per network (each holds buffers of its own)


class CapturedShape:
    """One batch size on one stream as two CUDA graphs: the forward (the parameters loaded from
    ``params``, the input read from ``x``, the output left in ``y``) and, per whether d loss / d
    input is wanted, the backward from ``dy`` (the flat gradient left in ``flat``, d loss / d input
    in ``dx``). Every buffer a graph reads or writes comes from ``pool``, which nothing else
    allocates from, or is held here (the training workspace), so no other work can be handed
    that memory while the graphs may still run; everything on the pool runs in one order (the
    stream's, the side stream that captures fenced to it by events)."""

    def __init__(self, runner: "CudaNetworkRunner", rows: int, stream: Any):
        cp, model, spec = runner.cp, runner.model, runner.spec
        self.cp, self.model, self.rows, self.stream = cp, model, rows, stream
        self.workspaces: list[dict[str, Any]] = []  # the training buffers the backward graphs use
        self.pool = cp.cuda.MemoryPool()
        self.side = cp.cuda.Stream(non_blocking=True)
        self.backwards: dict[bool, tuple[Any, Any, Any, Any]] = {}
        with self._on_side():
            # zeros, not garbage, for the warm-up runs: a grid's indices come from the input
            self.x = cp.zeros((rows, spec.n_input_dims), dtype=cp.float32)
            self.params = cp.zeros(tcnn_n_params(spec), dtype=cp.float16)
            self._forward()  # the pool holds every block the captured run will ask for
            self.side.begin_capture()
            try:
                self.y, self.ctx = self._forward()
            finally:
                self.forward = self.side.end_capture()
        self.x_t, self.params_t, self.y_t = (torch.from_dlpack(a) for a in (self.x, self.params, self.y))

    @contextlib.contextmanager
    def _on_side(self):
        """The side stream after everything queued on the stream, under the pool, and the stream
        after the side stream's work."""
        cp = self.cp
        queued = cp.cuda.Event(disable_timing=True)
        queued.record(self.stream)
        self.side.wait_event(queued)
        with cp.cuda.using_allocator(self.pool.malloc), self.side:
            yield
        done = cp.cuda.Event(disable_timing=True)
        done.record(self.side)
        self.stream.wait_event(done)

    def _forward(self) -> tuple[Any, Any]:
        self.model.load_tcnn(self.params)
        return self.model.forward_train(self.x, out_dtype="float16")

    def run_forward(self, x, params):
        """Enqueue the forward of ``x`` on ``params``; its output, a tensor of its own."""
        self.x_t.copy_(x)
        self.params_t.copy_(params)
        self.forward.launch(stream=self.stream)
        return self.y_t.clone()

    def run_backward(self, dy, want_input: bool) -> tuple[Any, Any]:
        """Enqueue the backward of the latest forward from ``dy``: (d loss / d input or None, the
        flat gradient), tensors of their own."""
        captured = self.backwards.get(want_input)
        if captured is None:
            captured = self.backwards[want_input] = self._capture_backward(want_input)
        graph, dy_t, dx_t, flat_t = captured
        dy_t.copy_(dy)
        graph.launch(stream=self.stream)
        return (dx_t.clone() if want_input else None), flat_t

    def _capture_backward(self, want_input: bool) -> tuple[Any, Any, Any, Any]:
        # the training buffers of this size, made outside the pool and held: the model keeps one
        # size at a time and would otherwise free them under the graph
        self.workspaces.append(self.model._workspace_for(self.model._rows_padded(self.rows)))
        with self._on_side():
            dy = self.cp.zeros((self.rows, self.model.spec.n_output_dims), dtype=self.cp.float16)
            self.model.read_tables_from(self.params)  # the graph's tables: the captured forward's
            self.model.backward_tcnn(self.ctx, dy, want_input)  # warm-up: the pool's blocks, the kernels built
            self.side.begin_capture()
            try:
                dx, flat = self.model.backward_tcnn(self.ctx, dy, want_input)
            finally:
                graph = self.side.end_capture()
        return graph, torch.from_dlpack(dy), (torch.from_dlpack(dx) if want_input else None), torch.from_dlpack(flat)

    def release(self) -> None:
        """Free the buffers once the stream is past every launch of the graphs (a wait)."""
        done = self.cp.cuda.Event(disable_timing=True)
        done.record(self.stream)
        done.synchronize()
        self.backwards.clear()
        self.workspaces.clear()
        del self.forward, self.x, self.params, self.y, self.ctx, self.x_t, self.params_t, self.y_t
        self.pool.free_all_blocks()


class _GraphStep:
    """A forward replayed by a CapturedShape: its backward replays the backward graph when no
    forward of the network ran since (the shape's buffers and the model's loaded weights are
    still this forward's), else runs eagerly from the kept input."""

    def __init__(self, shape: CapturedShape, forward: int, x):
        self.shape, self.forward, self.x = shape, forward, x


class CudaNetworkRunner:
    """A network on one CUDA device for mmad.torch (see the module's description)."""

    def __init__(self, spec: MLPSpec, device: Any):
        self.spec = spec
        self.cp, self.model, self.streams = _cuda_model(spec, device)
        self._loaded: tuple[Any, int] | None = None  # the params tensor loaded last (kept alive) and its version
        self._shapes: dict[tuple[int, int], CapturedShape] = {}  # (rows, stream handle) -> captured, oldest first
        self._calls: dict[tuple[int, int], int] = {}
        self._forwards = 0  # forwards run, whichever way: a graph step's backward needs it the latest

    def _load(self, params) -> None:
        if self._loaded is not None and self._loaded[0] is params and self._loaded[1] == params._version:
            return
        self.model.load_tcnn(self.cp.from_dlpack(params.detach()))
        self._loaded = (params, params._version)

    @property
    def captured_rows(self) -> list[int]:
        """The batch sizes running as CUDA graphs now."""
        return sorted({rows for rows, _ in self._shapes})

    def _captured(self, rows: int, stream: Any) -> CapturedShape | None:
        """The captured shape of ``rows`` on ``stream``, captured now at its GRAPH_AFTER_CALLS-th
        call; None while it runs eagerly (graphs off, no rows, not seen often enough)."""
        if not self.model.cuda_graphs or rows == 0:
            return None
        key = (rows, stream.ptr)
        shape = self._shapes.get(key)
        if shape is not None:
            return shape
        if len(self._calls) > 64:  # a stream of ever new sizes: forget the old counts
            self._calls.clear()
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        if calls < GRAPH_AFTER_CALLS:
            return None
        if len(self._shapes) >= KEPT_SHAPES:
            self._shapes.pop(next(iter(self._shapes))).release()
        shape = self._shapes[key] = CapturedShape(self, rows, stream)
        self._loaded = None  # the capture loaded its own (zero) parameters into the model
        return shape

    def forward(self, x, params):
        self._forwards += 1
        with self.streams.scope() as stream:
            shape = self._captured(x.shape[0], stream)
            if shape is not None:
                self._loaded = None  # the graph loads its copy of the parameters into the model
                return shape.run_forward(x, params)
            self._load(params)
            return torch.from_dlpack(self.model.forward(self.cp.from_dlpack(x.detach()), out_dtype="float16"))

    def forward_train(self, x, params):
        self._forwards += 1
        with self.streams.scope() as stream:
            shape = self._captured(x.shape[0], stream)
            if shape is not None:
                self._loaded = None
                return shape.run_forward(x, params), _GraphStep(shape, self._forwards, x)
            self._load(params)
            y, ctx = self.model.forward_train(self.cp.from_dlpack(x.detach()), out_dtype="float16")
            return torch.from_dlpack(y), ctx

    def backward(self, ctx, params, dy, want_input: bool, want_params: bool, grad_dtype: Any):
        with self.streams.scope():
            if isinstance(ctx, _GraphStep):
                shape = ctx.shape
                if ctx.forward == self._forwards and self._shapes.get((shape.rows, shape.stream.ptr)) is shape:
                    dx, flat = shape.run_backward(dy, want_input)
                    return dx, (flat.to(grad_dtype, copy=True) if want_params else None)
                # another forward ran since: the captured buffers or the loaded weights are not this one's
                self._load(params)
                ctx = self.model.forward_train(self.cp.from_dlpack(ctx.x.detach()), out_dtype="float16")[1]
            self._load(params)
            dx, flat = self.model.backward_tcnn(ctx, self.cp.from_dlpack(dy.detach()), want_input)
            dparams = torch.from_dlpack(flat).to(grad_dtype) if want_params else None
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

    def backward(self, ctx, params, dy, want_input: bool, want_params: bool, grad_dtype: Any):
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
                model.round_half(grad)
                dparams = torch.from_dlpack(grad).to(grad_dtype)
            if want_input:
                out = cp.zeros((rows, self.spec.n_input_dims), dtype=cp.float32)
                if rows:
                    model._input_gradient(din, self.width, kin, rows, out)
                dx = torch.from_dlpack(out)
            return dx, dparams


__all__ = ["CudaEncodingRunner", "CudaNetworkRunner", "CudaTorchModel"]
