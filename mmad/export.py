"""Models in and out of mmad: PyTorch, ONNX, tiny-cuda-nn parameters, ``nn.Sequential`` state dicts.

* :func:`to_torch` — a ``torch.nn.Module`` computing what mmad's fp32 forward computes
  (the spec's encoding, then ``Linear`` + activation layers), trainable further in PyTorch.
* :func:`to_onnx` — the same function as an ONNX graph, built with the ``onnx`` package alone
  (no PyTorch needed), opset 17, a dynamic batch dimension.
* :func:`from_tcnn` — tiny-cuda-nn's flat parameter buffer (fp16 or fp32) of a
  ``NetworkWithInputEncoding`` with this spec's config, as mmad's ``W{i}``/``b{i}``.
* :func:`from_state_dict` — the ``state_dict`` of a plain ``nn.Sequential`` of ``Linear``
  layers (and activations), as mmad's parameters.
* :func:`inference_params` — the weights a model infers with (the EMA average under an EMA
  optimizer), from a version's parameters and optimizer state.

torch and onnx are optional (``pip install mmad[export]``); they are imported when needed.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from mmad.backends.contract import check_params, init_params, param_shapes
from mmad.backends.numerics import LEAKY_SLOPE
from mmad.errors import InvalidInput
from mmad.spec import EncodingSpec, MLPSpec

ONNX_OPSET = 17
TCNN_ALIGNMENT = 16  # FullyFusedMLP's and CutlassMLP's REQUIRED_ALIGNMENT(): input and output widths pad to it


def require_optional(module: str):
    try:
        return __import__(module)
    except ImportError as exc:
        raise ImportError(f"{module} is not installed: `pip install mmad[export]` installs torch, onnx and "
                          f"onnxruntime ({exc})") from exc


def inference_params(spec: MLPSpec, params: Mapping[str, Any],
                     optimizer_state: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """The parameters inference uses: under an EMA optimizer the ``ema.*`` arrays of the
    optimizer state (as tiny-cuda-nn infers with the average), else ``params``."""
    if spec.optimizer.ema is None:
        return check_params(spec, dict(params))
    names = [f"ema.{name}" for name in param_shapes(spec)]
    if optimizer_state is None or any(n not in optimizer_state for n in names):
        raise InvalidInput("this model's optimizer is an EMA: it infers with the averaged weights kept in its "
                           "optimizer state (ema.W0, ema.b0, ...); pass the version's optimizer state too")
    return check_params(spec, {name: optimizer_state[f"ema.{name}"] for name in param_shapes(spec)})


# -- tiny-cuda-nn parameters -------------------------------------------------------------------
def tcnn_layer_shapes(spec: MLPSpec) -> list[tuple[int, int]]:
    """(rows, columns) of each weight matrix in tcnn's buffer, in order: the encoding's output
    padded to 16 columns (the padding columns hold 1), the output layer padded to 16 rows."""
    pad = lambda n: -(-n // TCNN_ALIGNMENT) * TCNN_ALIGNMENT  # noqa: E731
    width = spec.n_neurons
    return ([(width, pad(spec.n_encoded_dims))] + [(width, width)] * (spec.n_hidden_layers - 1)
            + [(pad(spec.n_output_dims), width)])


def tcnn_n_params(spec: MLPSpec) -> int:
    """tiny-cuda-nn's ``n_params()`` for this config (its encodings here hold no parameters)."""
    return sum(r * c for r, c in tcnn_layer_shapes(spec))


def from_tcnn(spec: MLPSpec, buffer: Any, dtype: Any = None) -> dict[str, np.ndarray]:
    """mmad's parameters from tiny-cuda-nn's flat parameter buffer for ``spec``'s config.

    tcnn (FullyFusedMLP and CutlassMLP alike) stores each layer's weights as one row-major
    (fan_out × fan_in) matrix, layers back to back, with no biases. Its input is the encoding's
    output padded with columns of 1 up to a multiple of 16, so the first layer's padding columns
    sum to a bias (``b0``); the output layer has rows up to a multiple of 16, of which the first
    ``n_output_dims`` are used. ``buffer``: an array (fp16/fp32, any shape) or raw bytes of
    ``dtype`` (``"fp16"`` or ``"fp32"``).
    """
    check_exportable(spec)
    if isinstance(buffer, (bytes, bytearray, memoryview)):
        if dtype not in ("fp16", "fp32"):
            raise InvalidInput(f"raw tcnn parameters need their dtype, fp16 or fp32; got {dtype!r}")
        item = 2 if dtype == "fp16" else 4
        if len(buffer) % item:
            raise InvalidInput(f"{len(buffer)} bytes are not a whole number of {dtype} values")
        buffer = np.frombuffer(buffer, dtype=np.float16 if dtype == "fp16" else np.float32)
    flat = np.asarray(buffer).reshape(-1)
    if flat.dtype not in (np.float16, np.float32, np.float64):
        raise InvalidInput(f"tcnn parameters must be floating point; got {flat.dtype}")
    shapes = tcnn_layer_shapes(spec)
    expected = tcnn_n_params(spec)
    if flat.size != expected:
        layout = " + ".join(f"{r}x{c}" for r, c in shapes)
        raise InvalidInput(f"tiny-cuda-nn's buffer for this config holds {expected} parameters ({layout}, "
                           f"widths padded to {TCNN_ALIGNMENT}); got {flat.size}")
    params: dict[str, np.ndarray] = {}
    at = 0
    for i, ((rows, cols), (fan_in, fan_out)) in enumerate(zip(shapes, spec.layer_dims)):
        w = flat[at:at + rows * cols].astype(np.float64).reshape(rows, cols)
        at += rows * cols
        params[f"W{i}"] = w[:fan_out, :fan_in]
        # only the first layer sees the padding columns of 1: their weights act as its bias
        # (summed in float64, rounded once to fp32 by check_params)
        params[f"b{i}"] = w[:fan_out, fan_in:].sum(axis=1) if i == 0 else np.zeros(fan_out)
    return check_params(spec, params)


# -- PyTorch state dicts -------------------------------------------------------------------------
def from_state_dict(spec: MLPSpec, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """mmad's parameters from a plain ``nn.Sequential`` of ``Linear`` layers (activations between
    them hold no parameters): each ``<prefix>.weight`` (fan_out × fan_in, as mmad's ``W{i}``) in
    the state dict's order, with its ``<prefix>.bias`` (zeros for ``bias=False``)."""
    check_exportable(spec)
    arrays = {k: _to_numpy(v) for k, v in state_dict.items()}
    weights = [k for k, v in arrays.items() if k.rsplit(".", 1)[-1] == "weight"]
    known = set(weights) | {w[: -len("weight")] + "bias" for w in weights}
    unknown = [k for k in arrays if k not in known]
    if unknown:
        raise InvalidInput(f"not the state dict of a plain nn.Sequential of Linear layers: unexpected entries {unknown[:5]}")
    if len(weights) != len(spec.layer_dims):
        raise InvalidInput(f"the model has {len(spec.layer_dims)} Linear layers; the state dict holds "
                           f"{len(weights)} weights ({weights[:6]})")
    params = {}
    for i, (key, (fan_in, fan_out)) in enumerate(zip(weights, spec.layer_dims)):
        w = arrays[key]
        if w.shape != (fan_out, fan_in):
            raise InvalidInput(f"{key} must be Linear({fan_in}, {fan_out})'s weight of shape [{fan_out}, {fan_in}] "
                               f"for layer {i}; got {list(w.shape)}")
        params[f"W{i}"] = w
        params[f"b{i}"] = arrays.get(key[: -len("weight")] + "bias", np.zeros(fan_out, np.float32))
    return check_params(spec, params)


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, on any device, in any float dtype
        value = value.detach().cpu().float().numpy()
    return np.asarray(value, dtype=np.float32)


def check_exportable(spec: MLPSpec) -> None:
    """Export and import cover the encodings without parameters of their own; a model with a
    grid (or another encoding export does not know yet) is refused, naming it."""
    known = ("Identity", "Frequency", "OneBlob")
    found = [part.otype for part, _, _ in spec.encoding.parts(spec.n_input_dims) if part.otype not in known]
    if found:
        raise InvalidInput(f"export and import of models with a {found[0]} encoding are not built yet; they cover "
                           f"{', '.join(known)} (and Composite of them)")


# -- PyTorch ----------------------------------------------------------------------------------------
def to_torch(spec: MLPSpec, params: Mapping[str, Any] | None = None):
    """A ``torch.nn.Module`` (float32; ``.double()`` works) computing mmad's forward for ``spec``
    with ``params`` (mmad's initial parameters when None). Its ``net`` is an ``nn.Sequential``
    of ``Linear`` and activation modules, so its ``state_dict`` reads back with
    :func:`from_state_dict`; the encoding has no parameters and is differentiable."""
    check_exportable(spec)
    torch = require_optional("torch")
    params = check_params(spec, dict(params)) if params is not None else init_params(spec)
    layers: list[Any] = []
    for i, (fan_in, fan_out) in enumerate(spec.layer_dims):
        linear = torch.nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(params[f"W{i}"]))
            linear.bias.copy_(torch.from_numpy(params[f"b{i}"]))
        last = i == len(spec.layer_dims) - 1
        layers += [linear, _torch_activation(torch, spec.output_activation if last else spec.activation)]
    return _torch_model_class(torch)(spec, torch.nn.Sequential(*layers))


def _torch_model_class(torch):
    class MMADModel(torch.nn.Module):
        """mmad's model in PyTorch: ``encoding(x)`` then ``net``."""

        def __init__(self, spec: MLPSpec, net):
            super().__init__()
            self.spec = spec
            self.net = net

        def forward(self, x):
            return self.net(_torch_encode(torch, self.spec.encoding, x))

    return MMADModel


def _torch_activation(torch, name: str):
    nn = torch.nn
    builtin = {"None": nn.Identity, "ReLU": nn.ReLU, "Sigmoid": nn.Sigmoid, "Tanh": nn.Tanh, "SiLU": nn.SiLU}
    if name in builtin:
        return builtin[name]()
    if name == "LeakyReLU":
        return nn.LeakyReLU(LEAKY_SLOPE)
    formulas = {  # numerics.activate's definitions
        "Softplus": lambda z: torch.logaddexp(z, torch.zeros_like(z)),
        "Squareplus": lambda z: 0.5 * (z + torch.sqrt(z * z + 4)),
        "Exponential": torch.exp,
        "Sine": torch.sin,
    }

    class Activation(nn.Module):
        def forward(self, z):
            return formulas[name](z)

        def extra_repr(self) -> str:
            return name

    return Activation()


def _torch_encode(torch, enc: EncodingSpec, x):
    """numerics.encode in torch (same operations, in x's dtype)."""
    if enc.otype == "Identity":
        return x if enc.passthrough else x * enc.scale + enc.offset
    if enc.otype == "Frequency":
        freqs = (2.0 ** torch.arange(enc.n_frequencies, dtype=torch.float64) * math.pi).to(x.dtype)
        arg = x[:, :, None] * freqs
        return torch.stack([torch.sin(arg), torch.cos(arg)], dim=-1).reshape(x.shape[0], -1)
    if enc.otype == "OneBlob":
        n = enc.n_bins
        u = (torch.arange(n, dtype=x.dtype) / n)[None, None, :] - x[:, :, None]

        def cdf(v):
            v = v * n
            v2 = v * v
            return torch.clamp(15 / 16 * v * (1 - 2 / 3 * v2 + 1 / 5 * v2 * v2) + 0.5, 0, 1)

        c = cdf(u) + cdf(u - 1) + cdf(u + 1)
        right = torch.cat([c[..., 1:], c[..., :1] + 1], dim=-1)
        return (right - c).reshape(x.shape[0], -1)
    return torch.cat([_torch_encode(torch, part, x[:, begin:begin + dims])
                      for part, begin, dims in enc.parts(x.shape[1])], dim=1)


# -- ONNX ---------------------------------------------------------------------------------------------
def to_onnx(spec: MLPSpec, params: Mapping[str, Any]) -> bytes:
    """The model as a serialized ONNX graph (opset 17): input ``INPUT`` (batch × n_input_dims,
    float32), output ``OUTPUT`` (the names of mmad's own API); the encoding in ONNX operators, each layer a ``Gemm``."""
    check_exportable(spec)
    onnx = require_optional("onnx")
    from onnx import TensorProto, helper, numpy_helper

    params = check_params(spec, dict(params))
    graph = _OnnxGraph(helper, numpy_helper)
    h = _onnx_encode(graph, spec.encoding, "INPUT", spec.n_input_dims)
    for i in range(len(spec.layer_dims)):
        z = graph.op("Gemm", h, graph.const(params[f"W{i}"]), graph.const(params[f"b{i}"]), transB=1)
        last = i == len(spec.layer_dims) - 1
        h = _onnx_activation(graph, spec.output_activation if last else spec.activation, z)
    graph.nodes.append(helper.make_node("Identity", [h], ["OUTPUT"]))
    model = helper.make_model(
        helper.make_graph(graph.nodes, "mmad", [helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", spec.n_input_dims])],
                          [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["batch", spec.n_output_dims])],
                          graph.initializers),
        opset_imports=[helper.make_opsetid("", ONNX_OPSET)], producer_name="mmad")
    model.doc_string = f"mmad model; tiny-cuda-nn config: {spec.to_json()}"
    onnx.checker.check_model(model)
    return model.SerializeToString()


class _OnnxGraph:
    """Nodes and float32 constants of a graph under construction, each value a fresh name."""

    def __init__(self, helper, numpy_helper):
        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self._n = 0

    def _name(self, what: str) -> str:
        self._n += 1
        return f"{what}{self._n}"

    def const(self, value: Any, dtype: Any = np.float32) -> str:
        name = self._name("c")
        self.initializers.append(self.numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        out = self._name(op_type.lower())
        self.nodes.append(self.helper.make_node(op_type, list(inputs), [out], **attrs))
        return out


def _onnx_activation(g: _OnnxGraph, name: str, z: str) -> str:
    if name == "None":
        return z
    if name in ("ReLU", "Sigmoid", "Tanh", "Exponential", "Sine"):
        return g.op({"ReLU": "Relu", "Exponential": "Exp", "Sine": "Sin"}.get(name, name), z)
    if name == "LeakyReLU":
        return g.op("LeakyRelu", z, alpha=LEAKY_SLOPE)
    if name == "SiLU":
        return g.op("Mul", z, g.op("Sigmoid", z))
    if name == "Softplus":  # max(z, 0) + log(1 + exp(−|z|)): ONNX's Softplus may overflow for large z
        return g.op("Add", g.op("Relu", z), g.op("Log", g.op("Add", g.const(1.0), g.op("Exp", g.op("Neg", g.op("Abs", z))))))
    if name == "Squareplus":
        root = g.op("Sqrt", g.op("Add", g.op("Mul", z, z), g.const(4.0)))
        return g.op("Mul", g.const(0.5), g.op("Add", z, root))
    raise ValueError(f"unknown activation {name!r}")


def _onnx_encode(g: _OnnxGraph, enc: EncodingSpec, x: str, dims: int) -> str:
    """numerics.encode as ONNX operators on ``x`` (batch × dims)."""
    if enc.otype == "Identity":
        return x if enc.passthrough else g.op("Add", g.op("Mul", x, g.const(enc.scale)), g.const(enc.offset))
    if enc.otype == "Frequency":
        freqs = (2.0 ** np.arange(enc.n_frequencies) * np.pi).astype(np.float32)
        arg = g.op("Mul", g.op("Unsqueeze", x, g.const([2], np.int64)), g.const(freqs))  # batch × dims × F
        last = g.const([3], np.int64)
        pairs = g.op("Concat", g.op("Unsqueeze", g.op("Sin", arg), last), g.op("Unsqueeze", g.op("Cos", arg), last), axis=3)
        return g.op("Reshape", pairs, g.const([0, -1], np.int64))  # batch × (dims·F·2)
    if enc.otype == "OneBlob":
        n = enc.n_bins
        left = (np.arange(n) / n).astype(np.float32)
        u = g.op("Sub", g.const(left), g.op("Unsqueeze", x, g.const([2], np.int64)))  # batch × dims × n

        def cdf(v: str) -> str:
            v = g.op("Mul", v, g.const(float(n)))
            v2 = g.op("Mul", v, v)
            inner = g.op("Add", g.op("Sub", g.const(1.0), g.op("Mul", g.const(2 / 3), v2)),
                         g.op("Mul", g.const(1 / 5), g.op("Mul", v2, v2)))
            poly = g.op("Add", g.op("Mul", g.const(15 / 16), g.op("Mul", v, inner)), g.const(0.5))
            return g.op("Min", g.op("Max", poly, g.const(0.0)), g.const(1.0))

        c = g.op("Add", g.op("Add", cdf(u), cdf(g.op("Sub", u, g.const(1.0)))), cdf(g.op("Add", u, g.const(1.0))))
        axis = g.const([2], np.int64)
        rest = g.op("Slice", c, g.const([1], np.int64), g.const([n], np.int64), axis)
        first = g.op("Add", g.op("Slice", c, g.const([0], np.int64), g.const([1], np.int64), axis), g.const(1.0))
        return g.op("Reshape", g.op("Sub", g.op("Concat", rest, first, axis=2), c), g.const([0, -1], np.int64))
    axis = g.const([1], np.int64)
    parts = [_onnx_encode(g, part, g.op("Slice", x, g.const([begin], np.int64), g.const([begin + n], np.int64), axis), n)
             for part, begin, n in enc.parts(dims)]
    return parts[0] if len(parts) == 1 else g.op("Concat", *parts, axis=1)


__all__ = ["to_torch", "to_onnx", "from_tcnn", "from_state_dict", "inference_params", "tcnn_layer_shapes",
           "tcnn_n_params", "ONNX_OPSET"]
