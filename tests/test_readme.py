"""The README's code blocks, run as written against a real daemon on loopback (cpu backend).

Every ```bash and ```python block of README.md is collected; ``localhost:8000`` becomes the test
daemon's address, and the blocks run in a shell or a Python process with the checkout's
``mmad`` and ``mmad_client`` importable (what ``pip install ./client`` in the venv gives a user).
The two set-up commands (scripts/start.sh, scripts/test.sh) are skipped: they install system
packages and start a daemon of their own.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DaemonProcess

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)
SETUP = ("scripts/start.sh", "scripts/test.sh")


def readme_blocks() -> list[tuple[str, str]]:
    return BLOCK.findall((REPO / "README.md").read_text())


def block_id(lang: str, code: str) -> str:
    first = next(line for line in code.splitlines()
                 if line.strip() and not line.startswith("#") and line != "import numpy as np")
    return f"{lang}: {first[:50]}"


def cases():
    out = []
    for lang, code in readme_blocks():
        marks = ()
        if any(s in code for s in SETUP):
            marks = pytest.mark.skip(reason="set-up command: installs system packages and starts its own daemon "
                                            "(scripts/test.sh is CI's entry point)")
        out.append(pytest.param(lang, code, id=block_id(lang, code), marks=marks))
    return out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    proc = DaemonProcess(tmp_path_factory.mktemp("readme") / "store").start()
    yield proc
    proc.stop()


def environment(daemon: DaemonProcess) -> dict[str, str]:
    """The user's venv, activated: the venv's bin first on PATH, the checkout's packages."""
    path = [str(REPO), str(REPO / "client"), os.environ.get("PYTHONPATH", "")]
    return {**daemon.env, "PYTHONPATH": os.pathsep.join(p for p in path if p),
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def run_block(daemon: DaemonProcess, lang: str, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    code = code.replace("localhost:8000", f"127.0.0.1:{daemon.port}")
    if lang == "bash":
        # `source .venv/bin/activate`: the venv these tests run in stands for the clone's .venv
        activate = Path(sys.executable).parent / "activate"
        if "source .venv/bin/activate" in code:
            if not activate.exists():
                pytest.skip(f"{sys.executable} is not in a venv, so there is no activate script to stand in")
            code = code.replace("source .venv/bin/activate", f"source {activate}")
        argv = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        argv = [sys.executable, "-c", code]
    return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=environment(daemon), timeout=300)


@pytest.mark.parametrize("lang,code", cases())
def test_readme_block(daemon, tmp_path, lang, code):
    if "tritonclient" in code:
        pytest.importorskip("tritonclient.http", reason="tritonclient is not installed (scripts/setup.sh --dev)")
    proc = run_block(daemon, lang, code, tmp_path)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    if "mmad probe" in code:
        assert re.search(r"^cpu\s+numpy\s+PASS", out, re.M) and "\nselected: " in out, out
    elif "curl" in code and "/infer" in code:
        doc = json.loads(out)
        assert doc["id"] == "q1" and doc["outputs"][0]["shape"] == [2, 3], doc
        assert all(math.isfinite(v) for v in doc["outputs"][0]["data"]), doc
    elif "tritonclient" in code:
        assert out.strip() == "(1024, 3)", out
    elif "mmad_client" in code:
        loss = float(out.split()[0])
        assert math.isfinite(loss) and loss < 0.2, out  # the field's variance is about 0.25
        assert out.count("[") >= 4, out  # the 4 inferred rows
    else:
        pytest.fail(f"a README block this test does not know how to check:\n{code}")


def test_every_block_is_collected():
    langs = [lang for lang, _ in readme_blocks()]
    assert langs.count("python") >= 2 and langs.count("bash") >= 3, langs
