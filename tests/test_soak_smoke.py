"""A short run of ``scripts/soak.py`` (the full soak is >= 5 minutes, see docs/reliability.md).

Mixed concurrent infer / train / jobs / load / unload / weight upload for 20 s against a daemon
subprocess: no error but documented 503s with Retry-After, RSS growth under 10% after warm-up,
and no compiled model (device buffers, counted with ``CompiledModel.device_bytes()``) left open
that the registry no longer references, none at all once every model is unloaded.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DURATION_S = 20.0


def load_script(name: str):
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_soak_smoke(tmp_path):
    soak = load_script("soak")
    report = soak.run(DURATION_S, seed=7, workdir=tmp_path)
    print(json.dumps(report, indent=1))
    assert not report["failures"], report["failures"]
    assert report["errors"] == 0
    assert report["rss_growth"] < soak.RSS_LIMIT
    assert report["requests_ok"]["infer"] >= 200
    after = report["device_after_load"]
    assert after["open_models"] == after["held_models"] >= len(soak.MODELS)
    assert after["compiled_total"] > after["open_models"]  # models were compiled and freed meanwhile
    assert report["device_after_unload"]["device_bytes"] == 0
