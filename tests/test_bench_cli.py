"""``mmad bench``: checked, timed rows on the cpu backend; refusals before timing; clear option
errors; the shared timer and floor; the GPU-only paths importable without CuPy or PyTorch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from oracle import wrong_cpu_forward

from mmad import cli
from mmad.backends import timing
from mmad.bench import kernels
from mmad.errors import MMADError
from mmad.spec import bench_spec

ENV = {**os.environ, "MMAD_BACKEND": ""}


def test_bench_writes_checked_rows_as_json_and_markdown(tmp_path):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    proc = subprocess.run([sys.executable, "-m", "mmad.cli", "bench", "--backend", "cpu", "--models", "S",
                           "--rows", "2048", "--repeats", "2", "--peer", "none", "--json", str(out),
                           "--markdown", str(md)], capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["rows"] == 2048 and doc["errors"] == [] and doc["peer"] == []
    floor = doc["floor"]["cpu"]
    assert floor["copy_bytes_per_s"] > 0 and floor["gemm_flops_per_s"] > 0
    assert [(r["model"], r["backend"], r["mode"], r["io"]) for r in doc["results"]] == [
        ("S", "cpu:numpy", "forward", "fp16"), ("S", "cpu:numpy", "train", "fp32")]
    for row in doc["results"]:
        assert row["rows"] == 2048 and row["checked_io"] == "fp16"
        assert row["rel_err_vs_float64"] < 1e-3  # fp32 arithmetic; fp16 inputs and outputs
        assert row["samples_per_s"] > 0 and row["seconds"] > 0
        # not bounded by 100 here: at 2048 rows the data sits in cache, and the ceilings are measured
        # on a machine shared with other work
        assert row["pct_floor"] > 0 and row["floor_seconds"] > 0
        assert row["peer"] is None and row["x_peer"] is None
    table = md.read_text()
    assert "| S | cpu:numpy | forward | fp16 | 2048 |" in table and "Peer: none" in table
    assert "| S | cpu:numpy | forward |" in proc.stdout


def test_module_entry_point_is_mmad_bench():
    proc = subprocess.run([sys.executable, "-m", "mmad.bench", "--models", "XL", "--peer", "none"],
                          capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 2 and "unknown benchmark model 'XL'; allowed: S, M, L, W" in proc.stderr


def test_wrong_output_is_refused_before_timing(tmp_path, monkeypatch, capsys):
    def timed(*a, **kw):
        raise AssertionError("a model whose output failed the check was timed")

    wrong_cpu_forward(monkeypatch, 1.5)
    monkeypatch.setattr(kernels, "_measure_host", timed)
    monkeypatch.setenv("MMAD_BACKEND", "")
    out = tmp_path / "r.json"
    status = cli.main(["bench", "--backend", "cpu", "--models", "S", "--rows", "512", "--repeats", "1",
                       "--peer", "none", "--json", str(out)])
    assert status == 2
    assert "differs from the float64 oracle" in capsys.readouterr().err
    doc = json.loads(out.read_text())
    assert doc["results"] == [] and len(doc["errors"]) == 1 and "not timed" in doc["errors"][0]


@pytest.mark.parametrize("argv, message", [
    (["--backend", "foo"], "--backend: unknown backend 'foo'; valid: cuda, vulkan, wgpu, cpu"),
    (["--backend", "cpu:simt"], "--backend: backend 'cpu' has no variant 'simt'; valid: numpy"),
    (["--backend", "cpu", "--rows", "0"], "--rows: must be at least 1; got 0"),
    (["--backend", "cpu", "--repeats", "0"], "--repeats: must be at least 1; got 0"),
    (["--backend", "cpu", "--models", "S,XL"], "unknown benchmark model 'XL'; allowed: S, M, L, W"),
    (["--backend", "wgpu", "--io", "fp16"], "--io: the wgpu backend's device arrays are float32"),
    (["--backend", "cpu", "--profile"], "--profile: per-op GPU times exist for cuda and vulkan only"),
])
def test_option_errors_are_one_clear_line(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("MMAD_BACKEND", "")
    assert cli.main(["bench", *argv, "--peer", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmad: error: ") and message in err and "Traceback" not in err


def test_vulkan_rows_time_fp16_device_io(tmp_path, monkeypatch):
    """The vulkan backend's forward rows are fp16 in and out on the device by default (the cuda
    rows' I/O), checked against the float64 oracle in that I/O type before they are timed."""
    vulkan = pytest.importorskip("mmad.backends.vulkan", reason="the vulkan Python package is not installed")
    backend = vulkan.VulkanBackend()
    try:
        row = {r.variant: r for r in backend.probe()}["simt"]
    finally:
        backend.close()
    if not row.available:
        pytest.skip(f"no usable Vulkan device: {row.reason}")
    monkeypatch.setenv("MMAD_BACKEND", "")
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--backend", "vulkan:simt", "--models", "S", "--rows", "512", "--repeats", "1",
                     "--mode", "forward", "--peer", "none", "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["io"] == "fp16" and result["checked_io"] == "fp16"
    assert result["rel_err_vs_float64"] <= kernels.FP16_TOLERANCE


def test_peer_torch_without_torch_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    assert cli.main(["bench", "--backend", "cpu", "--models", "S", "--peer", "torch"]) == 2
    assert "--peer torch needs PyTorch" in capsys.readouterr().err


def test_median_timer_host_and_device_clocks():
    calls = []
    assert timing.median_seconds(lambda: calls.append(1), 5, warmup=2) >= 0
    assert len(calls) == 7
    synced = []
    timing.median_seconds(lambda: None, 3, sync=lambda: synced.append(1), warmup=1)
    assert len(synced) == 4  # after the warm-up, then after every sample
    samples = iter([0.3, 0.1, 0.2, 9.0])
    assert timing.median_seconds(lambda: None, 3, clock="gpu", gpu_seconds=lambda: next(samples),
                                 warmup=0, calls=2) == pytest.approx(0.1)
    made = []
    timing.median_seconds(timing.back_to_back(lambda: made.append(1), 4), 2, warmup=1, calls=4)
    assert len(made) == 12  # (1 warm-up + 2 samples) x 4 back-to-back calls
    with pytest.raises(ValueError, match="clock"):
        timing.median_seconds(lambda: None, 1, clock="sundial")
    with pytest.raises(ValueError, match="gpu_seconds"):
        timing.median_seconds(lambda: None, 1, clock="gpu")


def test_floor_is_the_larger_of_bytes_and_flops():
    spec = bench_spec("S")  # 32 in, 16 out
    flops = spec.flops_per_sample()
    memory_bound = {"copy_bytes_per_s": 1.0, "gemm_flops_per_s": 1e30}
    assert timing.floor_seconds(spec, 10, memory_bound, False, 2) == pytest.approx(10 * 2 * (32 + 16))
    assert timing.floor_seconds(spec, 10, memory_bound, True, 4) == pytest.approx(10 * 4 * (32 + 32))
    compute_bound = {"copy_bytes_per_s": 1e30, "gemm_flops_per_s": 1.0}
    assert timing.floor_seconds(spec, 10, compute_bound, False, 2) == pytest.approx(10 * flops)
    assert timing.floor_seconds(spec, 10, compute_bound, True, 2) == pytest.approx(30 * flops)
    cpu = timing.measure_ceilings(on_gpu=False, repeats=3)
    assert cpu["copy_bytes_per_s"] > 0 and cpu["gemm_flops_per_s"] > 0 and "NumPy" in cpu["gemm_type"]


def test_gpu_floor_without_torch_or_cupy_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(MMADError, match="PyTorch or CuPy"):
        timing.measure_ceilings(on_gpu=True)


def test_gpu_paths_import_without_cupy_or_torch():
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['torch'] = None; sys.modules['nvmath'] = None\n"
            "import mmad.bench.kernels, mmad.bench.cuda_tools, mmad.bench.daemon_check, mmad.bench.torch_peer\n"
            "import mmad.bench.hashgrid\n"
            "from mmad import cli\n"
            "sys.exit(cli.main(['bench', '--run-forward', 'S:mma', '--rows', '64']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
    assert proc.returncode == 2, proc.stderr
    assert "needs the cuda backend's stack" in proc.stderr and "Traceback" not in proc.stderr


def test_daemon_check_on_the_cpu_backend(monkeypatch):
    from mmad.bench.daemon_check import daemon_check

    monkeypatch.setenv("MMAD_HTTP", "h11")  # uvicorn's own parser: the check is about the path, not the parser
    ok, lines = daemon_check("cpu")
    assert ok, lines
    assert lines[0].startswith("daemon selected cpu:numpy") and sum(line.startswith("PASS") for line in lines) == 3
