"""``mmad probe`` and backend selection: PASS/FAIL rows, reasons, MMAD_BACKEND rules, speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mmad.backends import choose, probe_all, select
from mmad.errors import BackendUnavailable, SpecError


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "mmad.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=60)


def test_probe_table_lists_every_backend():
    proc = run_cli("probe")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:3] == ["backend", "variant", "status"]
    backends = {line.split()[0] for line in lines[1:-2]}
    assert backends == {"cuda", "vulkan", "wgpu", "cpu"}
    assert lines[-2].startswith("selected: ")
    assert any(line.startswith("cpu") and "PASS" in line for line in lines)


def test_probe_json_and_every_fail_row_has_a_reason():
    proc = run_cli("probe", "--json")
    doc = json.loads(proc.stdout)
    rows = doc["rows"]
    assert {r["backend"] for r in rows} == {"cuda", "vulkan", "wgpu", "cpu"}
    for r in rows:
        assert r["available"] or r["reason"], r


def test_probe_in_process_never_raises_and_offers_the_cpu():
    # how long a probe takes is printed by `mmad probe` (its last line), not asserted here: a
    # loaded machine makes it slower, never wrong
    rows = probe_all()
    assert any(r.backend == "cpu" and r.available for r in rows)


def test_unknown_backend_is_an_error_listing_valid_ones():
    proc = run_cli("probe", env={"MMAD_BACKEND": "metal"})
    assert proc.returncode == 2
    assert "unknown backend 'metal'; valid: cuda, vulkan, wgpu, cpu" in proc.stderr
    with pytest.raises(SpecError, match="valid: cuda, vulkan, wgpu, cpu"):
        select("opencl")


def test_forced_unavailable_backend_is_an_error_with_the_reason():
    cuda_rows = [r for r in probe_all(["cuda"]) if r.available]
    if cuda_rows:
        pytest.skip("CUDA is available here, so forcing it cannot fail")
    with pytest.raises(BackendUnavailable) as info:
        select("cuda")
    assert info.value.reason  # e.g. "CuPy is not installed" or "no CUDA device"


def test_forced_variant_that_does_not_exist():
    with pytest.raises(SpecError, match="no variant 'tensor'"):
        select("cpu:tensor")


def test_forced_cpu_and_auto_selection():
    backend, row = select("cpu")
    assert (row.backend, row.available) == ("cpu", True)
    backend, row = select(None)
    assert row.available and not row.software


def test_demo_command_trains_and_reports(tmp_path):
    proc = run_cli("demo", "--steps", "60", "--batch", "512", env={"MMAD_BACKEND": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert "backend: cpu:numpy" in proc.stdout and "M samples/s" in proc.stdout
    losses = [float(line.split()[3]) for line in proc.stdout.splitlines() if line.startswith("step")]
    assert losses[-1] < losses[0]


def test_probe_marks_the_backend_the_daemon_uses():
    _, row = select("")  # automatic, whatever MMAD_BACKEND says here
    proc = run_cli("probe", env={"MMAD_BACKEND": ""})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:4] == ["backend", "variant", "status", "selected"]
    marked = [line.split()[:4] for line in lines[1:-2] if line.split()[3:4] == ["*"]]
    assert marked == [[row.backend, row.variant, "PASS", "*"]]
    assert lines[-2].startswith(f"selected: {row.backend}:{row.variant} on ")
    doc = json.loads(run_cli("probe", "--json", env={"MMAD_BACKEND": ""}).stdout)
    assert doc["selected"] == {"backend": row.backend, "variant": row.variant}
    assert [(r["backend"], r["variant"]) for r in doc["rows"] if r["selected"]] == [(row.backend, row.variant)]
    assert doc["summary"].startswith(f"selected: {row.backend}:{row.variant}")


def test_probe_marks_a_forced_backend_or_says_it_cannot_run():
    proc = run_cli("probe", "--json", env={"MMAD_BACKEND": "cpu"})
    doc = json.loads(proc.stdout)
    assert doc["selected"] == {"backend": "cpu", "variant": "numpy"}
    assert "forced by MMAD_BACKEND" in doc["summary"]
    if any(r.available for r in probe_all(["cuda"])):
        return
    proc = run_cli("probe", env={"MMAD_BACKEND": "cuda"})
    assert proc.returncode == 0, proc.stderr
    assert not any(line.split()[3:4] == ["*"] for line in proc.stdout.splitlines()[1:-2])
    assert "MMAD_BACKEND=cuda cannot run here" in proc.stdout


def test_choose_agrees_with_select():
    rows = probe_all()
    assert choose(rows, None) == select("")[1]
    assert choose(rows, ("cpu", None)) == select("cpu")[1]


def test_bench_help_mentions_service():
    proc = run_cli("bench", "--help")
    assert proc.returncode == 0 and "--service" in proc.stdout


def cuda_reasons(monkeypatch, driver) -> set[str]:
    import mmad.backends.cuda as cuda_backend

    monkeypatch.setattr(cuda_backend, "read_driver", lambda: driver)
    return {row.reason for row in cuda_backend.CudaBackend().probe()}


def test_the_cuda_reason_names_the_missing_piece(monkeypatch):
    """No driver, no GPU, a driver too old for any CuPy wheel, CuPy absent (with the command)."""
    import importlib.util

    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: the missing-CuPy reasons cannot show")
    from mmad.install import Driver

    assert cuda_reasons(monkeypatch, Driver()) == {
        "no NVIDIA driver is installed (no /proc/driver/nvidia, libcuda.so.1 or nvidia-smi)"}
    assert cuda_reasons(monkeypatch, Driver(("libcuda",), (12, 4), 0)) == {"the NVIDIA driver (CUDA 12.4) sees no GPU"}
    (old,) = cuda_reasons(monkeypatch, Driver(("nvidia-smi",), (11, 8), 1))
    assert "CUDA 11.8; CuPy's wheels need CUDA 12 or newer: update the driver" in old
    assert cuda_reasons(monkeypatch, Driver(("libcuda",), (13, 0), 1)) == {
        "CuPy is not installed (the driver runs CUDA 13.0): `bash scripts/setup.sh` installs it for this driver, "
        "or `pip install -e '.[cuda13]'`"}


def test_a_cupy_newer_than_the_driver_is_named_with_the_wheel_to_take(monkeypatch):
    """CuPy for CUDA 13 on a CUDA 12 driver: the device query fails; the reason says which wheel fits."""
    import types

    from mmad.install import Driver

    def no_device():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")

    runtime = types.SimpleNamespace(getDeviceCount=no_device, runtimeGetVersion=lambda: 13000)
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    (reason,) = cuda_reasons(monkeypatch, Driver(("libcuda",), (12, 8), 1))
    assert reason.startswith("CuPy is built for CUDA 13 (cupy-cuda13x), newer than this driver's CUDA 12.8")
    assert "`pip install -e '.[cuda12]'`" in reason
    # a driver new enough: the device error itself
    (reason,) = cuda_reasons(monkeypatch, Driver(("libcuda",), (13, 0), 1))
    assert reason.startswith("no CUDA device is usable: cudaErrorInsufficientDriver")


def test_this_machines_cuda_reason_is_not_a_bare_import_error():
    rows = [r for r in probe_all(["cuda"]) if not r.available]
    if not rows:
        pytest.skip("CUDA runs here")
    assert not rows[0].reason.startswith("CuPy is not installed (No module named")
