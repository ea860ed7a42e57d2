"""kill -9 during checkpointing training jobs and weight uploads.

Runs ``scripts/fault_injection.py`` for 50 kills on one store: after every restart each
acknowledged version must be listed with the sha256 it was acknowledged with, download and
serve, and no temporary or partial file may be visible. Bounded by rounds, not time: 50 kills,
more (up to 150) until each path had 20 versions acknowledged, so a loaded machine takes longer
and never fails for being slow (every step of a round has its own bound: the daemon's start,
each request's timeout).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KILLS = 50
MIN_ACKS = 20  # versions acknowledged by jobs, and by uploads


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


fault_injection = load_script("fault_injection")


def test_leftover_detector_sees_partial_writes(tmp_path):
    """The store check itself: a temp file and an unlisted version file are both reported."""
    model = tmp_path / "models" / "m"
    (model / "weights").mkdir(parents=True)
    (model / "optimizer").mkdir()
    (model / "versions.json").write_text(json.dumps({"versions": [{"version": "1"}]}))
    for sub in ("weights", "optimizer"):
        (model / sub / "1.safetensors").write_bytes(b"x")
    assert fault_injection.visible_leftovers(tmp_path) == []
    (model / ".versions.json.abc.tmp").write_bytes(b"{")
    (model / "weights" / "2.safetensors").write_bytes(b"partial")
    problems = fault_injection.visible_leftovers(tmp_path)
    assert any(".versions.json.abc.tmp" in p for p in problems)
    assert any("weights/2.safetensors" in p for p in problems)


@pytest.mark.timeout(0)  # rounds bound it (see the module docstring), not the suite's per-test limit
def test_kill_9_loses_no_acknowledged_version(tmp_path):
    report = fault_injection.run(KILLS, seed=20261121, store=tmp_path, budget_s=None, min_acks=MIN_ACKS,
                                 max_kills=3 * KILLS)
    summary = report.to_json()
    print(json.dumps(summary, indent=1))
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.kills >= KILLS
    assert report.kills_during_job >= 10 and report.kills_during_upload >= 10
    # the kills must land among real work: versions acknowledged by both paths, checked back
    assert report.acked_by_job >= MIN_ACKS and report.acked_by_upload >= MIN_ACKS
    assert report.versions_downloaded >= report.acked_versions
