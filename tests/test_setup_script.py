"""scripts/setup.sh installs once: a re-run (every scripts/start.sh) skips pip when its stamp
matches, and installs again when pyproject.toml, the client's, constraints.txt, the script, the CUDA
extra or the torch index change, for --dev after a plain install, and with MMAD_SETUP_FORCE=1. pip is
a stand-in that logs its calls; ``python -m mmad.install`` (the CUDA choice) is the real one, reading
a stand-in nvidia-smi. scripts/apt-get-wait.sh waits for apt's lock (apt-get a stand-in too)."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmad.install import LIBCUDA

REPO = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/sh
case "$1 $2" in
  "-m mmad.install") exec {python} "$@" ;;
esac
case "$1" in
  -c) echo 3.11.2 ;;
  --version) echo "Python 3.11.2" ;;
  *) echo "$*" >> "$(dirname "$0")/../../pip.log" ;;
esac
"""


@pytest.fixture
def clone(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "client").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copy(REPO / "constraints.txt", tmp_path / "constraints.txt")
    shutil.copy(REPO / "client" / "pyproject.toml", tmp_path / "client" / "pyproject.toml")
    (tmp_path / "mmad").mkdir()
    for name in ("__init__.py", "install.py"):
        shutil.copy(REPO / "mmad" / name, tmp_path / "mmad" / name)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    (bin_dir / "mmad").write_text("#!/bin/sh\necho mmad 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return tmp_path


def run_setup(clone: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    # MMAD_CUDA=none unless a test says otherwise: the pip lines must not follow this host's driver
    return subprocess.run(["bash", "scripts/setup.sh", *args], cwd=clone, capture_output=True, text=True,
                          env={**os.environ, "MMAD_SKIP_APT": "1", "MMAD_CUDA": "none", **env}, timeout=60)


def new_installs(clone: Path, *args: str, **env: str) -> list[str]:
    """Run setup.sh; the pip install lines it logged."""
    log = clone / "pip.log"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    proc = run_setup(clone, *args, **env)
    assert proc.returncode == 0, proc.stderr
    lines = log.read_text().splitlines()[before:] if log.exists() else []
    return [line for line in lines if line.startswith("-m pip install") and "--upgrade pip" not in line]


def setup(clone: Path, *args: str, **env: str) -> int:
    """Run setup.sh; the number of pip installs of mmad it made."""
    return sum("-e ." in line for line in new_installs(clone, *args, **env))


def extras(line: str) -> set[str]:
    return set(re.search(r'-e \.\[([^\]]*)\]', line)[1].split(","))


def test_pip_runs_once_until_something_changes(clone):
    assert setup(clone) == 1
    assert setup(clone) == 0
    assert setup(clone, "--dev") == 1  # the test tools are not in a plain install
    assert setup(clone, "--dev") == 0
    assert setup(clone) == 0  # a --dev install holds everything a plain one does
    with open(clone / "pyproject.toml", "a") as f:
        f.write("\n# a new dependency\n")
    assert setup(clone) == 1
    assert setup(clone, MMAD_SETUP_FORCE="1") == 1
    with open(clone / "constraints.txt", "a") as f:
        f.write("numpy==1.26.4\n")  # a changed pin installs again
    assert setup(clone) == 1


def test_pip_installs_at_the_constrained_versions(clone):
    setup(clone, "--dev")
    installs = [line for line in (clone / "pip.log").read_text().splitlines() if "install" in line and "-e" in line]
    assert installs and all("-c constraints.txt" in line for line in installs)


def test_a_stamp_of_other_files_installs_again(clone):
    (clone / ".venv" / ".mmad-setup").write_text("runtime something-else\n")
    assert setup(clone) == 1


def test_the_cuda_extra_follows_mmad_cuda_and_a_change_installs_again(clone):
    (line,) = new_installs(clone, MMAD_CUDA="12")
    assert extras(line) == {"vulkan", "wgpu", "cuda12"}
    assert setup(clone, MMAD_CUDA="12") == 0
    (line,) = new_installs(clone, MMAD_CUDA="13")
    assert extras(line) == {"vulkan", "wgpu", "cuda13"}
    (line,) = new_installs(clone, MMAD_CUDA="none")
    assert extras(line) == {"vulkan", "wgpu"}
    (line,) = new_installs(clone, "--dev", MMAD_CUDA="12")
    assert extras(line) == {"vulkan", "wgpu", "cuda12", "export", "dev"}


def test_an_unknown_mmad_cuda_stops_setup_saying_what_it_takes(clone):
    proc = run_setup(clone, MMAD_CUDA="11")
    assert proc.returncode != 0
    assert "MMAD_CUDA='11': use 12, 13 or none" in proc.stderr
    assert not (clone / "pip.log").exists() or "-e ." not in (clone / "pip.log").read_text()


def libcuda_loads() -> bool:
    try:
        ctypes.CDLL(LIBCUDA)
    except OSError:
        return False
    return True


SMI_HEADER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 575.51.03              Driver Version: 575.51.03      CUDA Version: {cuda}     |
+-----------------------------------------+------------------------+----------------------+
"""


@pytest.mark.skipif(libcuda_loads(), reason="this host's libcuda answers before nvidia-smi is asked")
@pytest.mark.parametrize("cuda, expected", [("12.9", "cuda12"), ("13.0", "cuda13"), ("13.2", "cuda13"),
                                            ("11.8", None)])
def test_the_driver_that_nvidia_smi_shows_picks_the_extra(clone, tmp_path, cuda, expected):
    tools = tmp_path / "tools"
    tools.mkdir()
    smi = tools / "nvidia-smi"
    header = SMI_HEADER.format(cuda=cuda)
    smi.write_text(f"""#!/bin/sh
if [ "$1" = -L ]; then echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"; else cat <<'END'
{header}END
fi
""")
    smi.chmod(0o755)
    env = {"MMAD_CUDA": "", "PATH": f"{tools}:{os.environ['PATH']}"}
    proc = run_setup(clone, **env)
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in (clone / "pip.log").read_text().splitlines() if "-e ." in line]
    assert extras(line) == {"vulkan", "wgpu"} | ({expected} if expected else set())
    if expected:
        assert f"NVIDIA driver for CUDA {cuda}, 1 GPU: installing the {expected} extra" in proc.stderr
    else:
        assert f"the NVIDIA driver runs CUDA {cuda}; CuPy's wheels need CUDA 12 or newer" in proc.stderr


def test_torch_comes_from_mmad_torch_index_at_the_pinned_version(clone):
    pin = next(line for line in (clone / "constraints.txt").read_text().splitlines() if line.startswith("torch=="))
    lines = new_installs(clone, "--dev", MMAD_TORCH_INDEX="https://example.invalid/whl/cpu")
    assert lines[0] == f"-m pip install -q --no-deps --index-url https://example.invalid/whl/cpu {pin}"
    assert "-e ." in lines[1] and "--index-url" not in lines[1]
    # without it torch is left to the main install and its index; a change of index installs again
    lines = new_installs(clone, "--dev", MMAD_TORCH_INDEX="")
    assert len(lines) == 1 and "--index-url" not in lines[0]


def test_constraints_pin_public_versions():
    """A local label (torch's +cpu) is hosted only by the index that built it: setup elsewhere
    would fail. scripts/constraints.py writes the public version, which pip matches to the build."""
    text = (REPO / "constraints.txt").read_text()
    pins = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert pins and not [p for p in pins if "+" in p]
    proc = subprocess.run([sys.executable, "scripts/constraints.py"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "+" not in proc.stdout
    from importlib.metadata import PackageNotFoundError, version
    try:
        installed = version("torch")
    except PackageNotFoundError:
        return
    assert f"torch=={installed.split('+')[0]}" in proc.stdout.splitlines()


FAKE_APT = """#!/bin/sh
n=$(cat "{state}" 2>/dev/null || echo 0); echo $((n + 1)) > "{state}"
echo "apt-get $*" >> "{log}"
if [ "$n" -lt "{locked}" ]; then
  echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 4242 (apt-get)" >&2; exit 100
fi
"""


def fake_apt(tmp_path: Path, locked: int) -> tuple[Path, Path]:
    tools = tmp_path / "apt-tools"
    tools.mkdir()
    log = tmp_path / "apt.log"
    (tools / "apt-get").write_text(FAKE_APT.format(state=tmp_path / "calls", log=log, locked=locked))
    (tools / "apt-get").chmod(0o755)
    return tools, log


def test_apt_waits_for_another_package_managers_lock(tmp_path):
    tools, log = fake_apt(tmp_path, locked=2)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "apt-get-wait.sh"), "install", "-y", "curl"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "MMAD_APT_LOCK_TIMEOUT": "30"})
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert calls == ["apt-get -o DPkg::Lock::Timeout=30 install -y curl"] * 3
    assert proc.stderr.count("waiting up to 30 s") == 1


def test_apt_gives_up_after_the_timeout_with_apts_words(tmp_path):
    tools, log = fake_apt(tmp_path, locked=1000)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "apt-get-wait.sh"), "update"], capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "MMAD_APT_LOCK_TIMEOUT": "1"})
    assert proc.returncode == 100
    assert "Could not get lock /var/lib/apt/lists/lock" in proc.stderr
    assert 1 < len(log.read_text().splitlines()) < 5
