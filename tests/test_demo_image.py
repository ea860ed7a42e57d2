"""``mmad demo --image``: the hash-grid image config fits a generated picture on the cpu backend
and on wgpu (its CPU adapter here), small enough for CI; it writes both PNGs and prints the PSNR
it reached; a backend without grid kernels is refused with the reason."""

from __future__ import annotations

import re

import pytest

from mmad.cli import main

# measured: 32.6 dB for this run (32 × 32 picture, 2^10 table, 60 steps of all 1,024 pixels, seed 1337)
PSNR_BAR_DB = 28.0


@pytest.mark.parametrize("backend", ["cpu", "wgpu"])
def test_demo_image_fits_the_picture_and_writes_pngs(tmp_path, capsys, backend):
    if backend == "wgpu":
        pytest.importorskip("wgpu", reason="wgpu is not installed: the wgpu backend cannot run here")
    assert main(["demo", "--image", "--size", "32", "--steps", "60", "--batch", "1024",
                 "--log2-hashmap-size", "10", "--out", str(tmp_path), "--backend", backend]) == 0
    out = capsys.readouterr().out
    assert f"{backend}:" in out
    psnr = float(re.search(r"final PSNR ([0-9.]+) dB", out).group(1))
    assert psnr > PSNR_BAR_DB, out
    for name in ("demo-image-reconstruction.png", "demo-image-curve.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_image_on_a_backend_without_grid_kernels_says_why(tmp_path, capsys):
    pytest.importorskip("vulkan", reason="the vulkan bindings are not installed: the vulkan backend cannot run here")
    assert main(["demo", "--image", "--size", "8", "--steps", "1", "--out", str(tmp_path), "--backend", "vulkan"]) == 2
    err = capsys.readouterr().err
    assert "HashGrid" in err and "vulkan" in err
