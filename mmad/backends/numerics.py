"""The math every backend must agree on, written once in NumPy.

Activations (value and derivative from the pre-activation), losses (per-element value and
gradient, tiny-cuda-nn's definitions: relative losses hold their normaliser constant),
encodings (forward; backward into the grid encodings' tables and into the inputs, see
:mod:`.encodings`), and the optimizer updates. The cpu backend runs these directly; GPU backends use the encodings on the
host and the tests use all of them as the definition of right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from mmad.backends.encodings import (
    GridLookup, grid_backward, grid_forward, grid_input_gradient, grid_lookup, spherical_harmonics,
    spherical_harmonics_input_gradient, triangle_wave, triangle_wave_input_gradient,
)
from mmad.errors import InvalidInput
from mmad.spec import EmaSpec, EncodingSpec, OptimizerSpec

if TYPE_CHECKING:  # an annotation only: the contract builds on this module
    from mmad.backends.contract import Dataset

LEAKY_SLOPE = 0.01
LOSS_EPSILON = 0.01  # tiny-cuda-nn's normaliser offset for the relative losses


# -- activations ---------------------------------------------------------------------------
def all_finite(array: np.ndarray) -> bool:
    """No NaN or Inf in the float16 or float32 host array."""
    if array.dtype == np.float16:  # the exponent test: NumPy's float16 isfinite is ~10x slower
        return (array.view(np.uint16) & np.uint16(0x7C00)).max(initial=0) != 0x7C00
    return bool(np.isfinite(array).all())


def activate(name: str, z: np.ndarray) -> np.ndarray:
    if name == "None":
        return z
    if name == "ReLU":
        return np.maximum(z, 0)
    if name == "LeakyReLU":
        return np.where(z > 0, z, z * LEAKY_SLOPE)
    if name == "Sigmoid":
        return _sigmoid(z)
    if name == "Tanh":
        return np.tanh(z)
    if name == "SiLU":
        return z * _sigmoid(z)
    if name == "Softplus":
        return np.logaddexp(z, 0)
    if name == "Squareplus":
        return 0.5 * (z + np.sqrt(z * z + 4))
    if name == "Exponential":
        return np.exp(z)
    if name == "Sine":
        return np.sin(z)
    raise ValueError(f"unknown activation {name!r}")


def activate_in_place(name: str, z: np.ndarray) -> np.ndarray:
    """``activate(name, z)`` written over ``z`` and returned: one ufunc pass without a temporary
    where one ufunc is the activation (the host forward's hot path), else through ``activate``."""
    if name == "None":
        return z
    if name == "ReLU":
        return np.maximum(z, z.dtype.type(0), out=z)
    if name in _ONE_UFUNC:
        return _ONE_UFUNC[name](z, out=z)
    z[...] = activate(name, z)
    return z


_ONE_UFUNC = {"Tanh": np.tanh, "Exponential": np.exp, "Sine": np.sin}


def activation_grad(name: str, z: np.ndarray) -> np.ndarray:
    """d activate(z) / dz, element-wise."""
    if name == "None":
        return np.ones_like(z)
    if name == "ReLU":
        return (z > 0).astype(z.dtype)
    if name == "LeakyReLU":
        return np.where(z > 0, 1.0, LEAKY_SLOPE).astype(z.dtype)
    if name == "Sigmoid":
        s = _sigmoid(z)
        return s * (1 - s)
    if name == "Tanh":
        return 1 - np.tanh(z) ** 2
    if name == "SiLU":
        s = _sigmoid(z)
        return s * (1 + z * (1 - s))
    if name == "Softplus":
        return _sigmoid(z)
    if name == "Squareplus":
        return 0.5 * (1 + z / np.sqrt(z * z + 4))
    if name == "Exponential":
        return np.exp(z)
    if name == "Sine":
        return np.cos(z)
    raise ValueError(f"unknown activation {name!r}")


def _sigmoid(z: np.ndarray) -> np.ndarray:
    # exp of a negative argument only: no overflow warnings for large |z|
    e = np.exp(-np.abs(z))
    return np.where(z >= 0, 1 / (1 + e), e / (1 + e))


# -- losses --------------------------------------------------------------------------------
def loss_terms(name: str, pred: np.ndarray, target: np.ndarray, *, delta: float = 1.0,
               normaliser_from: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-element loss values and d value / d pred.

    The relative losses divide by a normaliser computed from the prediction (or target)
    that tiny-cuda-nn treats as a constant; ``normaliser_from`` fixes the prediction it is
    computed from, so a finite-difference check can hold it constant too.
    """
    d = pred - target
    p = pred if normaliser_from is None else normaliser_from
    if name == "L2":
        return d * d, 2 * d
    if name == "L1":
        return np.abs(d), np.sign(d)
    if name == "RelativeL2":
        n = p * p + LOSS_EPSILON
        return d * d / n, 2 * d / n
    if name == "RelativeL1":
        n = np.abs(p) + LOSS_EPSILON
        return np.abs(d) / n, np.sign(d) / n
    if name == "RelativeL2Luminance":
        lum = _luminance(p)
        n = lum * lum + LOSS_EPSILON
        return d * d / n, 2 * d / n
    if name == "MAPE":
        n = np.abs(target) + LOSS_EPSILON
        return np.abs(d) / n, np.sign(d) / n
    if name == "SMAPE":
        n = np.abs(p) + np.abs(target) + LOSS_EPSILON
        return 2 * np.abs(d) / n, 2 * np.sign(d) / n
    if name == "Huber":
        small = np.abs(d) <= delta
        value = np.where(small, 0.5 * d * d, delta * (np.abs(d) - 0.5 * delta))
        return value, np.where(small, d, delta * np.sign(d))
    raise ValueError(f"unknown loss {name!r}")


def _luminance(p: np.ndarray) -> np.ndarray:
    """Per-row luminance (Rec. 601 weights on the first three outputs), broadcast to all."""
    if p.shape[1] >= 3:
        lum = 0.299 * p[:, 0:1] + 0.587 * p[:, 1:2] + 0.114 * p[:, 2:3]
    else:
        lum = np.abs(p).mean(axis=1, keepdims=True)
    return np.broadcast_to(lum, p.shape)


# -- encodings -----------------------------------------------------------------------------
# tiny-cuda-nn's definitions (encodings/identity.h, frequency.h, oneblob.h, composite.h, and the
# grids, spherical harmonics and triangle wave of .encodings); the columns tiny-cuda-nn pads an
# encoding with up to the network's alignment (1, or 0 after a grid) and between a Composite's
# parts (to the next part's alignment) are not materialised: mmad's parameters are unpadded, so
# no padded column is ever exposed or computed here.
def encode(encoding: EncodingSpec, x: np.ndarray, grids: Sequence[np.ndarray] = ()) -> np.ndarray:
    """Apply an encoding to (rows × dims) inputs; the dtype of ``x`` is kept. ``grids``: the
    table of every grid part in order (the parameters ``grid0``, ``grid1``, … in x's dtype)."""
    return encode_with_lookups(encoding, x, grids)[0]


def encode_with_lookups(encoding: EncodingSpec, x: np.ndarray,
                        grids: Sequence[np.ndarray] = ()) -> tuple[np.ndarray, list[GridLookup]]:
    """``encode`` and, for the backward pass, where each grid part read its table."""
    outs, lookups = [], []
    for part, begin, dims in encoding.parts(x.shape[1]):
        xs = x if encoding.otype != "Composite" else x[:, begin:begin + dims]
        if part.is_grid:
            if len(lookups) >= len(grids):
                raise ValueError(f"the encoding has a grid part {len(lookups)} but {len(grids)} tables were given")
            lookups.append(grid_lookup(part, xs))
            outs.append(grid_forward(lookups[-1], grids[len(lookups) - 1]))
        else:
            outs.append(_encode_part(part, xs))
    return (outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)), lookups


def grid_kernel_input(encoding: EncodingSpec, x: np.ndarray) -> np.ndarray:
    """What a device backend's grid kernels read for host rows ``x`` of a grid model: the raw input
    (float32) followed by the columns of its parameter-free parts, encoded here on the host (the
    kernels interpolate the grid columns from the raw dims; encodings.grid_input_layout)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    host = [encode(part, x[:, begin:begin + dims]) for part, begin, dims in encoding.parts(x.shape[1])
            if not part.is_grid]
    return np.ascontiguousarray(np.concatenate([x] + host, axis=1), dtype=np.float32) if host else x


def grid_gradients(encoding: EncodingSpec, n_input_dims: int, lookups: list[GridLookup],
                   d_encoded: np.ndarray, grids: Sequence[np.ndarray]) -> list[np.ndarray]:
    """d loss / d table of every grid part (shaped like ``grids``) from d loss / d encoded output."""
    out, column = [], 0
    for part, _, dims in encoding.parts(n_input_dims):
        width = part.n_output_dims(dims)
        if part.is_grid:
            k = len(out)
            out.append(grid_backward(lookups[k], d_encoded[:, column:column + width], grids[k].shape[0]))
        column += width
    return out


def encode_input_gradient(encoding: EncodingSpec, x: np.ndarray, d_encoded: np.ndarray, lookups: list[GridLookup],
                          grids: Sequence[np.ndarray]) -> np.ndarray:
    """d loss / d input (rows × dims, d_encoded's dtype) from d loss / d encoded output, as each of
    tiny-cuda-nn's encodings computes its ``dL_dinput`` (every encoding does; a Nearest grid's is
    0): ``lookups`` and ``grids`` as ``encode_with_lookups`` returned and read them. A Composite's
    parts add into the input dims they read."""
    out = np.zeros(x.shape, d_encoded.dtype)
    column, k = 0, 0
    for part, begin, dims in encoding.parts(x.shape[1]):
        width = part.n_output_dims(dims)
        d, xs = d_encoded[:, column:column + width], x[:, begin:begin + dims]
        if part.is_grid:
            grad = grid_input_gradient(lookups[k], d, grids[k])
            k += 1
        else:
            grad = _part_input_gradient(part, xs, d)
        out[:, begin:begin + dims] += grad
        column += width
    return out


def _part_input_gradient(encoding: EncodingSpec, x: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``encode_input_gradient`` of one parameter-free encoding (tcnn's ``*_backward`` kernels)."""
    t = d.dtype.type
    x = x.astype(d.dtype, copy=False)
    if encoding.otype == "Identity":
        return d * t(encoding.scale)
    if encoding.otype == "Frequency":  # d sin(2^i·π·x) = 2^i·π·cos(·), d cos(2^i·π·x) = −2^i·π·sin(·)
        freqs = ((2.0 ** np.arange(encoding.n_frequencies)) * np.pi).astype(d.dtype)
        arg = x[:, :, None] * freqs
        dy_dx = np.stack([freqs * np.cos(arg), -freqs * np.sin(arg)], axis=-1)
        return (d.reshape(dy_dx.shape) * dy_dx).sum(axis=(2, 3))
    if encoding.otype == "OneBlob":
        return _one_blob_input_gradient(x, encoding.n_bins, d)
    if encoding.otype == "SphericalHarmonics":
        return spherical_harmonics_input_gradient(encoding.degree, x, d)
    if encoding.otype == "TriangleWave":
        return triangle_wave_input_gradient(encoding.n_frequencies, x, d)
    raise ValueError(f"no parameter-free encoding {encoding.otype!r}")


def _one_blob_input_gradient(x: np.ndarray, n: int, d: np.ndarray) -> np.ndarray:
    """tcnn's kernel_one_blob_backward: bin k's d/dx is K(b_k − x) − K(b_{k+1} − x), K the quartic
    kernel's density (15/16·(1 − u²)², u = v·n, times n) summed over the three wrapped copies,
    b_k = k/n, up to the last bin's right boundary 1."""
    t = x.dtype.type
    bounds = np.arange(n + 1, dtype=x.dtype) / t(n)
    u = bounds[None, None, :] - x[:, :, None]
    one = t(1)
    density = _quartic_density(u, n) + _quartic_density(u - one, n) + _quartic_density(u + one, n)
    deriv = density[..., :-1] - density[..., 1:]
    return (d.reshape(deriv.shape) * deriv).sum(axis=2)


def _quartic_density(v: np.ndarray, inv_radius: int) -> np.ndarray:
    """tcnn's quartic_cdf_deriv: 15/16·max(1 − u², 0)² · inv_radius, u = v·inv_radius."""
    t = v.dtype.type
    u = v * t(inv_radius)
    w = np.maximum(t(1) - u * u, t(0))
    return t(15 / 16) * w * w * t(inv_radius)


def _encode_part(encoding: EncodingSpec, x: np.ndarray) -> np.ndarray:
    """One encoding without parameters (not a Composite, not a grid) of (rows × dims) inputs."""
    if encoding.otype == "Identity":
        if encoding.passthrough:
            return x
        return x * x.dtype.type(encoding.scale) + x.dtype.type(encoding.offset)
    if encoding.otype == "Frequency":
        # [dim][frequency][sin, cos]: sin(2^i·π·x), then sin(2^i·π·x + π/2) = cos(2^i·π·x)
        freqs = (2.0 ** np.arange(encoding.n_frequencies)) * np.pi
        arg = x[:, :, None] * freqs.astype(x.dtype)
        out = np.stack([np.sin(arg), np.cos(arg)], axis=-1)
        return out.reshape(x.shape[0], -1)
    if encoding.otype == "OneBlob":
        return _one_blob(x, encoding.n_bins)
    if encoding.otype == "SphericalHarmonics":
        return spherical_harmonics(encoding.degree, x)
    if encoding.otype == "TriangleWave":
        return triangle_wave(encoding.n_frequencies, x)
    raise ValueError(f"no parameter-free encoding {encoding.otype!r}")


def _one_blob(x: np.ndarray, n: int) -> np.ndarray:
    """Bin k of each dim holds the mass over [k/n, (k+1)/n) of a quartic kernel of radius 1/n
    centred on x, wrapped around the unit interval: C(b) = Q(b − x) + Q(b − x − 1) + Q(b − x + 1)
    (Q the kernel's CDF) at each bin's left boundary b, and the last bin's right value is
    C(0) + 1 (tiny-cuda-nn's kernel takes it from the first bin's lane), so the bins sum to 1."""
    left = np.arange(n, dtype=x.dtype) / x.dtype.type(n)  # k · 2^-log2(n): exact
    u = left[None, None, :] - x[:, :, None]
    one = x.dtype.type(1)
    cdf = _quartic_cdf(u, n) + _quartic_cdf(u - one, n) + _quartic_cdf(u + one, n)
    right = np.concatenate([cdf[..., 1:], cdf[..., :1] + one], axis=-1)
    return (right - cdf).reshape(x.shape[0], -1)


def _quartic_cdf(v: np.ndarray, inv_radius: int) -> np.ndarray:
    """CDF of the quartic kernel 15/16·(1 − u²)² (u = v / radius), clamped to [0, 1]; fmin/fmax
    like CUDA's fminf/fmaxf, so a NaN argument gives 1 as it does there."""
    t = v.dtype.type
    u = v * t(inv_radius)
    u2 = u * u
    u4 = u2 * u2
    poly = t(15 / 16) * u * (t(1) - t(2 / 3) * u2 + t(1 / 5) * u4) + t(0.5)
    return np.fmax(t(0), np.fmin(t(1), poly))


# -- optimizers ----------------------------------------------------------------------------
def step_base_rate(opt: OptimizerSpec, step: int) -> float:
    """The base rate of optimizer step ``step`` (from 1) times ExponentialDecay's factor after
    ``step − 1`` completed steps (tcnn sets it on the nested optimizer before the step), without
    Adam's bias correction (a grid table's entries apply their own, ``grid_adam_update``)."""
    return opt.learning_rate if opt.decay is None else opt.learning_rate * opt.decay.factor(step - 1)


def step_learning_rate(opt: OptimizerSpec, step: int) -> float:
    """The learning rate of optimizer step ``step`` (from 1), folded into one scalar as every
    backend's kernel takes it: ``step_base_rate``, then for Adam its bias correction
    sqrt(1 − β2^t)/(1 − β1^t)."""
    lr = step_base_rate(opt, step)
    if opt.otype == "Adam":
        return lr * float(np.sqrt(1 - opt.beta2 ** step)) / (1 - opt.beta1 ** step)
    return lr


def optimizer_update(opt: OptimizerSpec, step: int, w: np.ndarray, g: np.ndarray,
                     slots: dict[str, np.ndarray]) -> None:
    """One in-place update of ``w`` (fp32 master) and its Adam/SGD slots; ``step`` counts from 1.
    An EMA slot is not touched here: ``ema_update`` follows, on the weights the forward uses."""
    if opt.l2_reg:
        g = g + opt.l2_reg * w
    lr_t = step_learning_rate(opt, step)
    if opt.otype == "Adam":
        m, v = slots["m"], slots["v"]
        m *= opt.beta1
        m += (1 - opt.beta1) * g
        v *= opt.beta2
        v += (1 - opt.beta2) * (g * g)
        w -= (lr_t * m / (np.sqrt(v) + opt.epsilon)).astype(w.dtype)
    else:
        vel = slots["velocity"]
        vel *= opt.momentum
        vel += g
        w -= (lr_t * vel).astype(w.dtype)


def grid_steps_from_state(state: Mapping[str, Any], name: str, shape: tuple[int, int], step_count: int) -> np.ndarray:
    """Adam's per-value step counts of grid table ``name`` (uint32, ``shape``) from an optimizer
    state: its ``steps.{name}`` where it has them in that shape, else (a state written by a
    backend that keeps none) the optimizer's ``step_count`` for every value Adam has moved
    (``v.{name}`` ≠ 0) and 0 elsewhere."""
    given = state.get(f"steps.{name}")
    if given is not None and np.shape(given) == tuple(shape):
        return np.asarray(given, dtype=np.uint32)
    return np.where(np.asarray(state[f"v.{name}"]) != 0, step_count, 0).astype(np.uint32)


def grid_adam_update(opt: OptimizerSpec, step: int, w: np.ndarray, g: np.ndarray, slots: dict[str, np.ndarray],
                     entry_steps: np.ndarray) -> None:
    """Adam on a grid table as tcnn steps its non-matrix parameters (optimizers/adam.h, defaults):
    no ``l2_reg`` (``non_matrix_l2_reg`` 0), an entry whose gradient is exactly 0 (no sample read
    it) is skipped (``skip_zero_grad_non_matrix_params``: its moments and step count stay), and
    the bias correction uses each entry's own step count (``param_steps``). ``step`` (from 1) is
    the optimizer's, for the ExponentialDecay factor; in place on ``w``, the slots and
    ``entry_steps``."""
    touched = g != 0
    lr = step_base_rate(opt, step)
    gt = g[touched]
    m = slots["m"][touched] * opt.beta1 + (1 - opt.beta1) * gt
    v = slots["v"][touched] * opt.beta2 + (1 - opt.beta2) * (gt * gt)
    slots["m"][touched], slots["v"][touched] = m, v
    entry_steps[touched] += 1
    t = entry_steps[touched].astype(np.float64)
    lr_t = (lr * np.sqrt(1 - opt.beta2 ** t) / (1 - opt.beta1 ** t)).astype(w.dtype)
    w[touched] -= lr_t * m / (np.sqrt(v) + w.dtype.type(opt.epsilon))


def ema_update(ema: EmaSpec, step: int, weights: np.ndarray, average: np.ndarray) -> None:
    """tcnn's debiased EMA after optimizer step ``step`` (from 1), in place on ``average``:
    (average·d·(1 − d^(step−1)) + weights·(1 − d)) / (1 − d^step). At step 1 the old average's
    weight is 0, so whatever it held before the first step never shows."""
    keep, take = ema_factors(ema, step)
    average *= average.dtype.type(keep)
    average += (weights * take).astype(average.dtype)


def ema_factors(ema: EmaSpec, step: int) -> tuple[float, float]:
    """(keep, take) of EMA step ``step`` (from 1), in float64: ``average·keep + weights·take``
    is ``ema_update``'s debiased average; the device backends read these from a per-step table."""
    d = ema.decay
    new = 1 / (1 - d ** step)
    return d * (1 - d ** (step - 1)) * new, (1 - d) * new


def ema_factor_table(ema: EmaSpec, first_step: int, steps: int) -> np.ndarray:
    """``ema_factors`` of steps ``first_step`` .. ``first_step + steps − 1`` as float32 (steps × 2):
    keep, take per step, the table a device training loop indexes by its step counter."""
    return np.array([ema_factors(ema, first_step + k) for k in range(steps)], np.float32).reshape(steps, 2)


def round_to(dtype_name: str, a: np.ndarray) -> np.ndarray:
    """Round an fp32/fp64 array to fp16 or bf16 and back (the kernels' rounding points)."""
    if dtype_name == "fp16":
        return a.astype(np.float16).astype(a.dtype)
    if dtype_name == "bf16":
        a32 = np.ascontiguousarray(a, dtype=np.float32)
        bits = a32.view(np.uint32)
        # round to nearest even on the top 16 bits
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
        return rounded.view(np.float32).astype(a.dtype)
    return a


# -- the order of a dataset's rows in each epoch ---------------------------------------------
# A training job visits every row once per epoch in a pseudo-random order drawn on the device:
# position p of epoch e is row ``epoch_row(seed, e, rows, p)``, a keyed bijection of [0, rows)
# (a four-round Feistel network on the next power of four, cycle-walked into range). Nothing is
# stored or sorted, so a new epoch costs nothing and every backend (CUDA, GLSL, WGSL, NumPy)
# computes the same rows from 32-bit integer arithmetic alone. The kernels copy this definition.
FEISTEL_ROUNDS = 4
_M32 = np.uint64(0xFFFFFFFF)


def mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash with full avalanche (lowbias32), on uint64 arrays holding uint32s."""
    x = np.asarray(x, dtype=np.uint64) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    x ^= x >> np.uint64(16)
    return x


def epoch_half_bits(rows: int) -> int:
    """Bits of each Feistel half: the smallest h with 4**h >= rows (at least 1)."""
    h = 1
    while (1 << (2 * h)) < rows:
        h += 1
    return h


def epoch_keys(seed: int, epoch: int) -> list[int]:
    """The round keys of one epoch's permutation."""
    return [int(mix32(np.uint64((seed ^ int(mix32(np.uint64((epoch * FEISTEL_ROUNDS + r + 1) & 0xFFFFFFFF))))
                                & 0xFFFFFFFF))) for r in range(FEISTEL_ROUNDS)]


def epoch_rows(seed: int, epoch: int, rows: int, start: int, count: int) -> np.ndarray:
    """Rows at positions [start, start + count) of epoch ``epoch``'s order (int64)."""
    if not 0 < rows < 2**31 or not 0 <= start <= start + count <= rows:
        raise ValueError(f"positions {start}..{start + count} of {rows} rows")
    h = np.uint64(epoch_half_bits(rows))
    mask = np.uint64((1 << int(h)) - 1)
    keys = [np.uint64(k) for k in epoch_keys(seed & 0xFFFFFFFF, epoch)]

    def permute(i: np.ndarray) -> np.ndarray:
        left, right = i >> h, i & mask
        for k in keys:
            left, right = right, left ^ (mix32(right ^ k) & mask)
        return (left << h) | right

    out = permute(np.arange(start, start + count, dtype=np.uint64))
    while True:  # cycle walking: a value outside [0, rows) is permuted again until it lands inside
        outside = out >= np.uint64(rows)
        if not outside.any():
            return out.astype(np.int64)
        out[outside] = permute(out[outside])


def batches_per_epoch(rows: int, batch: int) -> int:
    """Full batches in one epoch (the remainder rows wait for a later epoch's order)."""
    return rows // batch


@dataclass
class EpochPosition:
    """Where a run over a dataset stands: the order's seed, the epoch, and the position of the
    next batch in that epoch's order (``numerics.epoch_rows``). A batch never straddles two
    epochs: the rows left over at an epoch's end wait for a later epoch."""

    seed: int
    epoch: int = 0
    cursor: int = 0

    def advance(self, rows: int, batch: int, steps: int = 1) -> None:
        per_epoch = batches_per_epoch(rows, batch)
        done = self.cursor // batch + steps
        self.epoch += done // per_epoch
        self.cursor = (done % per_epoch) * batch


def check_epoch_run(data: Dataset, batch: int, steps: int) -> None:
    """Refuse a run of ``steps`` batches of ``batch`` rows that ``data`` cannot hold."""
    if steps < 1:
        raise InvalidInput(f"steps must be at least 1; got {steps}")
    if not 1 <= batch <= data.rows:
        raise InvalidInput(f"batch_size {batch} must be from 1 to the dataset's {data.rows} rows")
