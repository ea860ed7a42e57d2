"""scripts/setup.sh installs once: a re-run (every scripts/start.sh) skips pip when its stamp
matches, and installs again when pyproject.toml, the client's, constraints.txt or the script change, for --dev
after a plain install, and with MMAD_SETUP_FORCE=1. pip is a stand-in that logs its calls."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/sh
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
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python").write_text(FAKE_PYTHON)
    (bin_dir / "mmad").write_text("#!/bin/sh\necho mmad 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return tmp_path


def setup(clone: Path, *args: str, **env: str) -> int:
    """Run setup.sh; the number of pip installs it made."""
    log = clone / "pip.log"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    proc = subprocess.run(["bash", "scripts/setup.sh", *args], cwd=clone, capture_output=True, text=True,
                          env={**os.environ, "MMAD_SKIP_APT": "1", **env}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    after = len(log.read_text().splitlines()) if log.exists() else 0
    return sum("install" in line and "-e" in line for line in log.read_text().splitlines()[before:after])


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
