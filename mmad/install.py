"""The NVIDIA driver as installers and the cuda backend see it: which of mmad's CUDA extras fits
it (``scripts/setup.sh``) and, where the cuda backend cannot run, which piece is missing (its
probe). Both read the driver the same way.

    python -m mmad.install extra      # prints the extra for this driver (cuda12, cuda13) or nothing,
                                      # and on stderr one line saying why

``MMAD_CUDA=12`` or ``13`` picks that extra whatever the driver says (a machine that installs
for another one), ``MMAD_CUDA=none`` none. Only the standard library: setup.sh runs this before
any dependency is installed.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# the kernel module's file: an NVIDIA driver is loaded (in a container too, where the GPUs are passed in)
PROC_VERSION = Path("/proc/driver/nvidia/version")
LIBCUDA = "libcuda.so.1"  # the driver's user-space library, by its soname (not the toolkit's stub)
# CUDA major -> the pyproject extra with CuPy's wheel for it (cupy-cudaNNx) and nvmath-python; a
# driver newer than the newest major runs that one's wheels (the driver is backward compatible)
EXTRAS = {12: "cuda12", 13: "cuda13"}
OLDEST = min(EXTRAS)
CUDA_SUCCESS, CUDA_ERROR_NO_DEVICE = 0, 100
SMI_TIMEOUT_S = 20


@dataclass(frozen=True)
class Driver:
    """What this machine's NVIDIA driver says. ``found_by``: what shows a driver is there (empty:
    none); ``cuda``: the newest CUDA version it runs; ``gpus``: the GPUs it sees (None: unknown);
    ``error``: what failed while reading it."""

    found_by: tuple[str, ...] = ()
    cuda: tuple[int, int] | None = None
    gpus: int | None = None
    error: str = ""

    def cuda_text(self) -> str:
        return f"{self.cuda[0]}.{self.cuda[1]}" if self.cuda else "unknown"


@dataclass(frozen=True)
class Reading:
    """One source's answer: the CUDA version, the GPU count and the error, each where known."""

    cuda: tuple[int, int] | None = None
    gpus: int | None = None
    error: str = ""


def read_libcuda(load: Callable[[str], object] = ctypes.CDLL) -> Reading | None:
    """libcuda's cuDriverGetVersion and cuDeviceGetCount; None where the library does not load."""
    try:
        lib = load(LIBCUDA)
    except OSError:
        return None
    version = ctypes.c_int(0)
    rc = lib.cuDriverGetVersion(ctypes.byref(version))
    if rc != CUDA_SUCCESS:
        return Reading(error=f"cuDriverGetVersion failed with CUDA error {rc}")
    cuda = (version.value // 1000, version.value % 1000 // 10)
    rc = lib.cuInit(0)
    if rc == CUDA_ERROR_NO_DEVICE:
        return Reading(cuda, 0)
    if rc != CUDA_SUCCESS:
        return Reading(cuda, None, f"cuInit failed with CUDA error {rc}")
    count = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    return Reading(cuda, count.value) if rc == CUDA_SUCCESS else Reading(cuda, None, f"cuDeviceGetCount failed ({rc})")


def parse_smi(header: str, listing: str) -> Reading:
    """``nvidia-smi``'s table header ("CUDA Version: 12.4") and ``nvidia-smi -L``'s lines ("GPU 0: ...")."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header)
    gpus = sum(line.startswith("GPU ") for line in listing.splitlines())
    return Reading((int(found[1]), int(found[2])) if found else None, gpus,
                   "" if found or not gpus else "nvidia-smi shows no CUDA version")


def read_smi(which: Callable[[str], str | None] = shutil.which, run=subprocess.run) -> Reading | None:
    """What nvidia-smi says; None where it is not installed."""
    smi = which("nvidia-smi")
    if smi is None:
        return None
    try:
        header, listing = (run([smi, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S).stdout
                           for args in ([], ["-L"]))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Reading(error=f"nvidia-smi failed: {exc}")
    return parse_smi(header, listing)


def read_driver(proc: Path = PROC_VERSION, libcuda: Callable[[], Reading | None] = read_libcuda,
                smi: Callable[[], Reading | None] = read_smi) -> Driver:
    """The driver, from libcuda where it loads, else from nvidia-smi (libcuda off the loader's
    path); ``/proc/driver/nvidia`` shows a loaded kernel module where neither answers."""
    found = [str(proc.parent)] if proc.exists() else []
    lib = libcuda()
    if lib is not None:
        found.append("libcuda")
        if lib.cuda is not None:
            return Driver(tuple(found), lib.cuda, lib.gpus, lib.error)
    tool = smi()
    if tool is not None:
        found.append("nvidia-smi")
    readings = [r for r in (lib, tool) if r is not None]
    cuda = next((r.cuda for r in readings if r.cuda), None)
    gpus = next((r.gpus for r in readings if r.gpus is not None), None)
    return Driver(tuple(found), cuda, gpus, "; ".join(r.error for r in readings if r.error))


def major_for(cuda: tuple[int, int]) -> int:
    """The CUDA major of the CuPy wheel for a driver of CUDA version ``cuda`` (at least OLDEST)."""
    return min(cuda[0], max(EXTRAS))


def cupy_package(major: int) -> str:
    return f"cupy-cuda{major}x"


def missing_piece(driver: Driver) -> str | None:
    """Why no CuPy wheel can run on this driver (no driver, no GPU, an unreadable or too old
    driver), or None when one can."""
    if not driver.found_by:
        return f"no NVIDIA driver is installed (no {PROC_VERSION.parent}, {LIBCUDA} or nvidia-smi)"
    if driver.gpus == 0:
        return f"the NVIDIA driver (CUDA {driver.cuda_text()}) sees no GPU"
    if driver.cuda is None:
        return (f"an NVIDIA driver is present ({', '.join(driver.found_by)}) but its CUDA version cannot be "
                f"read: {driver.error or 'neither libcuda nor nvidia-smi answers'}")
    if driver.cuda[0] < OLDEST:
        return (f"the NVIDIA driver runs CUDA {driver.cuda_text()}; CuPy's wheels need CUDA {OLDEST} or newer: "
                f"update the driver")
    return None


@dataclass(frozen=True)
class Choice:
    """The extra to install (None: none) and one line saying why."""

    extra: str | None
    reason: str


def choose(driver: Driver, forced: str = "") -> Choice:
    """The CUDA extra for ``driver``; ``forced`` is MMAD_CUDA's value (12, 13, none; empty: read the driver)."""
    forced = forced.strip().lower()
    if forced == "none":
        return Choice(None, "MMAD_CUDA=none: the cuda backend's packages are not installed")
    if forced:
        if not forced.isdigit() or int(forced) not in EXTRAS:
            raise ValueError(f"MMAD_CUDA={forced!r}: use {', '.join(map(str, EXTRAS))} or none")
        major = int(forced)
        return Choice(EXTRAS[major], f"MMAD_CUDA={major}: installing the {EXTRAS[major]} extra "
                                     f"({cupy_package(major)}, nvmath-python)")
    why_not = missing_piece(driver)
    if why_not is not None:
        return Choice(None, f"the cuda backend is not installed: {why_not} (MMAD_CUDA=12 or 13 installs it anyway)")
    major = major_for(driver.cuda)
    gpus = "" if driver.gpus is None else f", {driver.gpus} GPU{'s' * (driver.gpus != 1)}"
    return Choice(EXTRAS[major], f"NVIDIA driver for CUDA {driver.cuda_text()}{gpus}: installing the "
                                 f"{EXTRAS[major]} extra ({cupy_package(major)}, nvmath-python)")


def cuda_unavailable_reason(driver: Driver, problem: str, cupy_missing: bool = False,
                            cupy_cuda: int | None = None) -> str:
    """The cuda probe's reason: the first missing piece of driver, GPU, a driver new enough for
    CuPy's CUDA, CuPy itself. ``problem``: what failed (CuPy's import, the device query);
    ``cupy_missing``: CuPy is not installed; ``cupy_cuda``: the CUDA major CuPy was built for."""
    why_not = missing_piece(driver)
    if why_not is not None:
        return why_not
    extra = EXTRAS[major_for(driver.cuda)]
    if cupy_missing:
        return (f"CuPy is not installed (the driver runs CUDA {driver.cuda_text()}): `bash scripts/setup.sh` "
                f"installs it for this driver, or `pip install -e '.[{extra}]'`")
    if cupy_cuda is not None and cupy_cuda > driver.cuda[0]:
        return (f"CuPy is built for CUDA {cupy_cuda} ({cupy_package(cupy_cuda)}), newer than this driver's "
                f"CUDA {driver.cuda_text()}: update the driver, or `pip uninstall {cupy_package(cupy_cuda)}` "
                f"and `pip install -e '.[{extra}]'`")
    return problem


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["extra"]:
        print("usage: python -m mmad.install extra", file=sys.stderr)
        return 2
    try:
        choice = choose(read_driver(), os.environ.get("MMAD_CUDA", ""))
    except ValueError as exc:
        print(f"setup: {exc}", file=sys.stderr)
        return 2
    print(f"setup: {choice.reason}", file=sys.stderr)
    if choice.extra:
        print(choice.extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
