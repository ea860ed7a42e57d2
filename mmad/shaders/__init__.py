"""Kernel sources, shipped as package data and compiled at run time.

``glsl/`` (Vulkan compute, SIMT and cooperative-matrix), ``wgsl/`` (WebGPU), ``cuda/`` (NVRTC).
"""

from __future__ import annotations

from importlib import resources


def read_source(relative_path: str) -> str:
    """The text of a shader source, e.g. ``read_source("glsl/mlp_forward.comp")``."""
    return resources.files(__name__).joinpath(relative_path).read_text(encoding="utf-8")


def list_sources(folder: str) -> list[str]:
    """Relative paths of every source in one folder (``glsl``, ``wgsl`` or ``cuda``)."""
    root = resources.files(__name__).joinpath(folder)
    if not root.is_dir():
        return []
    return sorted(f"{folder}/{p.name}" for p in root.iterdir() if p.is_file())
