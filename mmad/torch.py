"""mmad's fused kernels as PyTorch modules with tinycudann's interface (``import mmad.torch as tcnn``).

* :class:`NetworkWithInputEncoding` ``(n_input_dims, n_output_dims, encoding_config, network_config,
  seed=1337)``, :class:`Network` ``(n_input_dims, n_output_dims, network_config, seed=1337)`` and
  :class:`Encoding` ``(n_input_dims, encoding_config, seed=1337, dtype=None)``: tiny-cuda-nn's JSON
  configs, one flat ``params`` Parameter (fp32) in tiny-cuda-nn's layout, so a tinycudann
  checkpoint's ``params`` loads as it is (:func:`mmad.export.from_tcnn` / ``to_tcnn`` read and
  write the same layout), and tiny-cuda-nn's initial parameters for the seed
  (:func:`mmad.export.tcnn_initial_params`).
* As tinycudann's modules: the forward casts ``params`` to the modules' precision (``dtype``:
  fp16 unless ``dtype=torch.float32``), so the user's optimizer keeps fp32 master weights; the
  output is in that precision; the backward multiplies d loss / d output by ``loss_scale`` (128
  for fp16, 1 for fp32) before rounding and divides the gradients by it; d loss / d input
  (fp32) is computed when the input requires it.
* On CUDA tensors the module runs mmad's cuda kernels on torch's current stream, its tensors
  handed over through DLPack without a copy or a wait; on CPU tensors mmad's cpu backend (fp16
  modules round where the kernels round, fp32 ones compute in fp32). ``module.double()`` on CPU
  computes in float64 (the oracle: ``torch.autograd.gradcheck`` applies).

torch is the optional extra ``mmad[torch]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmad.export import (
    check_tcnn_size, params_from_tcnn_flat, require_optional, tcnn_flat_from_params, tcnn_initial_params,
    tcnn_n_params,
)
from mmad.backends import numerics as nm
from mmad.errors import InvalidInput
from mmad.spec import EncodingSpec, MLPSpec

torch = require_optional("torch", extra="torch")

LOSS_SCALES = {torch.float16: 128.0, torch.float32: 1.0}  # tcnn's default_loss_scale per precision
PRECISIONS = {torch.float16: "fp16", torch.float32: "fp32"}


def _precision_dtype(dtype: Any) -> Any:
    if dtype is None:
        return torch.float16
    if dtype not in PRECISIONS:
        raise ValueError(f"mmad.torch modules compute in torch.float16 or torch.float32; got {dtype}")
    return dtype


class _Function(torch.autograd.Function):
    """Forward through a runner; backward from torch's d loss / d output through the same runner,
    on the parameters the forward ran on (tinycudann's _module_function). ``params`` are the
    module's own (the masters); the runner computes on their copy in ``dtype`` (tinycudann's
    forward casts them before its function), kept for the backward, and the gradient comes back
    rounded to ``dtype`` in the masters' dtype, as torch's cast would hand it on (on CUDA the
    captured backward rounds it in place and one copy hands it over, where the cast's backward
    took two passes over it: to ``dtype``, then back)."""

    @staticmethod
    def forward(ctx, runner, train: bool, x, params, dtype):
        ctx.set_materialize_grads(False)
        ctx.runner = runner
        cast = params.to(dtype)
        if not train:
            ctx.native = None
            return runner.forward(x, cast)
        y, ctx.native = runner.forward_train(x, cast)
        ctx.save_for_backward(cast)
        ctx.grad_dtype = params.dtype
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        if dy is None or ctx.native is None:
            return None, None, None, None, None
        (params,) = ctx.saved_tensors
        dx, dparams = ctx.runner.backward(ctx.native, params, dy.contiguous(), ctx.needs_input_grad[2],
                                          ctx.needs_input_grad[3], ctx.grad_dtype)
        return None, None, dx, dparams, None


class Module(torch.nn.Module):
    """What the three modules share (tinycudann's ``Module``): the flat ``params``, the
    precision, the loss scale, and a runner per device the inputs come from."""

    def __init__(self, seed: int = 1337, dtype: Any = None):
        super().__init__()
        self.seed = seed
        self.dtype = _precision_dtype(dtype)
        self.loss_scale = LOSS_SCALES[self.dtype]
        self.params = torch.nn.Parameter(torch.from_numpy(self._initial_params(seed)), requires_grad=True)
        self._runners: dict[tuple[str, bool], Any] = {}

    def forward(self, x):
        float64 = self.params.dtype == torch.float64
        if x.device != self.params.device:
            raise ValueError(f"the input is on {x.device} but the module's params are on {self.params.device}: "
                             "move the module with .to(device)")
        if x.ndim != 2 or x.shape[1] != self.n_input_dims:
            raise ValueError(f"the input must have shape [batch, {self.n_input_dims}]; got {list(x.shape)}")
        if float64 and x.is_cuda:
            raise ValueError("float64 (module.double()) runs on the cpu backend only: the oracle of the kernels")
        x = x.to(torch.float64 if float64 else torch.float32).contiguous()
        train = torch.is_grad_enabled() and (x.requires_grad or self.params.requires_grad)
        return _Function.apply(self._runner(x.device, float64), train, x, self.params.contiguous(),
                               torch.float64 if float64 else self.dtype)

    def _runner(self, device: Any, float64: bool):
        key = (str(device), float64)
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = self._make_runner(device, float64)
        return runner

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_runners"] = {}  # compiled models are not pickled (tinycudann drops its native module too)
        return state

    def extra_repr(self) -> str:
        return (f"n_input_dims={self.n_input_dims}, n_output_dims={self.n_output_dims}, seed={self.seed}, "
                f"dtype={self.dtype}")


class NetworkWithInputEncoding(Module):
    """An input encoding followed by a fully fused MLP (tinycudann's module of this name): float
    inputs of shape [batch, n_input_dims] to outputs of shape [batch, n_output_dims] in ``dtype``."""

    def __init__(self, n_input_dims: int, n_output_dims: int, encoding_config: dict, network_config: dict,
                 seed: int = 1337, dtype: Any = None):
        self.n_input_dims = n_input_dims
        self.n_output_dims = n_output_dims
        self.encoding_config = encoding_config
        self.network_config = network_config
        dtype = _precision_dtype(dtype)
        self.spec = MLPSpec.from_json({
            "n_input_dims": n_input_dims, "n_output_dims": n_output_dims, "encoding": encoding_config,
            "network": network_config, "precision": PRECISIONS[dtype], "loss_scale": LOSS_SCALES[dtype],
            "seed": seed})
        super().__init__(seed, dtype)

    def _initial_params(self, seed: int) -> np.ndarray:
        return tcnn_initial_params(self.spec, seed)

    def _make_runner(self, device: Any, float64: bool):
        if device.type == "cuda":
            from mmad.backends.cuda.torch_runner import CudaNetworkRunner

            return CudaNetworkRunner(self.spec, device)
        return CpuNetworkRunner(self.spec, self.dtype, float64)


class Network(NetworkWithInputEncoding):
    """A fully fused MLP on the raw inputs (tinycudann's ``Network``: an Identity encoding)."""

    def __init__(self, n_input_dims: int, n_output_dims: int, network_config: dict, seed: int = 1337,
                 dtype: Any = None):
        super().__init__(n_input_dims, n_output_dims, {"otype": "Identity"}, network_config, seed, dtype)


class Encoding(Module):
    """An input encoding alone (tinycudann's ``Encoding``): float inputs of shape [batch,
    n_input_dims] to [batch, n_output_dims] in ``dtype``; a grid's tables are its ``params``."""

    def __init__(self, n_input_dims: int, encoding_config: dict, seed: int = 1337, dtype: Any = None):
        self.n_input_dims = n_input_dims
        self.encoding_config = encoding_config
        self.encoding = EncodingSpec.parse("encoding_config", encoding_config, n_input_dims)
        # the MLP is never run: its spec holds the encoding's tables, names and layout
        self.spec = MLPSpec.from_json({"n_input_dims": n_input_dims, "n_output_dims": 1,
                                       "encoding": encoding_config})
        self.n_output_dims = self.encoding.n_output_dims(n_input_dims)
        super().__init__(seed, dtype)

    def _initial_params(self, seed: int) -> np.ndarray:
        # tcnn draws a NetworkWithInputEncoding's network first; an Encoding's tables are the first draws
        return tcnn_initial_params(self.spec, seed, network=False)

    def _make_runner(self, device: Any, float64: bool):
        if device.type == "cuda":
            from mmad.backends.cuda.torch_runner import CudaEncodingRunner

            return CudaEncodingRunner(self.spec, self.dtype, device)
        return CpuEncodingRunner(self.spec, self.dtype, float64)


# -- the cpu runners ----------------------------------------------------------------------------------
def _numpy(t) -> np.ndarray:
    return t.detach().cpu().numpy()


class CpuNetworkRunner:
    """A network on mmad's cpu backend: fp16 modules in ``emulate`` numerics (fp16 where the
    kernels round), fp32 ones in ``fp32``, ``.double()`` ones in ``float64``. The parameters are
    loaded when they differ from the ones the model holds (the flat buffer compared as it is)."""

    def __init__(self, spec: MLPSpec, dtype: Any, float64: bool):
        from mmad.backends.cpu import CpuBackend

        self.spec = spec
        self.float64 = float64
        mode = "float64" if float64 else "emulate" if dtype == torch.float16 else "fp32"
        self.model = CpuBackend(mode).compile(spec)
        self.out_dtype = np.float64 if float64 else np.float16 if dtype == torch.float16 else np.float32
        self._loaded: np.ndarray | None = None

    def _load(self, params) -> None:
        """Hold ``params`` (the flat buffer), loaded only where they differ from the ones held."""
        flat = _numpy(params)
        if self._loaded is not None and np.array_equal(flat, self._loaded):
            return
        check_tcnn_size(self.spec, flat.size)
        self.model.set_params(params_from_tcnn_flat(self.spec, flat.astype(np.float64), np.zeros))
        self._loaded = flat.copy()

    def forward(self, x, params):
        self._load(params)
        if self.float64:
            return torch.from_numpy(self.model.forward_train(_numpy(x), out_dtype=np.float64)[0])
        return torch.from_numpy(self.model.forward(_numpy(x), out_dtype=self.out_dtype))

    def forward_train(self, x, params):
        self._load(params)
        xs = _numpy(x)
        y, ctx = self.model.forward_train(xs, out_dtype=self.out_dtype)
        return torch.from_numpy(y), (xs, ctx)

    def backward(self, native, params, dy, want_input: bool, want_params: bool, grad_dtype: Any):
        xs, ctx = native
        self._load(params)
        if ctx.version != (self.model.step_count, self.model.params_version):
            # other parameters were loaded since (another forward): this forward again on its own
            ctx = self.model.forward_train(xs, out_dtype=self.out_dtype)[1]
        dx, grads = self.model.backward(ctx, _numpy(dy).astype(self.model.dtype), want_input_grad=want_input)
        dparams = None
        if want_params:
            flat = np.zeros(tcnn_n_params(self.spec), np.float64 if self.float64 else np.float32)
            dparams = torch.from_numpy(tcnn_flat_from_params(self.spec, grads, flat, spread_bias=True))
            dparams = dparams.to(params.dtype).to(grad_dtype)
        return (torch.from_numpy(dx) if want_input else None), dparams


class CpuEncodingRunner:
    """An encoding alone on the host (mmad.backends.numerics): in fp16 the tables and the output
    rounded to fp16 and d loss / d output scaled by the loss scale and rounded, as tcnn's
    Encoding<__half>; the tables' and the inputs' gradients from numerics' backward."""

    def __init__(self, spec: MLPSpec, dtype: Any, float64: bool):
        self.spec = spec
        self.encoding = spec.encoding
        self.work = np.float64 if float64 else np.float32
        self.compute = "fp16" if dtype == torch.float16 and not float64 else "fp32"
        self.out_dtype = np.float64 if float64 else np.float16 if dtype == torch.float16 else np.float32
        self.loss_scale = 1.0 if float64 else LOSS_SCALES[dtype]
        self.names = list(spec.grid_shapes)

    def _tables(self, params) -> list[np.ndarray]:
        flat = _numpy(params).astype(self.work)
        if flat.size != sum(r * f for r, f in self.spec.grid_shapes.values()):
            raise InvalidInput(f"the encoding's params hold {flat.size} values; its tables need "
                               f"{sum(r * f for r, f in self.spec.grid_shapes.values())}")
        tables, at = [], 0
        for rows, features in self.spec.grid_shapes.values():
            tables.append(nm.round_to(self.compute, flat[at:at + rows * features].reshape(rows, features)))
            at += rows * features
        return tables

    def _encode(self, x, params):
        tables = self._tables(params)
        xs = _numpy(x).astype(self.work)
        encoded, lookups = nm.encode_with_lookups(self.encoding, xs, tables)
        return torch.from_numpy(np.ascontiguousarray(encoded.astype(self.out_dtype))), (xs, lookups, tables)

    def forward(self, x, params):
        return self._encode(x, params)[0]

    def forward_train(self, x, params):
        return self._encode(x, params)

    def backward(self, ctx, params, dy, want_input: bool, want_params: bool, grad_dtype: Any):
        xs, lookups, tables = ctx
        scale = self.work(self.loss_scale)
        d = nm.round_to(self.compute, _numpy(dy).astype(self.work) * scale)
        dx = dparams = None
        if want_input:
            dx = torch.from_numpy(nm.encode_input_gradient(self.encoding, xs, d, lookups, tables) / scale).float()
            if self.work == np.float64:
                dx = dx.double()
        if want_params and self.names:
            grads = nm.grid_gradients(self.encoding, self.spec.n_input_dims, lookups, d, tables)
            dparams = torch.from_numpy(np.concatenate([g.reshape(-1) for g in grads]) / scale)
            dparams = dparams.to(params.dtype).to(grad_dtype)
        return dx, dparams


__all__ = ["Encoding", "Module", "Network", "NetworkWithInputEncoding"]
