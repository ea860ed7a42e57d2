"""Model specification: tiny-cuda-nn's JSON format, parsed and validated.

``MLPSpec.from_json(doc)`` accepts the documents tiny-cuda-nn's samples use
(``n_input_dims``/``n_output_dims`` at the top or given separately, ``network``, ``encoding``,
``loss``, ``optimizer``) plus mmad's ``precision`` and ``seed``. Every invalid field raises
:class:`~mmad.errors.SpecError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import math
import reprlib
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import numpy as np

from mmad.errors import SpecError

MLP_OTYPES = ("FullyFusedMLP", "CutlassMLP", "MLP", "MegakernelMLP")
ACTIVATIONS = (
    "None", "ReLU", "LeakyReLU", "Sigmoid", "Tanh", "SiLU", "Softplus", "Squareplus",
    "Exponential", "Sine",
)
LOSSES = ("L2", "L1", "RelativeL2", "RelativeL1", "RelativeL2Luminance", "MAPE", "SMAPE", "Huber")
# the integer each activation and loss has inside the kernels: its index above; CUDA and GLSL
# sources name them by these macros (prepended by ``kernel_code_defines``, never written by hand)
ACTIVATION_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}
LOSS_CODES = {name: i for i, name in enumerate(LOSSES)}
_ACTIVATION_MACROS = {"None": "ACT_NONE", "ReLU": "ACT_RELU", "LeakyReLU": "ACT_LEAKY", "Sigmoid": "ACT_SIGMOID",
                      "Tanh": "ACT_TANH", "SiLU": "ACT_SILU", "Softplus": "ACT_SOFTPLUS",
                      "Squareplus": "ACT_SQUAREPLUS", "Exponential": "ACT_EXP", "Sine": "ACT_SINE"}
_LOSS_MACROS = {"L2": "LOSS_L2", "L1": "LOSS_L1", "RelativeL2": "LOSS_REL_L2", "RelativeL1": "LOSS_REL_L1",
                "RelativeL2Luminance": "LOSS_REL_L2_LUM", "MAPE": "LOSS_MAPE", "SMAPE": "LOSS_SMAPE",
                "Huber": "LOSS_HUBER"}


def kernel_code_defines() -> str:
    """``#define ACT_RELU 1`` ... and ``#define LOSS_L2 0`` ...: the activation and loss codes as
    the CUDA and GLSL kernels name them, from ``ACTIVATION_CODES`` / ``LOSS_CODES``."""
    lines = [f"#define {_ACTIVATION_MACROS[n]} {c}" for n, c in ACTIVATION_CODES.items()]
    lines += [f"#define {_LOSS_MACROS[n]} {c}" for n, c in LOSS_CODES.items()]
    return "\n".join(lines) + "\n"
OPTIMIZERS = ("Adam", "SGD")
# tcnn's wrappers around one of OPTIMIZERS (``nested``); see ExponentialDecaySpec and EmaSpec
OPTIMIZER_WRAPPERS = ("ExponentialDecay", "EMA")
ENCODINGS = ("Identity", "Frequency", "OneBlob", "Composite", "HashGrid", "DenseGrid", "TiledGrid", "Grid",
             "SphericalHarmonics", "TriangleWave")
# the grid family (tcnn's encodings/grid.h): one otype per ``type``; "Grid" is tcnn's generic name
GRID_OTYPES = {"Hash": "HashGrid", "Dense": "DenseGrid", "Tiled": "TiledGrid"}
GRID_TYPES = tuple(GRID_OTYPES)
GRID_INTERPOLATIONS = ("Nearest", "Linear", "Smoothstep")
GRID_FEATURES_PER_LEVEL = (1, 2, 4, 8)  # the ones tcnn compiles
GRID_DIMS = (2, 3, 4)  # tcnn's CoherentPrime grids: 1-D and 5-D+ are commented out there
MAX_GRID_LEVELS = 128  # tcnn's MAX_N_LEVELS
MAX_GRID_VALUES = 1 << 28  # all grids' table values together: 1 GiB of fp32 masters (Adam triples it)
MAX_SH_DEGREE = 8
PRECISIONS = ("fp16", "bf16", "fp32")
MIN_WIDTH, MAX_WIDTH, WIDTH_STEP = 16, 256, 16
MAX_HIDDEN_LAYERS = 16
MAX_IO_DIMS = 4096


def _case_map(allowed: tuple[str, ...]) -> dict[str, str]:
    return {a.lower(): a for a in allowed}


def _pick(where: str, value: Any, allowed: tuple[str, ...]) -> str:
    """Match ``value`` against ``allowed`` case-insensitively (tiny-cuda-nn does too)."""
    if not isinstance(value, str):
        raise SpecError(where, f"must be a string, one of {', '.join(allowed)}; got {_short(value)}")
    found = _case_map(allowed).get(value.lower())
    if found is None:
        raise SpecError(where, f"unknown value {_short(value)}; allowed: {', '.join(allowed)}")
    return found


def _int(where: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SpecError(where, f"must be an integer from {lo} to {hi}; got {_short(value)}")
    if not lo <= value <= hi:
        raise SpecError(where, f"must be from {lo} to {hi}; got {value}")
    return value


def _float(where: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(where, f"must be a number; got {_short(value)}")
    value = float(value)
    if not math.isfinite(value):
        raise SpecError(where, f"must be finite; got {value}")
    if value < lo or value > hi or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise SpecError(where, f"must be in {bracket}{lo}, {hi}]; got {value}")
    return value


def _check_keys(where: str, doc: Mapping[str, Any], allowed: set[str]) -> None:
    for key, value in doc.items():
        if key not in allowed:
            raise SpecError(
                f"{where}.{key}" if where else key,
                f"unknown field (value {_short(value)}); allowed here: {', '.join(sorted(allowed))}",
            )


def _mapping(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SpecError(where, f"must be a JSON object; got {type(value).__name__} {_short(value)}")
    return value


# reprlib stops at a depth and a length: repr() of a value nested ~1,000 deep raised
# RecursionError (a 500 instead of this error), and of a large one cost its whole size
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist, _SHORT.maxstring, _SHORT.maxother = 3, 4, 6, 40, 40


def _short(value: Any) -> str:
    text = _SHORT.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class GridLevel:
    """One level of a grid encoding as tiny-cuda-nn lays it out (encodings/grid.h):
    ``scale`` (float32 value) = 2^(level·log2(per_level_scale))·base_resolution − 1, the
    ``resolution`` ceil(scale) + 1 vertices per dim, and the level's rows of the table:
    ``offset`` and ``entries`` (each row holds ``n_features_per_level`` values)."""

    scale: float
    resolution: int
    offset: int
    entries: int


_U32 = 1 << 32


def _f32(value: float) -> float:
    return float(np.float32(value))


def grid_level_scale(level: int, per_level_scale: float, base_resolution: int) -> float:
    """tcnn's ``grid_scale`` in float32 arithmetic: exp2f(level · log2f(per_level_scale)) ·
    base_resolution − 1. log2 and exp2 are rounded correctly here (CUDA's exp2f may be 2 ulp off)."""
    f32 = np.float32
    log2_scale = f32(math.log2(float(f32(per_level_scale))))
    exponent = f32(level) * log2_scale
    return float(f32(f32(2.0 ** float(exponent)) * f32(base_resolution)) - f32(1.0))


@dataclass(frozen=True)
class EncodingSpec:
    """One encoding, with tiny-cuda-nn's parameters and defaults.

    A ``Composite`` holds ``nested`` parts, each reading ``n_dims_to_encode`` input dims from
    ``dims_to_encode_begin`` (both resolved by ``parse``; nested Composites are flattened into
    their parent), their outputs concatenated in order. Input dims no part reads are dropped,
    as tiny-cuda-nn drops them.

    The grid family (``HashGrid``, ``DenseGrid``, ``TiledGrid``) holds a trainable table: the
    model parameter ``grid{k}`` (k counts the grid parts in output order) of shape
    (Σ levels' ``entries``, ``n_features_per_level``), see :meth:`grid_levels`.
    """

    otype: str = "Identity"
    n_frequencies: int = 12
    n_bins: int = 16
    n_dims_to_encode: int | None = None
    nested: tuple["EncodingSpec", ...] = ()
    scale: float = 1.0
    offset: float = 0.0
    dims_to_encode_begin: int | None = None
    n_levels: int = 16
    n_features_per_level: int = 2
    log2_hashmap_size: int = 19
    base_resolution: int = 16
    per_level_scale: float = 2.0
    interpolation: str = "Linear"
    degree: int = 4

    @property
    def passthrough(self) -> bool:
        """True when encoding leaves the inputs as they are (Identity, scale 1, offset 0)."""
        return self.otype == "Identity" and self.scale == 1.0 and self.offset == 0.0

    @property
    def is_grid(self) -> bool:
        return self.otype in GRID_OTYPES.values()

    @property
    def grid_type(self) -> str:
        """"Hash", "Dense" or "Tiled" (grid encodings only)."""
        return next(t for t, o in GRID_OTYPES.items() if o == self.otype)

    def grid_levels(self, n_dims: int) -> tuple[GridLevel, ...]:
        """The levels of a grid encoding of ``n_dims`` dims, tcnn's ``GridEncodingTemplated``
        constructor: a level holds min(resolution^dims, 2^31 − 1) rows rounded up to a multiple
        of 8, capped at 2^log2_hashmap_size rows (HashGrid) or base_resolution^dims rows
        (TiledGrid, not rounded); DenseGrid keeps them all."""
        levels, offset = [], 0
        for level in range(self.n_levels):
            scale = grid_level_scale(level, self.per_level_scale, self.base_resolution)
            resolution = math.ceil(scale) + 1
            dense = 2**31 - 1 if float(resolution) ** n_dims > 2**31 - 1 else resolution**n_dims
            entries = (dense + 7) // 8 * 8
            if self.otype == "TiledGrid":
                entries = min(entries, self.base_resolution**n_dims)
            elif self.otype == "HashGrid":
                entries = min(entries, 1 << self.log2_hashmap_size)
            levels.append(GridLevel(scale, resolution, offset, entries))
            offset += entries
        return tuple(levels)

    def grid_parts(self, n_input_dims: int) -> list[tuple["EncodingSpec", int, int]]:
        """(part, first input dim, input dims) of every grid part, in output order: part k's
        table is the parameter ``grid{k}``."""
        return [p for p in self.parts(n_input_dims) if p[0].is_grid]

    def parts(self, n_input_dims: int) -> list[tuple["EncodingSpec", int, int]]:
        """(part, first input dim, input dims) of every part in output order; an encoding that is
        not a Composite is its own only part, reading every input dim."""
        if self.otype != "Composite":
            return [(self, 0, n_input_dims)]
        out, begin = [], 0
        for part in self.nested:
            if part.dims_to_encode_begin is not None:
                begin = part.dims_to_encode_begin
            dims = part.n_dims_to_encode if part.n_dims_to_encode is not None else n_input_dims - begin
            out.append((part, begin, dims))
            begin += dims
        return out

    def n_output_dims(self, n_input_dims: int) -> int:
        if self.otype == "Identity":
            return n_input_dims
        if self.otype == "Frequency":
            return n_input_dims * self.n_frequencies * 2
        if self.otype == "OneBlob":
            return n_input_dims * self.n_bins
        if self.is_grid:
            return self.n_levels * self.n_features_per_level
        if self.otype == "SphericalHarmonics":
            return self.degree * self.degree
        if self.otype == "TriangleWave":
            return n_input_dims * self.n_frequencies
        return sum(part.n_output_dims(dims) for part, _, dims in self.parts(n_input_dims))

    @staticmethod
    def parse(where: str, doc: Any, n_input_dims: int, *, nested: bool = False) -> "EncodingSpec":
        """``doc`` encoding ``n_input_dims`` dims. tiny-cuda-nn's default ``otype`` is OneBlob; a
        nested part's ``n_dims_to_encode``/``dims_to_encode_begin`` are read by its Composite."""
        doc = _mapping(where, doc)
        otype = _pick(f"{where}.otype", doc.get("otype", "OneBlob"), ENCODINGS)
        common = {"otype", "n_dims_to_encode", "dims_to_encode_begin"} if nested else {"otype"}
        if otype == "Identity":
            _check_keys(where, doc, common | {"scale", "offset"})
            scale = _float(f"{where}.scale", doc.get("scale", 1.0), -math.inf, math.inf)
            offset = _float(f"{where}.offset", doc.get("offset", 0.0), -math.inf, math.inf)
            return EncodingSpec("Identity", scale=scale, offset=offset)
        if otype == "Frequency":
            _check_keys(where, doc, common | {"n_frequencies"})
            n = _int(f"{where}.n_frequencies", doc.get("n_frequencies", 12), 1, 24)
            return EncodingSpec("Frequency", n_frequencies=n)
        if otype == "OneBlob":
            _check_keys(where, doc, common | {"n_bins"})
            n = _int(f"{where}.n_bins", doc.get("n_bins", 16), 1, 256)
            if n & (n - 1):  # tiny-cuda-nn's kernel puts a power-of-two run of bins on adjacent lanes
                raise SpecError(f"{where}.n_bins", f"must be a power of two (tiny-cuda-nn requires it); got {n}")
            return EncodingSpec("OneBlob", n_bins=n)
        if otype in GRID_OTYPES.values() or otype == "Grid":
            return EncodingSpec._parse_grid(where, otype, doc, n_input_dims, common)
        if otype == "SphericalHarmonics":
            _check_keys(where, doc, common | {"degree"})
            if n_input_dims != 3:
                raise SpecError(where, f"SphericalHarmonics encodes 3-D directions (3 input dims); it is given "
                                       f"{n_input_dims} (inside a Composite, set n_dims_to_encode to 3)")
            return EncodingSpec("SphericalHarmonics",
                                degree=_int(f"{where}.degree", doc.get("degree", 4), 1, MAX_SH_DEGREE))
        if otype == "TriangleWave":
            _check_keys(where, doc, common | {"n_frequencies"})
            n = _int(f"{where}.n_frequencies", doc.get("n_frequencies", 12), 1, 24)
            return EncodingSpec("TriangleWave", n_frequencies=n)
        return EncodingSpec._parse_composite(where, doc, n_input_dims, common)

    @staticmethod
    def _parse_grid(where: str, otype: str, doc: Mapping[str, Any], n_input_dims: int,
                    common: set[str]) -> "EncodingSpec":
        # tcnn's create_grid_encoding: the otype names the default ``type`` (Grid and HashGrid:
        # Hash), ``n_features`` (or ``n_grid_features``) may replace ``n_levels``, and DenseGrid's
        # default per_level_scale reaches 256 vertices at the last level
        _check_keys(where, doc, common | {
            "type", "n_levels", "n_features", "n_grid_features", "n_features_per_level", "log2_hashmap_size",
            "base_resolution", "per_level_scale", "interpolation", "hash", "stochastic_interpolation",
            "fixed_point_pos"})
        if n_input_dims not in GRID_DIMS:
            raise SpecError(where, f"a {otype} encodes 2, 3 or 4 input dims (as tiny-cuda-nn's); it is given "
                                   f"{n_input_dims} (inside a Composite, set n_dims_to_encode)")
        default_type = {"DenseGrid": "Dense", "TiledGrid": "Tiled"}.get(otype, "Hash")
        grid_type = _pick(f"{where}.type", doc.get("type", default_type), GRID_TYPES)
        _pick(f"{where}.hash", doc.get("hash", "CoherentPrime"), ("CoherentPrime",))
        for flag, meaning in (("stochastic_interpolation", "stochastic interpolation"),
                              ("fixed_point_pos", "fixed-point positions")):
            value = doc.get(flag, False)
            if not isinstance(value, bool):
                raise SpecError(f"{where}.{flag}", f"must be true or false; got {_short(value)}")
            if value:
                raise SpecError(f"{where}.{flag}", f"{meaning} are not supported; use false")
        per_level = doc.get("n_features_per_level", 2)
        if isinstance(per_level, bool) or per_level not in GRID_FEATURES_PER_LEVEL:
            raise SpecError(f"{where}.n_features_per_level", f"must be 1, 2, 4 or 8; got {_short(per_level)}")
        per_level = int(per_level)
        features_key = next((k for k in ("n_features", "n_grid_features") if k in doc), None)
        if features_key is not None:
            if "n_levels" in doc:
                raise SpecError(f"{where}.{features_key}", "may not be given with n_levels (one determines the other)")
            n_features = _int(f"{where}.{features_key}", doc[features_key], per_level, per_level * MAX_GRID_LEVELS)
            if n_features % per_level:
                raise SpecError(f"{where}.{features_key}",
                                f"must be a multiple of n_features_per_level ({per_level}); got {n_features}")
            n_levels = n_features // per_level
        else:
            n_levels = _int(f"{where}.n_levels", doc.get("n_levels", 16), 1, MAX_GRID_LEVELS)
        base = _int(f"{where}.base_resolution", doc.get("base_resolution", 16), 1, 1 << 16)
        if "per_level_scale" in doc:
            per_level_scale = _float(f"{where}.per_level_scale", doc["per_level_scale"], 0.0, 1e4, lo_open=True)
        elif grid_type == "Dense":
            if n_levels == 1:
                raise SpecError(f"{where}.per_level_scale", "is required for a DenseGrid of one level "
                                                            "(tiny-cuda-nn's default divides by n_levels − 1)")
            per_level_scale = float(np.exp(np.log(np.float32(256.0) / np.float32(base)) / np.float32(n_levels - 1)))
        else:
            per_level_scale = 2.0
        log2_size = _int(f"{where}.log2_hashmap_size", doc.get("log2_hashmap_size", 19), 1, 31)
        interpolation = _pick(f"{where}.interpolation", doc.get("interpolation", "Linear"), GRID_INTERPOLATIONS)
        spec = EncodingSpec(GRID_OTYPES[grid_type], n_levels=n_levels, n_features_per_level=per_level,
                            # the table size of a Dense or Tiled grid does not depend on it
                            log2_hashmap_size=log2_size if grid_type == "Hash" else 19,
                            base_resolution=base, per_level_scale=_f32(per_level_scale),
                            interpolation=interpolation)
        if grid_type == "Tiled" and base**n_input_dims >= 2**31:
            raise SpecError(f"{where}.base_resolution", f"{base}^{n_input_dims} tiles do not fit tiny-cuda-nn's "
                                                        "32-bit indices; use a smaller base_resolution")
        for level, info in enumerate(spec.grid_levels(n_input_dims)):
            if not 0.0 <= info.scale < 2**31:
                raise SpecError(f"{where}.per_level_scale", f"gives level {level} a scale of {info.scale:g} vertices; "
                                                            "every level's must be from 0 to 2^31")
        return spec

    @staticmethod
    def _parse_composite(where: str, doc: Mapping[str, Any], n_input_dims: int,
                         common: set[str]) -> "EncodingSpec":
        # tiny-cuda-nn's rules (CompositeEncoding): at most one part may leave n_dims_to_encode
        # out and gets the dims the others leave; dims_to_encode_begin moves a part's first input
        # dim (then no part may leave n_dims_to_encode out); parts of 0 dims are skipped
        _check_keys(where, doc, common | {"nested", "reduction"})
        if "reduction" in doc:
            _pick(f"{where}.reduction", doc["reduction"], ("Concatenation",))
        parts_doc = doc.get("nested")
        if not isinstance(parts_doc, list) or not parts_doc:
            raise SpecError(f"{where}.nested", f"must be a non-empty list of encodings; got {_short(parts_doc)}")
        docs = [_mapping(f"{where}.nested[{i}]", d) for i, d in enumerate(parts_doc)]
        given = [_int(f"{where}.nested[{i}].n_dims_to_encode", d["n_dims_to_encode"], 0, n_input_dims)
                 if "n_dims_to_encode" in d else None for i, d in enumerate(docs)]
        any_begin = any("dims_to_encode_begin" in d for d in docs)
        total = sum(g for g in given if g is not None)
        if not any_begin and total > n_input_dims:
            raise SpecError(f"{where}.nested", f"the nested encodings encode {total} dims; the input has {n_input_dims}")
        unspecified = None if any_begin else n_input_dims - total
        parts: list[EncodingSpec] = []
        begin = 0
        for i, (part_doc, dims) in enumerate(zip(docs, given)):
            here = f"{where}.nested[{i}]"
            if dims is not None:
                if "dims_to_encode_begin" in part_doc:
                    begin = _int(f"{here}.dims_to_encode_begin", part_doc["dims_to_encode_begin"], 0, n_input_dims)
            else:
                if "dims_to_encode_begin" in part_doc:
                    raise SpecError(f"{here}.dims_to_encode_begin", "needs n_dims_to_encode beside it")
                if unspecified is None:
                    raise SpecError(f"{here}.n_dims_to_encode",
                                    "may be left out in only one nested encoding, and in none when "
                                    "any gives dims_to_encode_begin")
                dims, unspecified = unspecified, None
            if begin + dims > n_input_dims:
                raise SpecError(f"{here}.n_dims_to_encode",
                                f"dims {begin} to {begin + dims - 1} do not exist; the input has {n_input_dims}")
            if dims:
                part = EncodingSpec.parse(here, part_doc, dims, nested=True)
                if part.otype == "Composite":
                    parts += [replace(p, dims_to_encode_begin=begin + b, n_dims_to_encode=d)
                              for p, b, d in part.parts(dims)]
                else:
                    parts.append(replace(part, dims_to_encode_begin=begin, n_dims_to_encode=dims))
            begin += dims
        if not parts:
            raise SpecError(f"{where}.nested", "the nested encodings encode no input dims")
        return EncodingSpec("Composite", nested=tuple(parts))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"otype": self.otype}
        if self.otype == "Frequency":
            out["n_frequencies"] = self.n_frequencies
        if self.otype == "OneBlob":
            out["n_bins"] = self.n_bins
        if self.otype == "Identity" and not self.passthrough:
            out["scale"], out["offset"] = self.scale, self.offset
        if self.is_grid:
            out.update(n_levels=self.n_levels, n_features_per_level=self.n_features_per_level,
                       base_resolution=self.base_resolution, per_level_scale=self.per_level_scale,
                       interpolation=self.interpolation)
            if self.otype == "HashGrid":
                out["log2_hashmap_size"] = self.log2_hashmap_size
        if self.otype == "SphericalHarmonics":
            out["degree"] = self.degree
        if self.otype == "TriangleWave":
            out["n_frequencies"] = self.n_frequencies
        if self.otype == "Composite":
            out["nested"], begin = [], 0
            for part in self.nested:
                doc = part.to_json()
                if part.n_dims_to_encode is not None:
                    doc["n_dims_to_encode"] = part.n_dims_to_encode
                if part.dims_to_encode_begin is not None and part.dims_to_encode_begin != begin:
                    doc["dims_to_encode_begin"] = part.dims_to_encode_begin
                    begin = part.dims_to_encode_begin
                begin += part.n_dims_to_encode or 0
                out["nested"].append(doc)
        return out


@dataclass(frozen=True)
class ExponentialDecaySpec:
    """tiny-cuda-nn's ``ExponentialDecay`` wrapper (optimizers/exponential_decay.h), its fields
    and defaults: before the optimizer step that follows ``k`` completed steps, the learning
    rate is multiplied by ``decay_base`` when ``decay_start <= k <= decay_end`` and
    ``(k - decay_start) % decay_interval == 0``; the factors accumulate."""

    decay_base: float = 0.1
    decay_start: int = 10000
    decay_interval: int = 10000
    decay_end: int = 10000000

    def factor(self, completed_steps: int) -> float:
        """The learning-rate factor of the step after ``completed_steps`` completed steps."""
        last = min(completed_steps, self.decay_end)
        if last < self.decay_start:
            return 1.0
        return self.decay_base ** ((last - self.decay_start) // self.decay_interval + 1)

    def to_json(self) -> dict[str, Any]:
        return {"decay_base": self.decay_base, "decay_start": self.decay_start,
                "decay_interval": self.decay_interval, "decay_end": self.decay_end}


@dataclass(frozen=True)
class EmaSpec:
    """tiny-cuda-nn's ``EMA`` wrapper (optimizers/ema.h): after each step it keeps a debiased
    exponential moving average of the weights, ``ema_t = (ema_{t-1}·d·(1 − d^(t−1)) + w_t·(1 − d))
    / (1 − d^t)``, and inference uses the average (tcnn's ``custom_weights``) while training
    goes on with the raw weights. ``full_precision`` false keeps the average in the network's
    precision (rounded every step), true in fp32."""

    decay: float = 0.99
    full_precision: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"decay": self.decay, "full_precision": self.full_precision}


_U32_MAX = 2**32 - 1  # tcnn keeps the ExponentialDecay step fields in uint32


@dataclass(frozen=True)
class OptimizerSpec:
    """Adam or SGD (``otype``, with their fields), optionally wrapped in tiny-cuda-nn's
    ``ExponentialDecay`` (``decay``) and/or ``EMA`` (``ema``). The two wrappers commute (one
    scales the learning rate, the other only reads the weights after the step), so either
    nesting order parses to the same spec; ``to_json`` writes EMA outermost."""

    otype: str = "Adam"
    learning_rate: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.99
    epsilon: float = 1e-15
    l2_reg: float = 0.0
    momentum: float = 0.0
    decay: ExponentialDecaySpec | None = None
    ema: EmaSpec | None = None

    @staticmethod
    def parse(where: str, doc: Any) -> "OptimizerSpec":
        doc = _mapping(where, doc)
        otype = _pick(f"{where}.otype", doc.get("otype", "Adam"), OPTIMIZERS + OPTIMIZER_WRAPPERS)
        if otype in OPTIMIZER_WRAPPERS:
            return OptimizerSpec._parse_wrapper(where, otype, doc)
        lr = _float(f"{where}.learning_rate", doc.get("learning_rate", 1e-3), 0.0, 10.0, lo_open=True)
        if otype == "Adam":
            _check_keys(where, doc, {"otype", "learning_rate", "beta1", "beta2", "epsilon", "l2_reg",
                                     "relative_decay", "absolute_decay", "adabound"})
            for extra in ("relative_decay", "absolute_decay"):
                if doc.get(extra, 0.0) != 0.0:
                    raise SpecError(f"{where}.{extra}", "only 0 is supported")
            if doc.get("adabound", False):
                raise SpecError(f"{where}.adabound", "AdaBound is not supported; use false")
            return OptimizerSpec(
                "Adam", lr,
                beta1=_float(f"{where}.beta1", doc.get("beta1", 0.9), 0.0, 0.999999),
                beta2=_float(f"{where}.beta2", doc.get("beta2", 0.99), 0.0, 0.999999999),
                epsilon=_float(f"{where}.epsilon", doc.get("epsilon", 1e-15), 0.0, 1.0),
                l2_reg=_float(f"{where}.l2_reg", doc.get("l2_reg", 0.0), 0.0, 1.0),
            )
        _check_keys(where, doc, {"otype", "learning_rate", "momentum", "l2_reg"})
        return OptimizerSpec(
            "SGD", lr,
            momentum=_float(f"{where}.momentum", doc.get("momentum", 0.0), 0.0, 0.999999),
            l2_reg=_float(f"{where}.l2_reg", doc.get("l2_reg", 0.0), 0.0, 1.0),
        )

    @staticmethod
    def _parse_wrapper(where: str, otype: str, doc: Mapping[str, Any]) -> "OptimizerSpec":
        # tcnn builds the nested optimizer from ``nested`` (default {}: an Adam with defaults)
        inner = OptimizerSpec.parse(f"{where}.nested", doc.get("nested", {}))
        if otype == "ExponentialDecay":
            _check_keys(where, doc, {"otype", "nested", "decay_base", "decay_start", "decay_interval", "decay_end"})
            if inner.decay is not None:
                raise SpecError(f"{where}.nested", "holds a second ExponentialDecay; nest at most one")
            decay = ExponentialDecaySpec(
                decay_base=_float(f"{where}.decay_base", doc.get("decay_base", 0.1), 0.0, 1.0, lo_open=True),
                decay_start=_int(f"{where}.decay_start", doc.get("decay_start", 10000), 0, _U32_MAX),
                decay_interval=_int(f"{where}.decay_interval", doc.get("decay_interval", 10000), 1, _U32_MAX),
                decay_end=_int(f"{where}.decay_end", doc.get("decay_end", 10000000), 0, _U32_MAX),
            )
            return replace(inner, decay=decay)
        _check_keys(where, doc, {"otype", "nested", "decay", "full_precision"})
        if inner.ema is not None:
            raise SpecError(f"{where}.nested", "holds a second EMA; nest at most one")
        full = doc.get("full_precision", False)
        if not isinstance(full, bool):
            raise SpecError(f"{where}.full_precision", f"must be true or false; got {_short(full)}")
        # decay 1 would divide by 1 − 1^t = 0 in tcnn's debiasing
        ema = EmaSpec(_float(f"{where}.decay", doc.get("decay", 0.99), 0.0, 0.999999999), full)
        return replace(inner, ema=ema)

    def to_json(self) -> dict[str, Any]:
        if self.otype == "Adam":
            out = {"otype": "Adam", "learning_rate": self.learning_rate, "beta1": self.beta1,
                   "beta2": self.beta2, "epsilon": self.epsilon, "l2_reg": self.l2_reg}
        else:
            out = {"otype": "SGD", "learning_rate": self.learning_rate, "momentum": self.momentum,
                   "l2_reg": self.l2_reg}
        if self.decay is not None:
            out = {"otype": "ExponentialDecay", "nested": out, **self.decay.to_json()}
        if self.ema is not None:
            out = {"otype": "EMA", "nested": out, **self.ema.to_json()}
        return out


@dataclass(frozen=True)
class MLPSpec:
    """A validated model. Widths are the user's; backends pad internally."""

    n_input_dims: int
    n_output_dims: int
    n_neurons: int = 64
    n_hidden_layers: int = 2
    activation: str = "ReLU"
    output_activation: str = "None"
    network_otype: str = "FullyFusedMLP"
    encoding: EncodingSpec = field(default_factory=EncodingSpec)
    loss: str = "L2"
    huber_delta: float = 1.0
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    precision: str = "fp16"
    loss_scale: float = 128.0
    seed: int = 1337

    # -- derived shapes -------------------------------------------------------------------
    @property
    def n_encoded_dims(self) -> int:
        return self.encoding.n_output_dims(self.n_input_dims)

    @property
    def layer_dims(self) -> list[tuple[int, int]]:
        """(fan_in, fan_out) of every layer, unpadded, input layer first."""
        dims = [self.n_encoded_dims] + [self.n_neurons] * self.n_hidden_layers + [self.n_output_dims]
        return list(zip(dims[:-1], dims[1:]))

    @property
    def grid_shapes(self) -> dict[str, tuple[int, int]]:
        """The trainable tables of the grid encodings: ``grid{k}`` → (rows, n_features_per_level),
        k counting the grid parts in output order; empty without one."""
        return {f"grid{k}": (sum(level.entries for level in part.grid_levels(dims)), part.n_features_per_level)
                for k, (part, _, dims) in enumerate(self.encoding.grid_parts(self.n_input_dims))}

    @property
    def n_params(self) -> int:
        return sum(i * o + o for i, o in self.layer_dims) + sum(r * f for r, f in self.grid_shapes.values())

    def flops_per_sample(self) -> int:
        """2 × Σ(in × out): multiply-adds of one forward pass."""
        return 2 * sum(i * o for i, o in self.layer_dims)

    # -- (de)serialisation ----------------------------------------------------------------
    @classmethod
    def from_json(cls, doc: Any, *, n_input_dims: int | None = None,
                  n_output_dims: int | None = None) -> "MLPSpec":
        if isinstance(doc, (str, bytes)):
            try:
                doc = json.loads(doc)
            except json.JSONDecodeError as exc:
                raise SpecError("spec", f"the model config is not valid JSON: {exc}") from exc
        doc = _mapping("spec", doc)
        _check_keys("", doc, {"n_input_dims", "n_output_dims", "network", "encoding", "loss",
                              "optimizer", "precision", "seed", "loss_scale"})
        n_in = doc.get("n_input_dims", n_input_dims)
        n_out = doc.get("n_output_dims", n_output_dims)
        if n_in is None:
            raise SpecError("n_input_dims", "is required (a positive integer)")
        if n_out is None:
            raise SpecError("n_output_dims", "is required (a positive integer)")
        n_in = _int("n_input_dims", n_in, 1, MAX_IO_DIMS)
        n_out = _int("n_output_dims", n_out, 1, MAX_IO_DIMS)

        net = _mapping("network", doc.get("network", {}))
        _check_keys("network", net, {"otype", "activation", "output_activation", "n_neurons",
                                      "n_hidden_layers", "feedback_alignment"})
        otype = _pick("network.otype", net.get("otype", "FullyFusedMLP"), MLP_OTYPES)
        width = _int("network.n_neurons", net.get("n_neurons", 64), MIN_WIDTH, MAX_WIDTH)
        if width % WIDTH_STEP:
            raise SpecError("network.n_neurons",
                            f"must be a multiple of {WIDTH_STEP} from {MIN_WIDTH} to {MAX_WIDTH}; got {width}")
        layers = _int("network.n_hidden_layers", net.get("n_hidden_layers", 2), 1, MAX_HIDDEN_LAYERS)
        act = _pick("network.activation", net.get("activation", "ReLU"), ACTIVATIONS)
        out_act = _pick("network.output_activation", net.get("output_activation", "None"), ACTIVATIONS)
        if net.get("feedback_alignment", False):
            raise SpecError("network.feedback_alignment", "is not supported; use false")

        encoding = EncodingSpec.parse("encoding", doc.get("encoding", {"otype": "Identity"}), n_in)
        if encoding.n_output_dims(n_in) > MAX_IO_DIMS:
            raise SpecError("encoding", f"encodes to {encoding.n_output_dims(n_in)} dims; at most {MAX_IO_DIMS}")
        grid_values = sum(part.n_features_per_level * sum(level.entries for level in part.grid_levels(dims))
                          for part, _, dims in encoding.grid_parts(n_in))
        if grid_values > MAX_GRID_VALUES:
            raise SpecError("encoding", f"its grid tables hold {grid_values:,} values; at most {MAX_GRID_VALUES:,} "
                                        "(lower log2_hashmap_size, n_levels or the finest resolution)")

        loss_doc = _mapping("loss", doc.get("loss", {"otype": "L2"}))
        _check_keys("loss", loss_doc, {"otype", "delta"})
        loss = _pick("loss.otype", loss_doc.get("otype", "L2"), LOSSES)
        delta = 1.0
        if "delta" in loss_doc:
            if loss != "Huber":
                raise SpecError("loss.delta", f"only applies to the Huber loss, not {loss} (got {_short(loss_doc['delta'])})")
            delta = _float("loss.delta", loss_doc["delta"], 0.0, 1e6, lo_open=True)

        optimizer = OptimizerSpec.parse("optimizer", doc.get("optimizer", {"otype": "Adam"}))
        precision = _pick("precision", doc.get("precision", "fp16"), PRECISIONS)
        seed = _int("seed", doc.get("seed", 1337), 0, 2**63 - 1)
        loss_scale = _float("loss_scale", doc.get("loss_scale", 128.0), 1.0, 65536.0)
        return cls(n_in, n_out, width, layers, act, out_act, otype, encoding, loss, delta,
                   optimizer, precision, loss_scale, seed)

    def to_json(self) -> dict[str, Any]:
        loss: dict[str, Any] = {"otype": self.loss}
        if self.loss == "Huber":
            loss["delta"] = self.huber_delta
        return {
            "n_input_dims": self.n_input_dims,
            "n_output_dims": self.n_output_dims,
            "network": {"otype": self.network_otype, "activation": self.activation,
                        "output_activation": self.output_activation, "n_neurons": self.n_neurons,
                        "n_hidden_layers": self.n_hidden_layers},
            "encoding": self.encoding.to_json(),
            "loss": loss,
            "optimizer": self.optimizer.to_json(),
            "precision": self.precision,
            "loss_scale": self.loss_scale,
            "seed": self.seed,
        }

    def content_hash(self) -> str:
        """Stable hash of everything that changes compiled kernels or results."""
        blob = json.dumps(self.to_json(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def replace(self, **changes: Any) -> "MLPSpec":
        """A re-validated copy with some fields changed (``n_neurons=128`` and so on)."""
        doc = self.to_json()
        for key, value in changes.items():
            if key in ("n_neurons", "n_hidden_layers", "activation", "output_activation"):
                doc["network"][key] = value
            elif key in ("n_input_dims", "n_output_dims", "precision", "seed", "loss_scale"):
                doc[key] = value
            elif key == "loss":
                doc["loss"] = {"otype": value}
            elif key in ("encoding", "optimizer"):
                doc[key] = value if isinstance(value, dict) else value.to_json()
            else:
                raise SpecError(key, "cannot be replaced")
        return MLPSpec.from_json(doc)


def bench_spec(name: str, **overrides: Any) -> MLPSpec:
    """The S/M/L/W models of docs/benchmarks.md (ReLU hidden, no output activation, fp16)."""
    shapes = {"S": (32, 64, 2, 16), "M": (64, 64, 4, 64), "L": (128, 128, 4, 128), "W": (256, 256, 4, 256)}
    if name not in shapes:
        raise SpecError("model", f"unknown benchmark model {name!r}; allowed: {', '.join(shapes)}")
    n_in, width, layers, n_out = shapes[name]
    doc = {"n_input_dims": n_in, "n_output_dims": n_out,
           "network": {"otype": "FullyFusedMLP", "activation": "ReLU", "output_activation": "None",
                       "n_neurons": width, "n_hidden_layers": layers},
           "loss": {"otype": "L2"},
           "optimizer": {"otype": "Adam", "learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.99,
                         "epsilon": 1e-15},
           "precision": "fp16", "seed": 1337}
    spec = MLPSpec.from_json(doc)
    return spec.replace(**overrides) if overrides else spec


__all__ = ["MLPSpec", "EncodingSpec", "GridLevel", "grid_level_scale", "GRID_OTYPES", "OptimizerSpec", "ExponentialDecaySpec", "EmaSpec", "OPTIMIZER_WRAPPERS", "bench_spec", "ACTIVATIONS", "LOSSES", "ACTIVATION_CODES", "LOSS_CODES", "kernel_code_defines",
           "OPTIMIZERS", "ENCODINGS", "PRECISIONS", "MLP_OTYPES"]
