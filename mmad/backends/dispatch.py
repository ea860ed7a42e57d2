"""Dispatch by measurement: compile each usable variant of a backend, time it on the model's own
shapes, keep the fastest that computes the right numbers, and remember the choice.

A backend calls :func:`dispatch` from ``compile(spec, variant=None)`` with its candidates (name →
a function compiling that variant). For each candidate, in the backend's order:

1. compile it (an exception: skipped, "failed to compile: ...");
2. on fresh random data (``ROWS`` rows, seeded per model): the forward in the backend's I/O
   type (fp16 in and out on cuda, the tiny-cuda-nn pipeline's own I/O) must be finite and within
   ``TOLERANCE[spec.precision]`` of the float64 cpu oracle on ``CHECK_ROWS`` of its rows (else
   skipped, "wrong result: ..."), and one training step's loss must be finite (else "wrong
   result");
3. time the forward and a training step (L2 on the model's loss, the spec's optimizer) through
   ``timer(fn, sync, calls)`` → seconds per call: the forward in the timer's own number of
   back-to-back calls a sample, training as one call of ``TRAIN_STEPS_PER_CALL`` steps a sample,
   whose losses come back once (any other exception in 2-3: "failed to run: ...").

The score of a measured variant is ``forward / best forward + train / best train`` (2.0: the
fastest at both): each phase counts by how far the variant is from the fastest at that phase,
so neither the forward (a few microseconds at 2^16 rows) nor the training step (several times
longer) drowns the other out. The lowest score wins; a tie goes to the earlier candidate. The
chosen variant is then compiled afresh (the measured copies trained a step: their weights are
no longer the seed's) and carries the :class:`Decision` as ``model.dispatch``.

The decision (the choice, every variant's figures or the reason it was skipped) is stored in the
kernel cache (content-keyed, checksummed, atomic) under a key of the backend, the device (name
and architecture), the spec without its seed (the seed changes no speed), the mmad version, the
candidates, the measured shape and whatever else the backend passes as ``key_extra`` (its
settings): a model shape is measured once per device and version. A cached decision whose
variant is no longer a candidate, or an entry that is corrupt or unreadable, is measured again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mmad import __version__
from mmad.backends.cache import KernelCache
from mmad.backends.contract import CompiledModel
from mmad.errors import CompileError, MMADError
from mmad.spec import MLPSpec

ROWS = 1 << 16  # the daemon's default max_batch_rows: the batch a served model mostly runs
CHECK_ROWS = 4096  # rows compared with the float64 oracle (rows are independent)
# relative L2 error against float64 that a correct variant stays within; fp32 models are read
# back as fp16 here, so their bound is the fp16 output's rounding, not fp32's
TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2, "fp32": 1e-3}
DECISION_FORMAT = 3  # bump when the stored decision's fields or their timing change
TRAIN_STEPS_PER_CALL = 10  # a timed training call: its steps' losses are read once, as a job's are
SCORE_RULE = "forward / best forward + train / best train; lowest wins"

Timer = Callable[[Callable[[], Any], Callable[[], None], int | None], float]  # (fn, sync, calls) -> s a call
Candidates = dict[str, Callable[[], CompiledModel]]


class DispatchFailed(MMADError):
    """No candidate variant compiled, ran and computed the model correctly."""


def median_timer(clock: str = "host", repeats: int = 10) -> Timer:
    """The benchmarks' median timer (mmad.bench.timing) as a dispatch timer: ``clock`` "host"
    (perf_counter around ``fn`` and ``sync``, one call a sample) or a device's events ("cupy",
    around the benchmarks' ``GPU_CALLS_PER_SAMPLE`` back-to-back calls a sample), unless the
    caller says how many calls a sample takes."""
    from mmad.bench.timing import GPU_CALLS_PER_SAMPLE, back_to_back, median_seconds

    default_calls = 1 if clock == "host" else GPU_CALLS_PER_SAMPLE

    def timer(fn: Callable[[], Any], sync: Callable[[], None], calls: int | None = None) -> float:
        calls = calls or default_calls
        return median_seconds(back_to_back(fn, calls), repeats, sync=sync, clock=clock, calls=calls)

    return timer


@dataclass
class VariantResult:
    """One candidate's figures, or why it was not measured (``status`` "skipped")."""

    variant: str
    status: str  # "chosen", "measured" or "skipped"
    forward_s: float | None = None
    train_s: float | None = None
    rel_err: float | None = None
    score: float | None = None
    reason: str = ""

    def to_json(self, rows: int) -> dict[str, Any]:
        out: dict[str, Any] = {"variant": self.variant, "status": self.status}
        if self.status == "skipped":
            out["reason"] = self.reason
            return out
        out.update(forward_s=self.forward_s, train_s=self.train_s, rel_err_vs_float64=self.rel_err,
                   score=self.score, forward_msps=rows / self.forward_s / 1e6, train_msps=rows / self.train_s / 1e6)
        return out


@dataclass
class Decision:
    """What the dispatcher chose for one model on one device, and why."""

    backend: str
    device: str
    variant: str
    rows: int
    io: str
    results: list[VariantResult]
    measured_at: float
    key: str = ""
    from_cache: bool = False  # loaded from the kernel cache rather than measured by this call

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "device": self.device, "variant": self.variant, "rows": self.rows,
                "io": self.io, "score_rule": SCORE_RULE,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.measured_at)),
                "from_cache": self.from_cache, "key": self.key,
                "variants": [r.to_json(self.rows) for r in self.results]}

    def stored(self) -> bytes:
        return json.dumps({"format": DECISION_FORMAT, "backend": self.backend, "device": self.device,
                           "variant": self.variant, "rows": self.rows, "io": self.io,
                           "measured_at": self.measured_at,
                           "results": [r.__dict__ for r in self.results]}, sort_keys=True).encode()

    @classmethod
    def from_stored(cls, payload: bytes) -> "Decision | None":
        """The decision in a cache entry; None when it is not one this version wrote."""
        try:
            doc = json.loads(payload)
            if doc.get("format") != DECISION_FORMAT:
                return None
            results = [VariantResult(**r) for r in doc["results"]]
            return cls(doc["backend"], doc["device"], doc["variant"], doc["rows"], doc["io"], results,
                       doc["measured_at"])
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


def decision_key(backend: str, device: str, spec: MLPSpec, candidates: list[str], rows: int, io: str,
                 key_extra: Any = None) -> dict[str, Any]:
    """The kernel-cache key parts of a decision (``KernelCache.key``)."""
    return dict(backend=backend, device=device, compiler=f"mmad {__version__} dispatch",
                options={"candidates": candidates, "rows": rows, "io": io, "extra": key_extra},
                source=json.dumps(spec.replace(seed=0).to_json(), sort_keys=True), layout_version=DECISION_FORMAT)


def dispatch(spec: MLPSpec, candidates: Candidates, *, backend: str, device: str, cache: KernelCache,
             io: str = "fp16", rows: int = ROWS, timer: Timer | None = None,
             key_extra: Any = None) -> CompiledModel:
    """The fastest correct candidate compiled for ``spec``, with its decision as ``.dispatch``.

    ``device``: the device's name and architecture (part of the key); ``io``: "fp16" (device
    inputs and outputs in fp16) or "fp32"; ``timer``: how a call is timed (default: the host
    clock, :func:`median_timer`); ``key_extra``: the backend's settings that change speed. One
    candidate is compiled without measuring. Raises :class:`DispatchFailed` naming
    every candidate's reason when none is usable.
    """
    if not candidates:
        raise DispatchFailed(f"the {backend} backend has no usable variant for this model")
    names = list(candidates)
    if len(names) == 1:  # nothing to choose between
        return candidates[names[0]]()
    parts = decision_key(backend, device, spec, names, rows, io, key_extra)
    key = KernelCache.key(**parts)[0]
    measured: list[Decision] = []

    def build() -> bytes:
        measured.append(measure(spec, candidates, backend=backend, device=device, io=io, rows=rows,
                                timer=timer or median_timer()))
        return measured[-1].stored()

    decision = Decision.from_stored(cache.get_or_build(build, **parts))
    if decision is None:  # an intact entry that does not read as a decision: measured again
        cache.store(key, build(), KernelCache.key(**parts)[1])
        decision = measured[-1]
    decision.key, decision.from_cache = key, not measured
    model = candidates[decision.variant]()
    model.dispatch = decision
    return model


def measure(spec: MLPSpec, candidates: Candidates, *, backend: str, device: str, io: str, rows: int,
            timer: Timer) -> Decision:
    """Every candidate compiled, checked and timed (see the module's description)."""
    results = [_measure_one(name, build, spec, io, rows, timer) for name, build in candidates.items()]
    measured = [r for r in results if r.status == "measured"]
    if not measured:
        raise DispatchFailed(f"no variant of the {backend} backend runs this model correctly: "
                             + "; ".join(f"{r.variant}: {r.reason}" for r in results))
    best_forward = min(r.forward_s for r in measured)
    best_train = min(r.train_s for r in measured)
    for r in measured:
        r.score = r.forward_s / best_forward + r.train_s / best_train
    chosen = min(measured, key=lambda r: r.score)  # min keeps the first of equal scores
    chosen.status = "chosen"
    return Decision(backend, device, chosen.variant, rows, io, results, time.time())


def _measure_one(name: str, build: Callable[[], CompiledModel], spec: MLPSpec, io: str, rows: int,
                 timer: Timer) -> VariantResult:
    try:
        model = build()
    except Exception as exc:  # noqa: BLE001 - any failure only rules this variant out
        return VariantResult(name, "skipped", reason=f"failed to compile: {_words(exc)}")
    try:
        # the same data for every variant: a model's candidates are compared like with like
        rng = np.random.default_rng(int(spec.replace(seed=0).content_hash(), 16) % 2**32)
        x = rng.standard_normal((rows, spec.n_input_dims), dtype=np.float32)
        y = rng.standard_normal((rows, spec.n_output_dims), dtype=np.float32)
        out_dtype = np.float16 if io == "fp16" else np.float32
        if io == "fp16":
            x = x.astype(np.float16).astype(np.float32)  # the values the device's fp16 inputs hold
        dx = model.upload(x)
        if io == "fp16":
            dx = dx.astype(np.float16)
        check = np.sort(rng.choice(rows, min(CHECK_ROWS, rows), replace=False))
        err = oracle_error(model, x[check], model.download(model.forward(dx, out_dtype=out_dtype))[check])
        if not err <= TOLERANCE[spec.precision]:
            return VariantResult(name, "skipped", reason=f"wrong result: the forward differs from the float64 "
                                 f"oracle by {err:.2e} (> {TOLERANCE[spec.precision]})")
        tx, ty = model.upload(x), model.upload(y)
        losses = np.asarray(model.train_step(tx, ty))
        if not np.isfinite(losses).all():
            return VariantResult(name, "skipped", reason=f"wrong result: a training step's loss is {losses[0]}")
        forward_s = timer(lambda: model.forward(dx, out_dtype=out_dtype), model.synchronize, None)
        train_s = timer(lambda: model.train_step(tx, ty, steps=TRAIN_STEPS_PER_CALL), model.synchronize,
                        1) / TRAIN_STEPS_PER_CALL
        return VariantResult(name, "measured", forward_s, train_s, err)
    except Exception as exc:  # noqa: BLE001
        return VariantResult(name, "skipped", reason=f"failed to run: {_words(exc)}")
    finally:
        model.close()


def oracle_error(model: CompiledModel, x: np.ndarray, out: np.ndarray) -> float:
    """Relative L2 error of ``out`` (``model``'s forward of the host rows ``x``) against the
    float64 cpu oracle with the same parameters; inf when ``out`` holds NaN or Inf."""
    from mmad.backends.cpu import CpuBackend

    out = np.asarray(out, dtype=np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    oracle = CpuBackend("float64").compile(model.spec)
    oracle.set_params(model.get_params())
    ref = oracle.forward(np.asarray(x, dtype=np.float64))
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _words(exc: BaseException) -> str:
    """An exception in one line: mmad's own message (a compile error: what failed and the first
    line of the compiler's log, not the source), else its kind and message."""
    if isinstance(exc, CompileError):
        return f"{exc.what}: {(exc.log.strip().splitlines() or [''])[0]}"
    text = " ".join(str(exc).split())
    return text if isinstance(exc, MMADError) else f"{type(exc).__name__}: {text}"


__all__ = ["CHECK_ROWS", "Decision", "DispatchFailed", "ROWS", "TOLERANCE", "VariantResult", "median_timer",
           "dispatch", "measure", "oracle_error"]
