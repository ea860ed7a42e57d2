"""Models in and out of mmad: PyTorch, ONNX, tiny-cuda-nn parameters, ``nn.Sequential`` state dicts.

* :func:`to_torch` — a ``torch.nn.Module`` computing what mmad's fp32 forward computes
  (the spec's encoding, a grid's tables as parameters, then ``Linear`` + activation layers),
  trainable further in PyTorch.
* :func:`to_onnx` — the same function as an ONNX graph, built with the ``onnx`` package alone
  (no PyTorch needed), opset 18, a dynamic batch dimension.
* :func:`from_tcnn` — tiny-cuda-nn's flat parameter buffer (fp16 or fp32) of a
  ``NetworkWithInputEncoding`` with this spec's config, as mmad's ``W{i}``/``b{i}``;
  :func:`to_tcnn` the other way; :func:`tcnn_initial_params` the buffer tcnn starts from for a seed.
* :func:`from_state_dict` — the ``state_dict`` of a plain ``nn.Sequential`` of ``Linear``
  layers (and activations), or of a module :func:`to_torch` made, as mmad's parameters.
* :func:`inference_params` — the weights a model infers with (the EMA average under an EMA
  optimizer), from a version's parameters and optimizer state.

torch and onnx are optional (``pip install mmad[export]``); they are imported when needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from mmad.backends.contract import check_params, init_params, param_shapes
from mmad.backends.encodings import GRID_OTYPES, HASH_PRIMES, grid_index_modes, spherical_harmonics
from mmad.backends.numerics import LEAKY_SLOPE
from mmad.errors import InvalidInput
from mmad.spec import EncodingSpec, MLPSpec

ONNX_OPSET = 18  # 18: BitwiseAnd and BitwiseXor, which a hash grid's index needs
TCNN_ALIGNMENT = 16  # FullyFusedMLP's and CutlassMLP's REQUIRED_ALIGNMENT(): input and output widths pad to it


def require_optional(module: str, extra: str = "export"):
    try:
        return __import__(module)
    except ImportError as exc:
        what = "torch, onnx and onnxruntime" if extra == "export" else module
        raise ImportError(f"{module} is not installed: `pip install mmad[{extra}]` installs {what} ({exc})") from exc


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
    padded to 16 columns, the output layer padded to 16 rows."""
    pad = lambda n: -(-n // TCNN_ALIGNMENT) * TCNN_ALIGNMENT  # noqa: E731
    width = spec.n_neurons
    return ([(width, pad(spec.n_encoded_dims))] + [(width, width)] * (spec.n_hidden_layers - 1)
            + [(pad(spec.n_output_dims), width)])


def tcnn_n_params(spec: MLPSpec) -> int:
    """tiny-cuda-nn's ``n_params()`` for this config: the network's matrices, then the grids'
    tables (``NetworkWithInputEncoding`` holds the network's parameters first)."""
    return sum(r * c for r, c in tcnn_layer_shapes(spec)) + sum(r * f for r, f in spec.grid_shapes.values())


@dataclass(frozen=True)
class TcnnSegment:
    """One parameter in tiny-cuda-nn's flat buffer: mmad's ``name`` (``W{i}`` or ``grid{k}``) is
    the ``used`` rows × columns at the top left of the row-major ``shape`` stored from value
    ``offset`` on (a weight matrix padded to 16 columns and output rows; a table exactly)."""

    name: str
    offset: int
    shape: tuple[int, int]
    used: tuple[int, int]

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]


def tcnn_layout(spec: MLPSpec) -> list[TcnnSegment]:
    """Every parameter's place in tiny-cuda-nn's buffer for ``spec`` (``from_tcnn`` / ``to_tcnn``
    and mmad.torch's flat ``params`` share it), in buffer order."""
    check_exportable(spec)
    _tcnn_padding_is_ones(spec)  # refuses a Composite tcnn would pad between parts
    out, at = [], 0
    for i, (shape, (fan_in, fan_out)) in enumerate(zip(tcnn_layer_shapes(spec), spec.layer_dims)):
        out.append(TcnnSegment(f"W{i}", at, shape, (fan_out, fan_in)))
        at += shape[0] * shape[1]
    for name, shape in spec.grid_shapes.items():
        out.append(TcnnSegment(name, at, shape, shape))
        at += shape[0] * shape[1]
    return out


def tcnn_bias_columns(spec: MLPSpec) -> bool:
    """Whether the first layer's padding columns act as its bias ``b0`` (the encoding pads with
    columns of 1: every encoding but a grid, which pads with 0); the other layers have none."""
    return _tcnn_padding_is_ones(spec) and tcnn_layer_shapes(spec)[0][1] > spec.n_encoded_dims


def _tcnn_padding_is_ones(spec: MLPSpec) -> bool:
    """Whether the columns tcnn pads the encoded input with hold 1 (they are the last part's:
    a grid pads with 0, every other encoding with 1). A Composite whose parts tcnn would pad
    between (a grid after a width that is not a multiple of its features: its alignment) is
    refused, as mmad's columns would not line up with tcnn's."""
    width = 0
    parts = spec.encoding.parts(spec.n_input_dims)
    for part, _, dims in parts:
        if part.is_grid and width % part.n_features_per_level:
            raise InvalidInput(f"tiny-cuda-nn pads the encoded input before the {part.otype} part (its {width} columns "
                               f"before are not a multiple of its n_features_per_level {part.n_features_per_level}); "
                               "importing such a buffer is not built")
        width += part.n_output_dims(dims)
    return not parts[-1][0].is_grid


def params_from_tcnn_flat(spec: MLPSpec, flat: Any, zeros) -> dict[str, Any]:
    """mmad's parameters as views and sums of a flat tcnn buffer ``flat`` (a 1-D NumPy array or
    torch tensor, any float dtype: the results keep it); ``zeros(n)``: a zero vector of that kind.
    The first layer's bias is the sum of its padding columns' weights where they multiply 1."""
    bias_columns = tcnn_bias_columns(spec)
    params: dict[str, Any] = {}
    for seg in tcnn_layout(spec):
        full = flat[seg.offset:seg.offset + seg.size].reshape(seg.shape)
        rows, cols = seg.used
        params[seg.name] = full[:rows, :cols]
        if seg.name.startswith("W"):
            bias = f"b{seg.name[1:]}"
            params[bias] = full[:rows, cols:].sum(1) if seg.name == "W0" and bias_columns else zeros(rows)
    return params


def tcnn_flat_from_params(spec: MLPSpec, params: Mapping[str, Any], flat: Any, spread_bias: bool) -> Any:
    """Write mmad's ``params`` (W{i}, b0 where tcnn has it, grid{k}) into the zeroed flat tcnn
    buffer ``flat`` (NumPy or torch alike) and return it. ``b0`` goes into the first padding
    column, or with ``spread_bias`` into every one: a gradient, d loss / d each padding weight
    being d loss / d b0."""
    bias_columns = tcnn_bias_columns(spec)
    for seg in tcnn_layout(spec):
        full = flat[seg.offset:seg.offset + seg.size].reshape(seg.shape)
        rows, cols = seg.used
        full[:rows, :cols] = params[seg.name]
        if seg.name == "W0" and bias_columns:
            if spread_bias:
                full[:rows, cols:] = params["b0"][:, None]
            else:
                full[:rows, cols] = params["b0"]
    return flat


def from_tcnn(spec: MLPSpec, buffer: Any, dtype: Any = None) -> dict[str, np.ndarray]:
    """mmad's parameters from tiny-cuda-nn's flat parameter buffer for ``spec``'s config.

    tcnn (FullyFusedMLP and CutlassMLP alike) stores each layer's weights as one row-major
    (fan_out × fan_in) matrix, layers back to back, with no biases. Its input is the encoding's
    output padded with columns of 1 up to a multiple of 16, so the first layer's padding columns
    sum to a bias (``b0``); the output layer has rows up to a multiple of 16, of which the first
    ``n_output_dims`` are used. A grid's tables follow the network's matrices, part after part,
    each level's rows back to back with a row's features adjacent: mmad's ``grid{k}`` exactly;
    a grid pads the encoded input with columns of 0, so its padding weights add nothing.
    ``buffer``: an array (fp16/fp32, any shape) or raw bytes of ``dtype`` (``"fp16"`` or ``"fp32"``).
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
    check_tcnn_size(spec, flat.size)
    # the padding columns' sum in float64, rounded once to fp32 by check_params
    return check_params(spec, params_from_tcnn_flat(spec, flat.astype(np.float64), np.zeros))


def check_tcnn_size(spec: MLPSpec, size: int) -> None:
    """A flat tcnn buffer of ``size`` values is this config's; else a clear error with its layout."""
    expected = tcnn_n_params(spec)
    if size != expected:
        layout = " + ".join([f"{r}x{c}" for r, c in tcnn_layer_shapes(spec)]
                            + [f"{r}x{f}" for r, f in spec.grid_shapes.values()])
        raise InvalidInput(f"tiny-cuda-nn's buffer for this config holds {expected} parameters ({layout}, "
                           f"widths padded to {TCNN_ALIGNMENT}); got {size}")


def to_tcnn(spec: MLPSpec, params: Mapping[str, Any], dtype: Any = np.float32) -> np.ndarray:
    """tiny-cuda-nn's flat parameter buffer (``dtype``: float32 or float16) holding mmad's
    ``params``: :func:`from_tcnn`'s inverse. tcnn's network has no biases but the first layer's
    padding columns of 1, so ``b0`` goes into the first padding column; a bias it cannot hold (b0
    of an input without such columns, a later layer's) is refused."""
    params = check_params(spec, dict(params))
    holds_b0 = tcnn_bias_columns(spec)
    lost = [f"b{i}" for i in range(len(spec.layer_dims)) if (i or not holds_b0) and params[f"b{i}"].any()]
    if lost:
        why = ("its first layer's padding columns, which tiny-cuda-nn multiplies by 1, can hold b0"
               if holds_b0 else "this encoding leaves it no padding columns of 1 to hold b0")
        raise InvalidInput(f"tiny-cuda-nn's network has no biases: {', '.join(lost)} must be zero ({why})")
    flat = np.zeros(tcnn_n_params(spec), np.float64)
    return tcnn_flat_from_params(spec, params, flat, spread_bias=False).astype(dtype)


# -- tiny-cuda-nn's initial parameters ------------------------------------------------------------
PCG32_MULT = 0x5851F42D4C957F2D
_U64 = np.uint64


class Pcg32:
    """tiny-cuda-nn's pcg32 (dependencies/pcg32: PCG-XSH-RR, stream 1 by default), drawing many
    values at once: draw k of a run is the generator ``k`` steps on."""

    def __init__(self, seed: int, stream: int = 1):
        self.inc = ((stream << 1) | 1) & 0xFFFFFFFFFFFFFFFF
        self.state = 0
        self._step()
        self.state = (self.state + seed) & 0xFFFFFFFFFFFFFFFF
        self._step()

    def _step(self) -> None:
        self.state = (self.state * PCG32_MULT + self.inc) & 0xFFFFFFFFFFFFFFFF

    def _states(self, n: int) -> np.ndarray:
        """The states before each of the next ``n`` draws (uint64; wrapping products are pcg's)."""
        states = np.empty(max(n, 1), np.uint64)
        states[0] = self.state
        mult, plus, have = PCG32_MULT, self.inc, 1  # the affine map of ``have`` steps
        with np.errstate(over="ignore"):
            while have < n:
                take = min(have, n - have)
                states[have:have + take] = states[:take] * _U64(mult) + _U64(plus)
                plus = (plus * mult + plus) & 0xFFFFFFFFFFFFFFFF
                mult = (mult * mult) & 0xFFFFFFFFFFFFFFFF
                have += take
        return states[:n]

    def advance(self, n: int) -> None:
        mult, plus, acc_mult, acc_plus = PCG32_MULT, self.inc, 1, 0
        while n > 0:
            if n & 1:
                acc_mult = (acc_mult * mult) & 0xFFFFFFFFFFFFFFFF
                acc_plus = (acc_plus * mult + plus) & 0xFFFFFFFFFFFFFFFF
            plus = ((mult + 1) * plus) & 0xFFFFFFFFFFFFFFFF
            mult = (mult * mult) & 0xFFFFFFFFFFFFFFFF
            n >>= 1
        self.state = (acc_mult * self.state + acc_plus) & 0xFFFFFFFFFFFFFFFF

    def floats(self, n: int, advance: bool = True) -> np.ndarray:
        """The next ``n`` next_float() values, [0, 1) float32 (the generator moved past them)."""
        old = self._states(n)
        xorshifted = (((old >> _U64(18)) ^ old) >> _U64(27)) & _U64(0xFFFFFFFF)
        rot = old >> _U64(59)
        bits = ((xorshifted >> rot) | (xorshifted << ((_U64(32) - rot) & _U64(31)))) & _U64(0xFFFFFFFF)
        if advance:
            self.advance(n)
        return ((bits >> _U64(9)) | _U64(0x3F800000)).astype(np.uint32).view(np.float32) - np.float32(1)


GENERATE_PER_THREAD, LINEAR_THREADS = 4, 128  # tcnn's generate_random: N_TO_GENERATE, N_THREADS_LINEAR


def _tcnn_uniform_kernel(rng: Pcg32, n: int, low: float, high: float) -> np.ndarray:
    """tcnn's generate_random_uniform (a GPU kernel): thread i of T takes draws 4i … 4i + 3 for
    elements i, i + T, i + 2T, i + 3T; then the generator advances past n draws."""
    needed = math.ceil(n / GENERATE_PER_THREAD)
    threads = math.ceil(needed / LINEAR_THREADS) * LINEAR_THREADS  # the launch's blockDim.x · gridDim.x
    draws = rng.floats(threads * GENERATE_PER_THREAD, advance=False)
    rng.advance(n)
    idx = np.arange(n)
    values = draws[(idx % threads) * GENERATE_PER_THREAD + idx // threads]
    low32, high32 = np.float32(low), np.float32(high)
    # val · (upper − lower) + lower, which nvcc contracts to one fma: the product is exact in float64
    return (values.astype(np.float64) * np.float64(high32 - low32) + np.float64(low32)).astype(np.float32)


def tcnn_initial_params(spec: MLPSpec, seed: int, network: bool = True) -> np.ndarray:
    """The flat fp32 buffer tiny-cuda-nn's ``initial_params(seed)`` gives a NetworkWithInputEncoding
    of ``spec``'s config (tinycudann's modules start from it): a pcg32 seeded with ``seed`` draws
    every weight matrix in turn on the host (Xavier uniform over the padded shape; SIREN's with a
    Sine activation), then every grid table in turn in tcnn's GPU kernel order (uniform ±1e-4).
    ``network=False``: an ``Encoding`` alone, its tables only."""
    rng = Pcg32(seed)
    chunks = []
    for i, (rows, cols) in enumerate(tcnn_layer_shapes(spec) if network else ()):
        if spec.activation == "Sine":  # initialize_siren_uniform_first / initialize_siren_uniform
            scale = np.float32(30.0) / np.float32(cols) if i == 0 else np.sqrt(np.float32(6.0) / np.float32(cols))
        else:  # initialize_xavier_uniform: fan_in + fan_out of the stored matrix
            scale = np.sqrt(np.float32(6.0) / np.float32(rows + cols))
        scale = np.float32(scale)
        chunks.append(rng.floats(rows * cols) * np.float32(2.0) * scale - scale)
    for rows, features in spec.grid_shapes.values():
        chunks.append(_tcnn_uniform_kernel(rng, rows * features, -1e-4, 1e-4))
    return np.concatenate(chunks).astype(np.float32) if chunks else np.zeros(0, np.float32)


# -- PyTorch state dicts -------------------------------------------------------------------------
def from_state_dict(spec: MLPSpec, state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """mmad's parameters from a plain ``nn.Sequential`` of ``Linear`` layers (activations between
    them hold no parameters): each ``<prefix>.weight`` (fan_out × fan_in, as mmad's ``W{i}``) in
    the state dict's order, with its ``<prefix>.bias`` (zeros for ``bias=False``); a grid's
    tables as :func:`to_torch`'s module holds them (``grids.{k}``, mmad's ``grid{k}``)."""
    check_exportable(spec)
    arrays = {k: _to_numpy(v) for k, v in state_dict.items()}
    tables = {f"grids.{k[len('grid'):]}": k for k in spec.grid_shapes}
    missing = [key for key in tables if key not in arrays]
    if missing:
        raise InvalidInput(f"the model's grid encoding has {len(tables)} table(s); the state dict lacks {missing} "
                           "(a module to_torch made holds them as grids.0, grids.1, ...)")
    params = {name: arrays.pop(key) for key, name in tables.items()}
    weights = [k for k, v in arrays.items() if k.rsplit(".", 1)[-1] == "weight"]
    known = set(weights) | {w[: -len("weight")] + "bias" for w in weights}
    unknown = [k for k in arrays if k not in known]
    if unknown:
        raise InvalidInput(f"not the state dict of a plain nn.Sequential of Linear layers: unexpected entries {unknown[:5]}")
    if len(weights) != len(spec.layer_dims):
        raise InvalidInput(f"the model has {len(spec.layer_dims)} Linear layers; the state dict holds "
                           f"{len(weights)} weights ({weights[:6]})")
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


PARAMETER_FREE = ("Identity", "Frequency", "OneBlob", "SphericalHarmonics", "TriangleWave")


def check_exportable(spec: MLPSpec) -> None:
    """Export and import cover every encoding mmad runs (grids' tables as parameters); one they do
    not know is refused, naming it."""
    known = PARAMETER_FREE + GRID_OTYPES
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
    grids = torch.nn.ParameterList([torch.nn.Parameter(torch.from_numpy(np.array(params[name], np.float32)))
                                    for name in spec.grid_shapes])
    return _torch_model_class(torch)(spec, torch.nn.Sequential(*layers), grids)


def _torch_model_class(torch):
    class MMADModel(torch.nn.Module):
        """mmad's model in PyTorch: ``encoding(x)`` (reading the grid tables ``grids``) then ``net``."""

        def __init__(self, spec: MLPSpec, net, grids):
            super().__init__()
            self.spec = spec
            self.net = net
            self.grids = grids

        def forward(self, x):
            return self.net(_torch_encode(torch, self.spec.encoding, x, iter(self.grids)))

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


def _torch_encode(torch, enc: EncodingSpec, x, tables):
    """numerics.encode in torch (same operations, in x's dtype); ``tables``: an iterator over the
    grid parts' tables, in order."""
    if enc.is_grid:
        return _torch_grid(torch, enc, x, next(tables))
    if enc.otype == "SphericalHarmonics":
        return spherical_harmonics(enc.degree, x, torch)
    if enc.otype == "TriangleWave":  # encodings.triangle_wave: x·2^(k−1) + k/4, exact as its ldexp
        k = np.arange(enc.n_frequencies)
        v = x[:, :, None] * torch.from_numpy(np.ldexp(1.0, k - 1)).to(x.dtype) + torch.from_numpy(k * 0.25).to(x.dtype)
        return (torch.abs(v - torch.floor(v) - 0.5) * 4 - 1).reshape(x.shape[0], -1)
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
    return torch.cat([_torch_encode(torch, part, x[:, begin:begin + dims], tables)
                      for part, begin, dims in enc.parts(x.shape[1])], dim=1)


U32 = 0xFFFFFFFF


def _mulmod32(a, b: int):
    """(a · b) mod 2^32 of int64 values a in [0, 2^32] and a constant b < 2^32, without the
    int64 product overflowing: a's two 16-bit halves multiplied apart (torch tensors; the ONNX
    graph does the same in its operators)."""
    return ((a & 0xFFFF) * b + (((a // 65536) * b) & 0xFFFF) * 65536) & U32


def _torch_grid(torch, part: EncodingSpec, x, table):
    """encodings.grid_lookup + grid_forward in torch: every level's features (tcnn's order), the
    table a parameter (its gradient is the scatter-add of the weights)."""
    dims = x.shape[1]
    corners = 1 if part.interpolation == "Nearest" else 1 << dims
    outs = []
    for info, mode in zip(part.grid_levels(dims), grid_index_modes(part, dims)):
        if x.dtype == torch.float32:  # tcnn's fmaf: the product exact in float64, one rounding after the add
            pos = (x.double() * info.scale + 0.5).float()
        else:
            pos = x * info.scale + 0.5
        cell = torch.floor(pos)
        frac = pos - cell
        cell = cell.to(torch.int64) & U32  # tcnn's (uint32_t)(int)floorf
        if part.interpolation == "Smoothstep":
            frac = frac * frac * (3.0 - 2.0 * frac)
        acc = None
        for corner in range(corners):
            offsets = [(corner >> d) & 1 for d in range(dims)]
            local = [cell[:, d] + offsets[d] for d in range(dims)]
            index = torch.zeros_like(local[0])
            if mode == "hash":
                for d in range(dims):
                    index = index ^ _mulmod32(local[d], HASH_PRIMES[d])
            elif mode == "dense":
                stride = 1
                for d in range(dims):
                    index = (index + _mulmod32(local[d], stride)) & U32
                    stride *= info.resolution
            values = table[index % info.entries + info.offset]
            if corners > 1:  # tcnn multiplies the dims' factors in dim order
                w = torch.ones_like(frac[:, 0])
                for d in range(dims):
                    w = w * (frac[:, d] if offsets[d] else 1.0 - frac[:, d])
                values = values * w[:, None]
            acc = values if acc is None else acc + values
        outs.append(acc)
    return torch.cat(outs, dim=1)


# -- ONNX ---------------------------------------------------------------------------------------------
def to_onnx(spec: MLPSpec, params: Mapping[str, Any]) -> bytes:
    """The model as a serialized ONNX graph (opset 17): input ``INPUT`` (batch × n_input_dims,
    float32), output ``OUTPUT`` (the names of mmad's own API); the encoding in ONNX operators, each layer a ``Gemm``."""
    check_exportable(spec)
    onnx = require_optional("onnx")
    from onnx import TensorProto, helper, numpy_helper

    params = check_params(spec, dict(params))
    graph = _OnnxGraph(helper, numpy_helper)
    h = _onnx_encode(graph, spec.encoding, "INPUT", spec.n_input_dims, iter([params[n] for n in spec.grid_shapes]))
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


class _OnnxValue:
    """A float value of the graph under construction with NumPy's arithmetic and column
    indexing, so that the oracle's own formula (encodings.spherical_harmonics) builds the graph;
    ``full_like`` and ``stack`` make this class the formula's array namespace too."""

    def __init__(self, g: _OnnxGraph, name: str):
        self.g, self.name = g, name

    def _of(self, other: Any) -> str:
        return other.name if isinstance(other, _OnnxValue) else self.g.const(float(other))

    def _op(self, op_type: str, a: str, b: str) -> "_OnnxValue":
        return _OnnxValue(self.g, self.g.op(op_type, a, b))

    def __add__(self, o): return self._op("Add", self.name, self._of(o))  # noqa: E704
    def __radd__(self, o): return self._op("Add", self._of(o), self.name)  # noqa: E704
    def __sub__(self, o): return self._op("Sub", self.name, self._of(o))  # noqa: E704
    def __rsub__(self, o): return self._op("Sub", self._of(o), self.name)  # noqa: E704
    def __mul__(self, o): return self._op("Mul", self.name, self._of(o))  # noqa: E704
    def __rmul__(self, o): return self._op("Mul", self._of(o), self.name)  # noqa: E704
    def __neg__(self): return _OnnxValue(self.g, self.g.op("Neg", self.name))  # noqa: E704

    def __getitem__(self, key: tuple[slice, int]) -> "_OnnxValue":
        _, column = key  # x[:, j]: column j, one value a row
        return _OnnxValue(self.g, self.g.op("Gather", self.name, self.g.const(column, np.int64), axis=1))

    @staticmethod
    def full_like(v: "_OnnxValue", value: float) -> "_OnnxValue":
        return _OnnxValue(v.g, v.g.op("Expand", v.g.const(value), v.g.op("Shape", v.name)))

    @staticmethod
    def stack(values: list["_OnnxValue"], axis: int) -> "_OnnxValue":
        g = values[0].g
        where = g.const([axis], np.int64)
        return _OnnxValue(g, g.op("Concat", *[g.op("Unsqueeze", v.name, where) for v in values], axis=axis))


def _onnx_mulmod32(g: _OnnxGraph, a: str, b: int) -> str:
    """_mulmod32 in ONNX operators (int64 values)."""
    i64 = lambda v: g.const(v, np.int64)  # noqa: E731
    lo = g.op("Mul", g.op("BitwiseAnd", a, i64(0xFFFF)), i64(b))
    hi = g.op("BitwiseAnd", g.op("Mul", g.op("Div", a, i64(65536)), i64(b)), i64(0xFFFF))
    return g.op("BitwiseAnd", g.op("Add", lo, g.op("Mul", hi, i64(65536))), i64(U32))


def _onnx_grid(g: _OnnxGraph, part: EncodingSpec, x: str, dims: int, table: np.ndarray) -> str:
    """_torch_grid in ONNX operators: the table a constant, each corner's rows gathered from it."""
    i64 = lambda v: g.const(v, np.int64)  # noqa: E731
    corners = 1 if part.interpolation == "Nearest" else 1 << dims
    values = g.const(np.asarray(table, np.float32))
    x64 = g.op("Cast", x, to=11)  # double: tcnn's fmaf, the product exact, one rounding after the add
    outs = []
    for info, mode in zip(part.grid_levels(dims), grid_index_modes(part, dims)):
        pos = g.op("Cast", g.op("Add", g.op("Mul", x64, g.const(info.scale, np.float64)), g.const(0.5, np.float64)),
                   to=1)
        floor = g.op("Floor", pos)
        frac = g.op("Sub", pos, floor)
        cell = g.op("BitwiseAnd", g.op("Cast", floor, to=7), i64(U32))
        if part.interpolation == "Smoothstep":
            frac = g.op("Mul", g.op("Mul", frac, frac), g.op("Sub", g.const(3.0), g.op("Mul", g.const(2.0), frac)))
        columns = [g.op("Gather", cell, i64(d), axis=1) for d in range(dims)]
        fracs = [g.op("Gather", frac, i64(d), axis=1) for d in range(dims)]
        acc = None
        for corner in range(corners):
            offsets = [(corner >> d) & 1 for d in range(dims)]
            local = [g.op("Add", columns[d], i64(1)) if offsets[d] else columns[d] for d in range(dims)]
            index = g.op("Mul", local[0], i64(0))
            if mode == "hash":
                for d in range(dims):
                    index = g.op("BitwiseXor", index, _onnx_mulmod32(g, local[d], HASH_PRIMES[d]))
            elif mode == "dense":
                stride = 1
                for d in range(dims):
                    index = g.op("BitwiseAnd", g.op("Add", index, _onnx_mulmod32(g, local[d], stride)), i64(U32))
                    stride *= info.resolution
            row = g.op("Add", g.op("Mod", index, i64(info.entries)), i64(info.offset))
            value = g.op("Gather", values, row, axis=0)  # batch × features
            if corners > 1:
                w = None
                for d in range(dims):
                    f = fracs[d] if offsets[d] else g.op("Sub", g.const(1.0), fracs[d])
                    w = f if w is None else g.op("Mul", w, f)
                value = g.op("Mul", value, g.op("Unsqueeze", w, i64([1])))
            acc = value if acc is None else g.op("Add", acc, value)
        outs.append(acc)
    return outs[0] if len(outs) == 1 else g.op("Concat", *outs, axis=1)


def _onnx_encode(g: _OnnxGraph, enc: EncodingSpec, x: str, dims: int, tables) -> str:
    """numerics.encode as ONNX operators on ``x`` (batch × dims); ``tables``: an iterator over
    the grid parts' tables, in order."""
    if enc.is_grid:
        return _onnx_grid(g, enc, x, dims, next(tables))
    if enc.otype == "SphericalHarmonics":
        return spherical_harmonics(enc.degree, _OnnxValue(g, x), _OnnxValue).name
    if enc.otype == "TriangleWave":
        k = np.arange(enc.n_frequencies)
        v = g.op("Add", g.op("Mul", g.op("Unsqueeze", x, g.const([2], np.int64)), g.const(np.ldexp(1.0, k - 1))),
                 g.const(k * 0.25))  # batch × dims × F
        wave = g.op("Sub", g.op("Mul", g.op("Abs", g.op("Sub", g.op("Sub", v, g.op("Floor", v)), g.const(0.5))),
                                g.const(4.0)), g.const(1.0))
        return g.op("Reshape", wave, g.const([0, -1], np.int64))
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
    parts = [_onnx_encode(g, part, g.op("Slice", x, g.const([begin], np.int64), g.const([begin + n], np.int64), axis), n,
                          tables)
             for part, begin, n in enc.parts(dims)]
    return parts[0] if len(parts) == 1 else g.op("Concat", *parts, axis=1)


__all__ = ["to_torch", "to_onnx", "from_tcnn", "to_tcnn", "tcnn_initial_params", "tcnn_layout", "from_state_dict",
           "inference_params", "tcnn_layer_shapes",
           "tcnn_n_params", "ONNX_OPSET"]
