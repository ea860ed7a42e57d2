"""``mmad demo --image``: the hash-grid image config fits a generated picture on the cpu backend,
on wgpu (its CPU adapter here) and on vulkan (lavapipe here), small enough for CI; it writes both
PNGs and prints the PSNR it reached; a backend that cannot run it is refused with the reason."""

from __future__ import annotations

import re

import pytest

from mmad.cli import main

# measured: 32.6 dB for this run (32 × 32 picture, 2^10 table, 60 steps of all 1,024 pixels, seed 1337)
PSNR_BAR_DB = 28.0


@pytest.mark.parametrize("backend", ["cpu", "wgpu", "vulkan"])
def test_demo_image_fits_the_picture_and_writes_pngs(tmp_path, capsys, backend):
    if backend != "cpu":
        pytest.importorskip(backend, reason=f"the {backend} bindings are not installed: that backend cannot run here")
    assert main(["demo", "--image", "--size", "32", "--steps", "60", "--batch", "1024",
                 "--log2-hashmap-size", "10", "--out", str(tmp_path), "--backend", backend]) == 0
    out = capsys.readouterr().out
    assert f"{backend}:" in out
    psnr = float(re.search(r"final PSNR ([0-9.]+) dB", out).group(1))
    assert psnr > PSNR_BAR_DB, out
    for name in ("demo-image-reconstruction.png", "demo-image-curve.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_image_on_a_backend_that_cannot_run_it_says_why(tmp_path, capsys):
    """cuda:cublaslt: without CuPy or a GPU (CI) it is unavailable, with them it has no grid kernels
    (grids run on cuda's mma variants); either way the demo stops with the reason, naming the backend."""
    assert main(["demo", "--image", "--size", "8", "--steps", "1", "--out", str(tmp_path), "--backend",
                 "cuda:cublaslt"]) == 2
    err = capsys.readouterr().err
    assert "mmad demo --image --backend cuda:cublaslt:" in err and ("cublaslt" in err.split(":", 2)[2])
