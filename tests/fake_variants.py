"""Fake variants whose speed a test sets, for the dispatcher's tests (tests/test_dispatch.py,
tests/test_background_dispatch.py).

A fake variant is the cpu backend's model (real forward, real training, checked against the real
float64 oracle) that advances a fake clock by its own cost per call; the dispatcher's timer seam
reads that clock. The clock is per thread: the dispatcher measures on its device's queue while
the caller may run the served model, whose calls must not land in a measurement.

Behaviours: "ok", "compile fails", "wrong" (its outputs are 1.5 times the right ones), "run
fails", "fails when measured" (right, except on the dispatcher's threads). A ``gate``
(``threading.Event``) holds every call made on a dispatcher thread until it is set: a test holds
a measurement mid-way that way.

:class:`FakeDispatchBackend` is the same as a daemon's backend ("fake"): ``register()`` adds it
to mmad's backends in a daemon process started by tests/fake_daemon.py, its variants and gate
read from the environment (``FAKE_VARIANTS``: JSON name -> [forward s, train s, behaviour], the
first the quick one; ``FAKE_GATE``: a file whose existence opens the gate; ``FAKE_TIMED_LOG``: a
file that gets a line per timed call).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np

from mmad.backends import dispatch as D
from mmad.backends.cache import KernelCache
from mmad.backends.contract import Backend, DeviceInfo, ProbeRow
from mmad.backends.cpu import CpuModel
from mmad.errors import CompileError

ROWS = 2048  # small: numpy does the work


def on_dispatcher_thread() -> bool:
    return threading.current_thread().name.startswith("mmad-dispatch")


class Clock:
    def __init__(self, timed_log: Path | None = None):
        self._local = threading.local()
        self.timed = 0  # calls timed through the seam: 0 when nothing was measured
        self.timed_log = timed_log

    @property
    def now(self) -> float:
        return getattr(self._local, "now", 0.0)

    @now.setter
    def now(self, value: float) -> None:
        self._local.now = value

    def timer(self, fn, sync, calls=None):
        began = self.now
        fn()
        sync()
        self.timed += 1
        if self.timed_log is not None:
            with open(self.timed_log, "a") as f:
                f.write(f"{threading.current_thread().name}\n")
        return self.now - began


class FakeModel(CpuModel):
    def __init__(self, spec, name, clock, forward_s, train_s, how="ok", gate=None):
        super().__init__(spec, "fp32")
        self.variant = name
        self.clock, self.forward_s, self.train_s, self.how, self.gate = clock, forward_s, train_s, how, gate

    def _call(self) -> None:
        if on_dispatcher_thread():
            if self.gate is not None:
                self.gate.wait()
            if self.how == "fails when measured":
                raise RuntimeError("the device was lost")
        if self.how == "run fails":
            raise RuntimeError("an illegal memory access was encountered")

    def forward(self, x, out_dtype=np.float32):
        self._call()
        self.clock.now += self.forward_s
        out = super().forward(x, out_dtype)
        return out * 1.5 if self.how == "wrong" else out

    def train_step(self, x, y, steps=1):
        self._call()
        self.clock.now += self.train_s * steps
        return super().train_step(x, y, steps)


class FakeBackend:
    """Variants name -> (forward seconds, train seconds, behaviour); counts compiles per variant
    and records the specs built."""

    def __init__(self, variants, gate=None, timed_log: Path | None = None):
        self.variants = variants
        self.clock = Clock(timed_log)
        self.gate = gate
        self.compiles: dict[str, int] = {}
        self.threads: set[str] = set()  # the threads that compiled
        self.built: list[tuple[str, str, object]] = []  # (variant, thread, spec) of every build
        self._lock = threading.Lock()

    def build(self, name, spec):
        with self._lock:
            self.compiles[name] = self.compiles.get(name, 0) + 1
            self.threads.add(threading.current_thread().name)
            self.built.append((name, threading.current_thread().name, spec))
        forward_s, train_s, how = self.variants[name]
        if how == "compile fails":
            raise CompileError(f"the {name} kernels", "ptxas error: too many resources requested\nmore", "src")
        return FakeModel(spec, name, self.clock, forward_s, train_s, how, self.gate)

    def compile(self, spec, cache, device="Fake GPU sm_90", **kw):
        candidates = {name: (lambda s, name=name: self.build(name, s)) for name in self.variants}
        return D.dispatch(spec, candidates, backend="fake", device=device, cache=cache, rows=ROWS,
                          timer=self.clock.timer, **kw)


class FileGate:
    """A gate that opens once a file exists (set from the test process)."""

    def __init__(self, path: Path):
        self.path = path

    def wait(self) -> None:
        while not self.path.exists():
            time.sleep(0.02)


class FakeDispatchBackend(Backend):
    """A daemon backend ("fake") whose variants are fake ones, dispatched in the background."""

    name = "fake"

    def __init__(self):
        variants = {k: tuple(v) for k, v in json.loads(os.environ["FAKE_VARIANTS"]).items()}
        gate = FileGate(Path(os.environ["FAKE_GATE"])) if os.environ.get("FAKE_GATE") else None
        log = Path(os.environ["FAKE_TIMED_LOG"]) if os.environ.get("FAKE_TIMED_LOG") else None
        self.fake = FakeBackend(variants, gate, log)
        self.quick = next(iter(variants))

    def probe(self) -> list[ProbeRow]:
        return [ProbeRow("fake", "measured", True, device="Fake GPU")]

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(0, "Fake GPU"), DeviceInfo(1, "Fake GPU")]  # two of the same: replicas

    def compile(self, spec, variant=None, cache=None, device=0, batch_rows=None):
        model = (self.fake.build(variant, spec) if variant is not None else
                 self.fake.compile(spec, cache if cache is not None else KernelCache(), device_queue=f"fake:{device}",
                                   quick=[(self.quick, "compiles at once")]))
        model.device_index = device
        return model


def register() -> None:
    from mmad import backends

    backends.BACKENDS["fake"] = ("fake_variants", "FakeDispatchBackend")
