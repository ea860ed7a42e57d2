"""deploy/prometheus/nv-relabel.yml renames series the daemon really exports to the Triton names
those families stand for (docs/from-triton.md).

The exported names are read from a real daemon's ``/metrics`` after a real request (the inference
families) and from the GPU collector fed a fake NVML (no GPU here); which Triton family each one
stands for is read from the family's own help text ("Triton: nv_X"), not from a list in this test.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from conftest import DaemonProcess
from prometheus_client.parser import text_string_to_metric_families
from test_metrics_triton import FakeNvml
from test_server_api import binary_infer, create

from mmad.engine.metrics import GpuCollector

REPO = Path(__file__).resolve().parent.parent
RELABEL = REPO / "deploy" / "prometheus" / "nv-relabel.yml"
TRITON_NAME = re.compile(r"Triton: (nv_\w+)")


def renames() -> dict[str, str]:
    """source sample name -> Triton name, with every rule checked to be a plain rename of one series name."""
    doc = yaml.safe_load(RELABEL.read_text(encoding="utf-8"))
    (job,) = doc["scrape_configs"]
    out = {}
    for rule in job["metric_relabel_configs"]:
        assert rule["source_labels"] == ["__name__"] and rule["target_label"] == "__name__", rule
        assert rule.get("action", "replace") == "replace", rule
        assert re.escape(rule["regex"]) == rule["regex"], f"not one literal name: {rule['regex']}"
        assert rule["regex"] not in out, f"renamed twice: {rule['regex']}"
        out[rule["regex"]] = rule["replacement"]
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, str]:
    """sample name -> its family's help text, for every sample the daemon wrote."""
    proc = DaemonProcess(tmp_path_factory.mktemp("relabel") / "store").start()
    try:
        with httpx.Client(base_url=proc.url, timeout=30.0) as http:
            create(http, "relabelled")
            x = np.random.default_rng().uniform(-1, 1, (3, 5)).astype(np.float32)
            assert binary_infer(http, "relabelled", x).status_code == 200
            text = http.get("/metrics").text
    finally:
        proc.stop()
    families = list(text_string_to_metric_families(text))
    families += list(GpuCollector(FakeNvml()).collect())
    return {s.name: f.documentation for f in families for s in f.samples}


def test_every_source_is_exported(exported):
    missing = sorted(set(renames()) - set(exported))
    assert not missing, f"{RELABEL.name} renames series the daemon does not export: {missing}"


def test_each_rename_is_the_triton_family_the_help_names(exported):
    wrong = {}
    for source, target in renames().items():
        declared = TRITON_NAME.search(exported.get(source, ""))
        if declared is None or declared.group(1) != target:
            wrong[source] = (target, declared and declared.group(1))
    assert not wrong, f"renamed to another Triton name than the family's help gives (file, help): {wrong}"


def test_every_triton_family_is_renamed(exported):
    """A family whose help names a Triton counterpart and that the file leaves out would be missing
    from a Triton dashboard."""
    declared = {name for name, doc in exported.items() if TRITON_NAME.search(doc)
                and not name.endswith("_created")}
    left_out = sorted(declared - set(renames()))
    assert not left_out, f"{RELABEL.name} leaves out families with a Triton counterpart: {left_out}"
