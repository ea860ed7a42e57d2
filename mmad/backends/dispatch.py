"""Dispatch by measurement: compile each usable variant of a backend, time it on the model's own
shapes, keep the fastest that computes the right numbers, and remember the choice.

A backend calls :func:`dispatch` from ``compile(spec, variant=None)`` with its candidates (name →
a function compiling that variant for a spec). A decision already in the kernel cache is used at
once: the chosen variant is compiled (its kernels are cached too) and carries the
:class:`Decision` as ``model.dispatch``. Without one, the candidates are measured, either

* **in the background** (the backend passes ``quick``: variants in the order to try, each with
  the reason it is quick to compile): the first of them that compiles and whose forward matches
  the float64 oracle on ``QUICK_CHECK_ROWS`` fresh rows is returned at once, its ``dispatch`` a
  :class:`Background` ("measuring in background", and why that variant serves meanwhile). The
  measurement runs on the device's queue (a thread of its own: one measurement at a time per
  device, never on the caller's thread): every candidate compiled side by side on the compiler
  threads (:func:`mmad.backends.cache.compile_pool`; modules the variants share compile once),
  then each checked and timed in turn. The decision goes to the cache; whoever serves the model
  swaps the chosen variant in with the model's current parameters and optimizer state (the
  daemon: :mod:`mmad.engine.background_dispatch`; a library caller: :func:`settled`). A
  measurement that fails leaves the quick variant serving, its ``dispatch`` saying why;
* **before returning** (no ``quick``; the cuda backend's ``MMAD_DISPATCH=measure``): the same
  measurement on the caller's thread, the chosen variant compiled afresh (the measured copies
  trained a step: their weights are no longer the seed's).

Measuring a candidate, on fresh random data generated once per measurement (``rows`` rows,
seeded per model, the same for every candidate):

1. compile it (an exception: skipped, "failed to compile: ...");
2. the forward in the backend's I/O type (fp16 in and out on cuda, the tiny-cuda-nn pipeline's
   own I/O) must be finite and within ``TOLERANCE[spec.precision]`` of the float64 cpu oracle on
   ``CHECK_ROWS`` of its rows (else skipped, "wrong result: ..."), and one training step's loss
   must be finite (else "wrong result");
3. time the forward and a training step (L2 on the model's loss, the spec's optimizer) through
   ``timer(fn, sync, calls)`` → seconds per call: the forward in the timer's own number of
   back-to-back calls a sample, training as one call of ``TRAIN_STEPS_PER_CALL`` steps a sample,
   whose losses come back once (any other exception in 2-3: "failed to run: ...").
   :func:`median_timer` with ``budget_s`` bounds the cost: one warm-up sample, then as many
   samples (``MIN_REPEATS`` to ``repeats``) as fit in ``budget_s`` (``BUDGET_S``), so a wide model
   at 2^20 rows, whose training sample takes ~0.3 s, is timed on 3 samples and a small one on 10.

The candidates are timed on the model's own spec, its input encoding included: a backend encodes
on the device (cuda), so what is timed is what is served. (An encoding applied by NumPy on the
host on every timed call of a 2^20-row OneBlob model, 512 columns a row, kept the dispatcher
measuring for minutes.)

The score of a measured variant is ``forward / best forward + train / best train`` (2.0: the
fastest at both): each phase counts by how far the variant is from the fastest at that phase,
so neither the forward (a few microseconds at 2^16 rows) nor the training step (several times
longer) drowns the other out. The lowest score wins; a tie goes to the earlier candidate.

The decision (the choice, every variant's figures or the reason it was skipped, how long the
measurement took) is stored in the kernel cache (content-keyed, checksummed, atomic) under a key
of the backend, the device (name and architecture), the spec without its seed (the seed changes
no speed), the mmad version, the candidates, the measured shape and whatever else the backend
passes as ``key_extra`` (its settings): a model shape is measured once per device and version.
A cached decision whose variant is no longer a candidate, or an entry that is corrupt or
unreadable, is measured again.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import numpy as np

from mmad import __version__
from mmad.backends.cache import KernelCache, build_all
from mmad.backends.contract import CompiledModel
from mmad.errors import CompileError, MMADError
from mmad.spec import MLPSpec

log = logging.getLogger("mmad.backends.dispatch")

ROWS = 1 << 16  # the daemon's default max_batch_rows: the batch a served model mostly runs
CHECK_ROWS = 4096  # rows compared with the float64 oracle (rows are independent)
QUICK_CHECK_ROWS = 256  # rows a quick variant's forward is checked on before it serves
# relative L2 error against float64 that a correct variant stays within; fp32 models are read
# back as fp16 here, so their bound is the fp16 output's rounding, not fp32's
TOLERANCE = {"fp16": 3e-3, "bf16": 2e-2, "fp32": 1e-3}
DECISION_FORMAT = 4  # bump when the stored decision's fields or their timing change
TRAIN_STEPS_PER_CALL = 10  # a timed training call: its steps' losses are read once, as a job's are
SCORE_RULE = "forward / best forward + train / best train; lowest wins"
BUDGET_S = 0.5  # seconds of samples a phase (forward, training) of one variant is timed for ...
MIN_REPEATS = 3  # ... in at least this many samples after the warm-up one
# a Background's states, then the Decision's: measuring, then the choice made and being swapped in
# by whoever serves the model (the daemon; settled()), or failed (the quick variant serving on)
MEASURING, SWAPPING, DECIDED, FAILED = "measuring in background", "swapping in the chosen variant", "decided", "failed"

Timer = Callable[[Callable[[], Any], Callable[[], None], int | None], float]  # (fn, sync, calls) -> s a call
Candidates = dict[str, Callable[[MLPSpec], CompiledModel]]  # variant -> compile it for a spec


class DispatchFailed(MMADError):
    """No candidate variant compiled, ran and computed the model correctly."""


def median_timer(clock: str = "host", repeats: int = 10, budget_s: float | None = None) -> Timer:
    """The benchmarks' median timer (:mod:`mmad.backends.timing`) as a dispatch timer: ``clock`` "host"
    (perf_counter around ``fn`` and ``sync``, one call a sample) or a device's events ("cupy",
    around the benchmarks' ``GPU_CALLS_PER_SAMPLE`` back-to-back calls a sample), unless the
    caller says how many calls a sample takes. ``budget_s``: one warm-up sample (plans, graph
    captures and tunings happen in it), then ``budget_s`` of samples, ``MIN_REPEATS`` to
    ``repeats`` of them; without it, three warm-up samples and ``repeats``."""
    from mmad.backends.timing import GPU_CALLS_PER_SAMPLE, back_to_back, median_seconds

    default_calls = 1 if clock == "host" else GPU_CALLS_PER_SAMPLE

    def timer(fn: Callable[[], Any], sync: Callable[[], None], calls: int | None = None) -> float:
        calls = calls or default_calls
        sample = back_to_back(fn, calls)
        if budget_s is None:
            return median_seconds(sample, repeats, sync=sync, clock=clock, calls=calls)
        began = time.perf_counter()
        sample()
        sync()
        first = time.perf_counter() - began
        n = max(MIN_REPEATS, min(repeats, int(budget_s / max(first, 1e-9))))
        return median_seconds(sample, n, sync=sync, clock=clock, calls=calls, warmup=0)

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
    measure_s: float = 0.0  # wall seconds the measurement took (compiles, checks, timings) ...
    compile_s: float = 0.0  # ... of which compiling every candidate side by side first (in the background)
    key: str = ""
    from_cache: bool = False  # loaded from the kernel cache rather than measured for this model
    served_meanwhile: str = ""  # the quick variant that served while it was measured in the background

    def to_json(self) -> dict[str, Any]:
        out = {"state": DECIDED, "backend": self.backend, "device": self.device, "variant": self.variant,
               "rows": self.rows, "io": self.io, "score_rule": SCORE_RULE,
               "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.measured_at)),
               "measure_s": self.measure_s, "compile_s": self.compile_s, "from_cache": self.from_cache,
               "key": self.key,
               "variants": [r.to_json(self.rows) for r in self.results]}
        if self.served_meanwhile:
            out["served_while_measuring"] = self.served_meanwhile
        return out

    def stored(self) -> bytes:
        return json.dumps({"format": DECISION_FORMAT, "backend": self.backend, "device": self.device,
                           "variant": self.variant, "rows": self.rows, "io": self.io,
                           "measured_at": self.measured_at, "measure_s": self.measure_s, "compile_s": self.compile_s,
                           "results": [r.__dict__ for r in self.results]}, sort_keys=True).encode()

    @classmethod
    def from_stored(cls, payload: bytes | None) -> "Decision | None":
        """The decision in a cache entry; None when there is none or it is not one this version wrote."""
        if payload is None:
            return None
        try:
            doc = json.loads(payload)
            if doc.get("format") != DECISION_FORMAT:
                return None
            results = [VariantResult(**r) for r in doc["results"]]
            return cls(doc["backend"], doc["device"], doc["variant"], doc["rows"], doc["io"], results,
                       doc["measured_at"], doc["measure_s"], doc["compile_s"])
        except (ValueError, TypeError, KeyError, AttributeError):
            return None


class Background:
    """The dispatch of a model that serves on a quick variant while the others are measured on
    its device's queue: its ``model.dispatch`` until the chosen variant serves (``state``
    "measuring in background", then "swapping in the chosen variant" with ``decision``, or
    "failed" with ``error``); the model that then serves carries the decision.

    ``wanted`` is set by whoever serves the model: once it returns False (the model was replaced,
    deleted or unloaded) the measurement stops before its next variant. ``build(variant)``
    compiles a candidate for the model on its device (the swap's new model)."""

    def __init__(self, variant: str, reason: str, candidates: list[str], build: Callable[[str], CompiledModel]):
        self.variant = variant
        self.reason = reason
        self.candidates = candidates
        self.build = build
        self.state = MEASURING
        self.decision: Decision | None = None
        self.error = ""
        self.wanted: Callable[[], bool] = lambda: True
        self.started_at = time.time()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[["Background"], None]] = []

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state, "variant": self.variant, "reason": self.reason,
                               "candidates": self.candidates,
                               "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at))}
        if self.state == FAILED:
            out["error"] = self.error
        if self.decision is not None:
            out["chosen"] = self.decision.variant
        return out

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Decision:
        """The decision, once made; DispatchFailed saying why when the measurement failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background measurement of {self.candidates} has not ended within {timeout} s")
        if self.decision is None:
            raise DispatchFailed(self.error)
        return self.decision

    def add_done_callback(self, fn: Callable[["Background"], None]) -> None:
        """``fn(self)`` once the measurement has ended (at once when it has): on the thread that
        ended it, or this one."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def fail(self, error: str) -> None:
        """The measurement (or what followed it: compiling the choice, the swap) failed: the
        quick variant goes on serving, and ``to_json`` says why."""
        self.state, self.error = FAILED, f"{error}; {self.variant} goes on serving"

    def _finish(self, decision: Decision | None, error: str = "") -> None:
        if decision is not None:
            decision.served_meanwhile = self.variant
            self.state, self.decision = SWAPPING, decision
        else:
            self.fail(error)
        with self._lock:
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - one watcher's failure stops neither the queue nor the others
                log.exception("a watcher of the background measurement of %s failed", self.candidates)


class _DeviceQueue:
    """The measurement queue of one device: a thread of its own, one measurement at a time. The
    thread does not hold the process open: at exit the running measurement stops before its next
    variant (``_stop_all``) and the queued ones end unmeasured."""

    def __init__(self, name: str):
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"mmad-dispatch-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            job()


_queues: dict[str, _DeviceQueue] = {}
_queues_lock = threading.Lock()
_stopping = threading.Event()
STOP_WAIT_S = 30.0  # at exit, how long the running measurements get to reach their next variant


def _queue(name: str) -> _DeviceQueue:
    with _queues_lock:
        if name not in _queues:
            _queues[name] = _DeviceQueue(name)
        return _queues[name]


@atexit.register
def _stop_all() -> None:
    _stopping.set()
    with _queues_lock:
        queues = list(_queues.values())
    for q in queues:
        q.jobs.put(None)
    deadline = time.monotonic() + STOP_WAIT_S
    for q in queues:
        q.thread.join(max(0.0, deadline - time.monotonic()))


def decision_key(backend: str, device: str, spec: MLPSpec, candidates: list[str], rows: int, io: str,
                 key_extra: Any = None) -> dict[str, Any]:
    """The kernel-cache key parts of a decision (``KernelCache.key``)."""
    return dict(backend=backend, device=device, compiler=f"mmad {__version__} dispatch",
                options={"candidates": candidates, "rows": rows, "io": io, "extra": key_extra},
                source=json.dumps(spec.replace(seed=0).to_json(), sort_keys=True), layout_version=DECISION_FORMAT)


def dispatch(spec: MLPSpec, candidates: Candidates, *, backend: str, device: str, cache: KernelCache,
             io: str = "fp16", rows: int = ROWS, timer: Timer | None = None, key_extra: Any = None,
             quick: Sequence[tuple[str, str]] = (),
             device_queue: str = "", device_context: Callable[[], ContextManager[Any]] = contextlib.nullcontext
             ) -> CompiledModel:
    """The fastest correct candidate compiled for ``spec``, with its decision as ``.dispatch``, or
    (``quick``, no decision cached) a quick one at once while the others are measured on the
    queue ``device_queue`` (default ``device``), its ``.dispatch`` a :class:`Background`.

    ``device``: the device's name and architecture (part of the key); ``io``: "fp16" (device
    inputs and outputs in fp16) or "fp32"; ``timer``: how a call is timed (default: the host
    clock, :func:`median_timer` with ``BUDGET_S``); ``key_extra``: the backend's settings that
    change speed; ``quick``: (variant, why it is quick) in the order to try; ``device_context``: what a
    measurement in the background runs inside (cuda: the model's device made current on the
    queue's thread). One candidate is compiled without measuring. Raises
    :class:`DispatchFailed` naming every candidate's reason when none is usable.
    """
    if not candidates:
        raise DispatchFailed(f"the {backend} backend has no usable variant for this model")
    names = list(candidates)
    if len(names) == 1:  # nothing to choose between
        return candidates[names[0]](spec)
    parts = decision_key(backend, device, spec, names, rows, io, key_extra)
    key, stored_parts = KernelCache.key(**parts)

    def measured(stop: Callable[[], bool] | None = None, compile_first: bool = False) -> Decision:
        """The decision measured now and stored, or the one a concurrent measurement stored."""
        made: list[Decision] = []

        def build() -> bytes:
            made.append(measure(spec, candidates, backend=backend, device=device, io=io, rows=rows,
                                timer=timer or median_timer(budget_s=BUDGET_S), stop=stop,
                                compile_first=compile_first))
            return made[-1].stored()

        decision = Decision.from_stored(cache.get_or_build(build, **parts))
        if decision is None:  # an intact entry that does not read as a decision: measured again
            cache.store(key, build(), stored_parts)
            decision = made[-1]
        decision.key, decision.from_cache = key, not made
        return decision

    decision = Decision.from_stored(cache.load(key))
    if decision is not None:
        decision.key, decision.from_cache = key, True
        return _compiled_for(candidates, spec, decision)
    model = _quick_model(spec, candidates, quick, io) if quick else None
    if model is None:  # measured now
        return _compiled_for(candidates, spec, measured())

    background = model.dispatch

    def stopped() -> bool:
        return _stopping.is_set() or not background.wanted()

    def measure_in_background() -> None:
        if stopped():
            background._finish(None, "not measured: the model stopped being served before its turn")
            return
        try:
            with device_context():
                decision = measured(stop=stopped, compile_first=True)
        except Exception as exc:  # noqa: BLE001 - whatever ends the measurement, the quick variant serves on
            background._finish(None, f"the background measurement failed: {in_words(exc)}")
            return
        background._finish(decision)

    _queue(device_queue or device).jobs.put(measure_in_background)
    return model


def _compiled_for(candidates: Candidates, spec: MLPSpec, decision: Decision) -> CompiledModel:
    model = candidates[decision.variant](spec)
    model.dispatch = decision
    return model


def _quick_model(spec: MLPSpec, candidates: Candidates, quick: Sequence[tuple[str, str]],
                 io: str) -> CompiledModel | None:
    """The first quick variant that compiles and whose forward matches the float64 oracle on
    ``QUICK_CHECK_ROWS`` rows, its ``dispatch`` a :class:`Background` not yet queued; None (with
    each one's reason logged) when none does."""
    names = list(candidates)
    refused = []
    for variant, why in quick:
        if variant not in candidates:
            continue
        try:
            model = candidates[variant](spec)
        except Exception as exc:  # noqa: BLE001 - the next quick variant is tried
            refused.append(f"{variant}: failed to compile: {in_words(exc)}")
            continue
        try:
            x, _ = _data(spec, QUICK_CHECK_ROWS, io)
            err = oracle_error(model, x, model.download(model.forward(_device_rows(model, x, io),
                                                                      out_dtype=_out_dtype(io))))
            problem = "" if err <= TOLERANCE[spec.precision] else (
                f"wrong result: the forward differs from the float64 oracle by {err:.2e}")
        except Exception as exc:  # noqa: BLE001
            problem = f"failed to run: {in_words(exc)}"
        if problem:
            model.close()
            refused.append(f"{variant}: {problem}")
            continue
        others = len(names) - 1
        reason = (f"serving {variant} while the {others} other variant{'s' if others != 1 else ''} "
                  f"{'are' if others != 1 else 'is'} measured: {why}")
        if refused:
            reason += f" (not {'; '.join(refused)})"
        model.dispatch = Background(variant, reason, names,
                                    lambda chosen: candidates[chosen](spec))
        return model
    log.warning("no quick variant serves this model (%s); every variant is measured first", "; ".join(refused))
    return None


def settled(model: CompiledModel, timeout: float | None = None) -> CompiledModel:
    """``model`` once its background measurement (if any) has ended: itself when its variant was
    chosen (its ``dispatch`` now the decision), else the chosen variant with ``model``'s
    parameters and optimizer state (``model`` closed). For callers that want the measured
    choice before going on (benchmarks); DispatchFailed when the measurement failed."""
    background = model.dispatch
    if not isinstance(background, Background):
        return model
    decision = background.wait(timeout)
    if decision.variant == model.variant:
        model.dispatch = decision
        return model
    chosen = background.build(decision.variant)
    try:
        carry_state(model, chosen)
    except BaseException:
        chosen.close()
        raise
    chosen.dispatch = decision
    model.close()
    return chosen


def carry_state(source: CompiledModel, target: CompiledModel) -> None:
    """``source``'s parameters and optimizer state (its step count included) into ``target``."""
    target.set_params(source.get_params())
    target.set_optimizer_state(source.get_optimizer_state())


def measure(spec: MLPSpec, candidates: Candidates, *, backend: str, device: str, io: str, rows: int,
            timer: Timer, stop: Callable[[], bool] | None = None, compile_first: bool = False) -> Decision:
    """Every candidate compiled, checked and timed on ``spec`` (see the module's description);
    ``compile_first``: every candidate compiled side by side first (then each built again from
    the cache to be measured); ``stop``: checked before each variant, True ends the measurement
    (DispatchFailed)."""
    started = time.perf_counter()
    skipped: dict[str, VariantResult] = {}
    if compile_first:
        def compile_one(name: str) -> VariantResult | None:
            try:
                candidates[name](spec).close()
            except Exception as exc:  # noqa: BLE001 - only this variant is ruled out
                return VariantResult(name, "skipped", reason=f"failed to compile: {in_words(exc)}")
            return None

        built = build_all({name: (lambda name=name: compile_one(name)) for name in candidates})
        skipped = {name: r for name, r in built.items() if r is not None}
    compile_s = time.perf_counter() - started
    x, y = _data(spec, rows, io)
    results = []
    for name, build in candidates.items():
        if stop is not None and stop():
            raise DispatchFailed("stopped: the model is no longer served")
        results.append(skipped.get(name) or _measure_one(name, lambda build=build: build(spec), spec, io, x, y, timer))
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
    return Decision(backend, device, chosen.variant, rows, io, results, time.time(), time.perf_counter() - started,
                    compile_s)


def _data(spec: MLPSpec, rows: int, io: str) -> tuple[np.ndarray, np.ndarray]:
    """Inputs and targets of a measurement: the same for every candidate of a model (compared
    like with like), fp16-representable inputs where the I/O is fp16."""
    rng = np.random.default_rng(int(spec.replace(seed=0).content_hash(), 16) % 2**32)
    x = rng.standard_normal((rows, spec.n_input_dims), dtype=np.float32)
    y = rng.standard_normal((rows, spec.n_output_dims), dtype=np.float32)
    if io == "fp16":
        x = x.astype(np.float16).astype(np.float32)  # the values the device's fp16 inputs hold
    return x, y


def _out_dtype(io: str) -> Any:
    return np.float16 if io == "fp16" else np.float32


def _device_rows(model: CompiledModel, x: np.ndarray, io: str) -> Any:
    dx = model.upload(x)
    return dx.astype(np.float16) if io == "fp16" else dx


def _measure_one(name: str, build: Callable[[], CompiledModel], spec: MLPSpec, io: str, x: np.ndarray,
                 y: np.ndarray, timer: Timer) -> VariantResult:
    try:
        model = build()
    except Exception as exc:  # noqa: BLE001 - any failure only rules this variant out
        return VariantResult(name, "skipped", reason=f"failed to compile: {in_words(exc)}")
    try:
        rows = x.shape[0]
        out_dtype = _out_dtype(io)
        dx = _device_rows(model, x, io)
        rng = np.random.default_rng(rows)
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
        return VariantResult(name, "skipped", reason=f"failed to run: {in_words(exc)}")
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


def in_words(exc: BaseException) -> str:
    """An exception in one line: mmad's own message (a compile error: what failed and the first
    line of the compiler's log, not the source), else its kind and message."""
    if isinstance(exc, CompileError):
        return f"{exc.what}: {(exc.log.strip().splitlines() or [''])[0]}"
    text = " ".join(str(exc).split())
    return text if isinstance(exc, MMADError) else f"{type(exc).__name__}: {text}"


__all__ = ["Background", "CHECK_ROWS", "Decision", "DispatchFailed", "ROWS", "TOLERANCE", "VariantResult",
           "carry_state", "dispatch", "in_words", "measure", "median_timer", "oracle_error", "settled"]
