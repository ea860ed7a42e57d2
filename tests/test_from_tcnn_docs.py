"""docs/from-tcnn.md's code blocks, run as written, in order, in one folder, against a real daemon on
loopback (cpu backend): a later block uses the files an earlier one wrote (image.json, params.npy),
as a reader following the page would. ``localhost:8000`` becomes the test daemon's address.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DaemonProcess
from test_readme import environment

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "from-tcnn.md"
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)


def test_blocks_run_as_written(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (scripts/setup.sh --dev): mmad.torch's block needs it")
    blocks = BLOCK.findall(PAGE.read_text(encoding="utf-8"))
    assert [lang for lang, _ in blocks] == ["python", "bash", "python", "bash"], "the page's blocks changed: check them here"
    proc = DaemonProcess(tmp_path / "store").start()
    work = tmp_path / "reader"
    (work / "tests").mkdir(parents=True)
    (work / "tests" / "configs").symlink_to(REPO / "tests" / "configs")
    outputs = []
    try:
        for lang, code in blocks:
            code = code.replace("localhost:8000", f"127.0.0.1:{proc.port}")
            argv = ["bash", "-e", "-o", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
            run = subprocess.run(argv, capture_output=True, text=True, cwd=work, env=environment(proc), timeout=300)
            assert run.returncode == 0, f"{code}\n{run.stdout}\n{run.stderr}"
            outputs.append(run.stdout)
    finally:
        proc.stop()
    encoded, n_params = outputs[0].split()
    assert (int(encoded), int(n_params)) == (32, 714835), outputs[0]  # 16 levels × 2 features; weights, biases, the table
    created = json.loads(outputs[1])
    assert created["name"] == "image" and created["state"] == "READY", created
    assert outputs[2].split()[-1] == "True", outputs[2]  # the parameters got a gradient
    lines = outputs[3].strip().splitlines()
    assert lines[0].startswith("wrote weights.safetensors"), outputs[3]
    assert json.loads(lines[-1])["version"] == "2", outputs[3]  # the tcnn buffer served as a new version
