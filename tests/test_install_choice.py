"""mmad/install.py: the NVIDIA driver read from libcuda or nvidia-smi (stand-ins here), the CUDA
extra scripts/setup.sh installs for it, and the missing piece the cuda probe names."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from mmad.install import (
    CUDA_ERROR_NO_DEVICE,
    Driver,
    Reading,
    choose,
    cuda_unavailable_reason,
    parse_smi,
    read_driver,
    read_libcuda,
    read_smi,
)

ROOT = Path(__file__).resolve().parents[1]

SMI = """Tue Dec  1 10:00:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.14              Driver Version: 550.54.14      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |
|   0  NVIDIA H100 80GB HBM3          On  |   00000000:19:00.0 Off |                    0 |
|   1  NVIDIA H100 80GB HBM3          On  |   00000000:3B:00.0 Off |                    0 |
+-----------------------------------------+------------------------+----------------------+
"""
SMI_L = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-8c3a5e4e-0000-0000-0000-000000000000)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-8c3a5e4e-0000-0000-0000-000000000001)
"""


def test_nvidia_smi_gives_the_cuda_version_and_the_gpus():
    assert parse_smi(SMI, SMI_L) == Reading((12, 4), 2)
    assert parse_smi(SMI.replace("12.4", "13.1"), SMI_L.splitlines()[0]) == Reading((13, 1), 1)
    # a driver without devices prints no table: nothing known of its CUDA, no GPU
    assert parse_smi("No devices were found\n", "No devices were found\n") == Reading(None, 0)
    assert parse_smi(SMI.replace("12.4", "N/A "), SMI_L).error == "nvidia-smi shows no CUDA version"


def test_read_smi_runs_the_tool_on_path_or_says_it_is_absent():
    calls = []

    def run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout=SMI_L if argv[1:] == ["-L"] else SMI, stderr="")

    assert read_smi(which=lambda name: None, run=run) is None and not calls
    assert read_smi(which=lambda name: f"/usr/bin/{name}", run=run) == Reading((12, 4), 2)
    assert calls == [["/usr/bin/nvidia-smi"], ["/usr/bin/nvidia-smi", "-L"]]

    def hangs(argv, **kwargs):
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])

    assert "nvidia-smi failed" in read_smi(which=lambda name: "/usr/bin/nvidia-smi", run=hangs).error


class FakeLibcuda:
    """cuDriverGetVersion / cuInit / cuDeviceGetCount as the driver answers them."""

    def __init__(self, version: int, init_rc: int = 0, gpus: int = 1):
        self.version, self.init_rc, self.gpus = version, init_rc, gpus

    def cuDriverGetVersion(self, out):
        out._obj.value = self.version
        return 0

    def cuInit(self, flags):
        return self.init_rc

    def cuDeviceGetCount(self, out):
        out._obj.value = self.gpus
        return 0


def loader(lib):
    def load(name):
        if lib is None:
            raise OSError(f"{name}: cannot open shared object file")
        return lib
    return load


def test_libcuda_gives_the_driver_version_and_the_gpus():
    assert read_libcuda(loader(None)) is None
    assert read_libcuda(loader(FakeLibcuda(12040, gpus=8))) == Reading((12, 4), 8)
    assert read_libcuda(loader(FakeLibcuda(13000))) == Reading((13, 0), 1)
    assert read_libcuda(loader(FakeLibcuda(12020, init_rc=CUDA_ERROR_NO_DEVICE))) == Reading((12, 2), 0)
    broken = read_libcuda(loader(FakeLibcuda(12020, init_rc=999)))
    assert broken.cuda == (12, 2) and broken.gpus is None and "cuInit failed with CUDA error 999" in broken.error


def test_libcuda_is_read_first_and_nvidia_smi_where_it_does_not_load(tmp_path):
    proc = tmp_path / "nvidia" / "version"
    proc.parent.mkdir()
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14\n")
    asked = []

    def smi():
        asked.append(1)
        return Reading((12, 4), 2)

    lib = read_driver(proc, libcuda=lambda: Reading((13, 0), 1), smi=smi)
    assert lib == Driver((str(proc.parent), "libcuda"), (13, 0), 1) and not asked
    assert read_driver(proc, libcuda=lambda: None, smi=smi) == Driver((str(proc.parent), "nvidia-smi"), (12, 4), 2)
    # the kernel module alone: a driver, but nothing to read its CUDA version from
    alone = read_driver(proc, libcuda=lambda: None, smi=lambda: None)
    assert alone.found_by == (str(proc.parent),) and alone.cuda is None
    assert read_driver(tmp_path / "absent", libcuda=lambda: None, smi=lambda: None) == Driver()


@pytest.mark.parametrize("cuda, extra", [((12, 0), "cuda12"), ((12, 9), "cuda12"), ((13, 0), "cuda13"),
                                         ((13, 2), "cuda13"), ((14, 0), "cuda13")])
def test_the_extra_is_the_one_for_the_drivers_cuda_major(cuda, extra):
    choice = choose(Driver(("libcuda",), cuda, 1))
    assert choice.extra == extra
    assert f"installing the {extra} extra (cupy-cuda{extra[4:]}x, nvmath-python)" in choice.reason


@pytest.mark.parametrize("driver, words", [
    (Driver(), "no NVIDIA driver is installed"),
    (Driver(("libcuda",), (12, 4), 0), "the NVIDIA driver (CUDA 12.4) sees no GPU"),
    (Driver(("/proc/driver/nvidia",), None, None), "its CUDA version cannot be read"),
    (Driver(("libcuda",), (11, 8), 1), "the NVIDIA driver runs CUDA 11.8; CuPy's wheels need CUDA 12 or newer"),
])
def test_no_extra_where_no_cupy_wheel_can_run_and_why(driver, words):
    choice = choose(driver)
    assert choice.extra is None
    assert words in choice.reason and "MMAD_CUDA=12 or 13 installs it anyway" in choice.reason


def test_mmad_cuda_overrides_the_driver():
    assert choose(Driver(), "12").extra == "cuda12"
    assert choose(Driver(), "13").extra == "cuda13"
    assert choose(Driver(("libcuda",), (13, 0), 1), "none").extra is None
    with pytest.raises(ValueError, match="use 12, 13 or none"):
        choose(Driver(), "cu12")


def test_the_probe_reason_names_the_missing_piece():
    cuda12 = Driver(("libcuda",), (12, 4), 1)
    assert cuda_unavailable_reason(Driver(), "x", cupy_missing=True).startswith("no NVIDIA driver is installed")
    assert "sees no GPU" in cuda_unavailable_reason(Driver(("libcuda",), (12, 4), 0), "x", cupy_missing=True)
    assert "update the driver" in cuda_unavailable_reason(Driver(("libcuda",), (11, 4), 1), "x", cupy_missing=True)
    missing = cuda_unavailable_reason(cuda12, "CuPy is not installed (No module named 'cupy')", cupy_missing=True)
    assert missing == ("CuPy is not installed (the driver runs CUDA 12.4): `bash scripts/setup.sh` installs it "
                       "for this driver, or `pip install -e '.[cuda12]'`")
    newer = cuda_unavailable_reason(cuda12, "no CUDA device is usable: cudaErrorInsufficientDriver", cupy_cuda=13)
    assert newer.startswith("CuPy is built for CUDA 13 (cupy-cuda13x), newer than this driver's CUDA 12.4")
    assert "pip uninstall cupy-cuda13x" in newer and "'.[cuda12]'" in newer
    # every piece in place: the failure itself is the reason
    assert cuda_unavailable_reason(cuda12, "no CUDA device is usable: boom", cupy_cuda=12) == \
        "no CUDA device is usable: boom"


def test_the_command_prints_the_extra_and_the_reason():
    proc = subprocess.run([sys.executable, "-m", "mmad.install", "extra"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "MMAD_CUDA": "13"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "cuda13\n" and proc.stderr.startswith("setup: MMAD_CUDA=13: installing the cuda13 extra")
    proc = subprocess.run([sys.executable, "-m", "mmad.install", "extra"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "MMAD_CUDA": "none"})
    assert proc.returncode == 0 and proc.stdout == ""
    proc = subprocess.run([sys.executable, "-m", "mmad.install"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr


def test_the_real_libcuda_reader_runs_here():
    """On this machine's real loader: a driver's libcuda is read, an absent one is None."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert read_libcuda() is None
        return
    reading = read_libcuda()
    assert reading is not None and reading.cuda is not None and reading.cuda[0] >= 10
