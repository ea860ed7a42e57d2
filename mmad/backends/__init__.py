"""Backends: one module per compute stack behind one contract (see ``contract.py``).

``probe_all()`` asks every backend what it can do; ``select()`` picks the best available
variant, honouring ``MMAD_BACKEND`` (``cuda``, ``vulkan``, ``wgpu``, ``cpu``, optionally with a
variant: ``vulkan:simt``). A forced backend that cannot run is an error, never a fallback.
"""

from __future__ import annotations

import importlib
import os

from mmad.backends.contract import Backend, CompiledModel, ProbeRow
from mmad.errors import BackendUnavailable, SpecError

# name -> (module, class); imported lazily so that a missing optional stack costs nothing
BACKENDS = {
    "cuda": ("mmad.backends.cuda", "CudaBackend"),
    "vulkan": ("mmad.backends.vulkan", "VulkanBackend"),
    "wgpu": ("mmad.backends.webgpu", "WgpuBackend"),
    "cpu": ("mmad.backends.cpu", "CpuBackend"),
}
ENV_VAR = "MMAD_BACKEND"


def load_backend(name: str) -> Backend:
    """Instantiate a backend by name; a backend whose module cannot be imported is unavailable."""
    if name not in BACKENDS:
        raise SpecError(ENV_VAR, f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    module_name, class_name = BACKENDS[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(name, f"its Python module could not be imported: {exc}") from exc
    return getattr(module, class_name)()


def probe_backend(name: str) -> tuple[Backend | None, list[ProbeRow]]:
    """Probe one backend; never raises (an import failure is a FAIL row)."""
    try:
        backend = load_backend(name)
    except BackendUnavailable as exc:
        return None, [ProbeRow(name, "-", False, reason=exc.reason)]
    try:
        return backend, backend.probe()
    except Exception as exc:  # a probe must never take the process down
        return backend, [ProbeRow(name, "-", False, reason=f"probe raised {type(exc).__name__}: {exc}")]


def probe_all(names: list[str] | None = None) -> list[ProbeRow]:
    rows: list[ProbeRow] = []
    for name in names or list(BACKENDS):
        backend, backend_rows = probe_backend(name)
        rows.extend(backend_rows)
        if backend is not None:
            backend.close()
    return rows


def parse_forced(value: str | None = None) -> tuple[str, str | None] | None:
    """``MMAD_BACKEND`` as (backend, variant or None); None when unset."""
    value = os.environ.get(ENV_VAR, "") if value is None else value
    value = value.strip()
    if not value:
        return None
    name, _, variant = value.partition(":")
    if name not in BACKENDS:
        raise SpecError(ENV_VAR, f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}")
    return name, (variant or None)


def select(forced: str | None = None) -> tuple[Backend, ProbeRow]:
    """The backend to use and its best available variant row.

    With ``forced`` (or ``MMAD_BACKEND``) set, that backend (and variant) or an error naming
    why it cannot run. Otherwise the highest-priority available hardware variant, else cpu.
    """
    choice = parse_forced(forced)
    if choice is not None:
        name, variant = choice
        backend, rows = probe_backend(name)
        matching = [r for r in rows if variant in (None, r.variant)]
        if variant is not None and not matching:
            valid = ", ".join(r.variant for r in rows)
            raise SpecError(ENV_VAR, f"backend {name!r} has no variant {variant!r}; valid: {valid}")
        usable = sorted((r for r in matching if r.available), key=lambda r: -r.priority)
        if backend is None or not usable:
            reasons = "; ".join(f"{r.variant}: {r.reason}" for r in matching) or "no variant"
            raise BackendUnavailable(name if variant is None else f"{name}:{variant}", reasons)
        return backend, usable[0]
    best: tuple[Backend, ProbeRow] | None = None
    for name in BACKENDS:
        backend, rows = probe_backend(name)
        usable = [r for r in rows if r.available and not r.software]
        top = max(usable, key=lambda r: r.priority, default=None)
        if top is not None and (best is None or top.priority > best[1].priority):
            if best is not None:
                best[0].close()
            best = (backend, top)
        elif backend is not None:
            backend.close()
    assert best is not None, "the cpu backend is always available"
    return best


def choose(rows: list[ProbeRow], forced: tuple[str, str | None] | None) -> ProbeRow | None:
    """The row ``select`` picks, found among rows already probed (``mmad probe`` marks it);
    None when the forced backend, or every backend, cannot run."""
    if forced is not None:
        name, variant = forced
        usable = [r for r in rows if r.backend == name and variant in (None, r.variant) and r.available]
    else:
        usable = [r for r in rows if r.available and not r.software]
    return max(usable, key=lambda r: r.priority, default=None)  # ties: the first, as select


__all__ = ["BACKENDS", "choose", "Backend", "CompiledModel", "ProbeRow", "load_backend", "probe_all",
           "probe_backend", "select", "parse_forced", "ENV_VAR"]
