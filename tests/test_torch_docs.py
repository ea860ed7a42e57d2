"""docs/torch.md runs as written: its ```python blocks, in order, in one fresh process (they
build on each other) on the CPU here; the NeRF-like loop's loss falls and the second block's
checks print true. Its ```bash commands are checked to parse (their options exist: ``--help``
appended), not run: they are the GPU host's or minutes long on a CPU."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install mmad[torch])")

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "torch.md").read_text(encoding="utf-8")
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)


def blocks(lang: str) -> list[str]:
    return [code for kind, code in BLOCK.findall(DOC) if kind == lang]


def test_python_blocks_run_as_written(tmp_path):
    code = "\n".join(blocks("python"))
    assert "NetworkWithInputEncoding" in code
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": str(Path(sys.executable).parent),
                               "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.2 * losses[0], done.stdout
    assert "finite: True" in done.stdout and "reloaded: True" in done.stdout, done.stdout
    assert (tmp_path / "nerf.pt").is_file()


@pytest.mark.parametrize("command", [line for code in blocks("bash") for line in code.strip().splitlines()])
def test_bash_commands_parse(command):
    from mmad.cli import main

    argv = shlex.split(command)
    assert argv[0] == "mmad"
    with pytest.raises(SystemExit) as exit_:
        main(argv[1:] + ["--help"])
    assert exit_.value.code == 0
