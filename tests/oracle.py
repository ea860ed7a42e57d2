"""Comparison helpers shared by the tests: relative error against the float64 oracle, a cpu
backend made wrong everywhere but in the oracle, and per-case random data that is fresh on every
run yet reproducible (``case_rng``)."""

from __future__ import annotations

import hashlib
import os
import secrets

import numpy as np

TEST_SEED_ENV = "MMAD_TEST_SEED"


def run_seed() -> int:
    """The test run's seed: ``MMAD_TEST_SEED``, else drawn once by conftest's pytest_configure
    (which sets the variable before pytest-xdist starts its workers, so all of them share it)."""
    raw = os.environ.get(TEST_SEED_ENV)
    if raw is None:
        raw = os.environ[TEST_SEED_ENV] = str(secrets.randbelow(2**31))
    return int(raw)


def case_rng(*case) -> np.random.Generator:
    """A generator for one test case: new data every run (the run's seed), the same data for the
    same case and seed, so a failure is rerun with ``MMAD_TEST_SEED=<the seed pytest's header
    printed>``. (Python's ``hash`` of a str is salted per process: data seeded by it could not be
    drawn again.)"""
    digest = hashlib.sha256(f"{run_seed()}:{case!r}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def rel_err(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf when ``out`` holds NaN or Inf, so NaN never passes."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    if not np.isfinite(out).all():
        return float("inf")
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def wrong_cpu_forward(monkeypatch, factor: float) -> None:
    """Scale the cpu backend's outputs by ``factor`` in every mode but float64: the float64 oracle
    stays right, so every check against it must fail."""
    from mmad.backends.cpu import CpuModel

    forward = CpuModel.forward

    def wrong(self, x, out_dtype=np.float32):
        out = forward(self, x, out_dtype)
        return out if self.numerics == "float64" else out * factor

    monkeypatch.setattr(CpuModel, "forward", wrong)


def grad_errors(grads, spec, params, x, y, ref64=None) -> dict[str, tuple[float, float, float]]:
    """Per gradient tensor: (error vs float64, error vs ``emulate``, inherent error).

    ``inherent`` is how far the cpu backend's ``emulate`` mode (fp16/bf16 rounding at the
    kernels' rounding points) lies from float64 on the same data: a ReLU mask that flips when a
    pre-activation near zero is rounded moves a gradient by whole deltas, so fp16 gradients of
    deep ReLU nets sit 1-4% from float64 whatever the kernel. A kernel is judged against float64
    within that inherent error (plus the forward tolerance) and against ``emulate`` directly.
    ``ref64``: the float64 oracle's gradients when the caller has them already.
    """
    from mmad.backends.cpu import CpuBackend

    def oracle_grads(mode):
        model = CpuBackend(mode).compile(spec)
        model.set_params(params)
        return model.loss_and_grads(x, y)[1]

    ref64 = oracle_grads("float64") if ref64 is None else ref64
    emu = oracle_grads("emulate")
    out = {}
    for name, ref in ref64.items():
        out[name] = (rel_err(grads[name], ref), rel_err(grads[name], emu[name]), rel_err(emu[name], ref))
    return out
