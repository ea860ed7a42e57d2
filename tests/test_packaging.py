"""Both an editable install and a built wheel import as ``mmad.*`` and find the shaders."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import mmad.shaders

ROOT = Path(__file__).resolve().parents[1]
SOURCE_SHADERS = sorted(str(p.relative_to(ROOT / "mmad" / "shaders")) for p in (ROOT / "mmad" / "shaders").glob("*/*")
                        if p.suffix in (".comp", ".glsl", ".wgsl", ".cu", ".cuh"))

CHECK = """
import json, sys, mmad, mmad.backends.cpu, mmad.server, mmad.shaders
found = [p for d in ("glsl", "wgsl", "cuda") for p in mmad.shaders.list_sources(d)]
text = {p: len(mmad.shaders.read_source(p)) for p in found}
print(json.dumps({"file": mmad.__file__, "shaders": sorted(found), "empty": [p for p, n in text.items() if not n]}))
"""


def test_import_paths_are_file_paths():
    import mmad.backends.cuda.mma
    import mmad.bench
    import mmad.server

    assert Path(mmad.server.__file__).parent == ROOT / "mmad" / "server"
    assert Path(mmad.backends.cuda.mma.__file__) == ROOT / "mmad" / "backends" / "cuda" / "mma.py"
    setuptools_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package" "-dir" not in setuptools_config  # no folder mapped onto another import name


def test_a_clone_imports_without_installing(tmp_path):
    """``python -c "import mmad.backends.cuda"`` from the repository root, no install (CuPy absent is fine)."""
    code = "import mmad.backends.cuda, mmad.server.app; print(mmad.backends.cuda.__file__)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(ROOT / "mmad" / "backends" / "cuda" / "__init__.py")


def test_editable_install_finds_every_shader():
    if not SOURCE_SHADERS:
        pytest.skip("no shader sources in the tree yet")
    found = [p for d in ("glsl", "wgsl", "cuda") for p in mmad.shaders.list_sources(d)]
    assert sorted(found) == SOURCE_SHADERS


def test_built_wheel_imports_and_finds_every_shader(tmp_path):
    # built from a copy of what git tracks: setuptools reuses an in-tree build/ folder, whose stale
    # files would otherwise land in the wheel and hide (or fake) a difference
    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        if (ROOT / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, source / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("mmad-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mmad/backends/cpu.py" in names and "mmad/server/__init__.py" in names
    assert not any(n.startswith(("backends/", "server/", "tests/")) for n in names), "bare top-level packages leaked"
    # the wheel's package files mirror the repository's mmad/ folder
    in_repo = {rel for rel in tracked.decode().split("\0") if rel.startswith("mmad/")}
    in_wheel = {n for n in names if n.startswith("mmad/")}
    assert in_wheel == in_repo, (sorted(in_repo - in_wheel), sorted(in_wheel - in_repo))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    import json
    doc = json.loads(proc.stdout)
    assert doc["file"].startswith(str(target))
    assert doc["shaders"] == SOURCE_SHADERS and not doc["empty"]
