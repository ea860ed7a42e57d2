"""``mmad bench`` writes checked, timed results (a tiny run; real figures come from bench runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_bench_writes_json_and_markdown_with_oracle_check(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mmad.cli", "bench", "--backend", "cpu", "--models", "S,M",
                           "--batch", "3000", "--repeats", "2", "--no-peer", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "MMAD_BACKEND": ""})
    assert proc.returncode == 0, proc.stderr
    (result,) = tmp_path.glob("*-cpu-numpy.json")
    doc = json.loads(result.read_text())
    assert doc["batch"] == 3000 and doc["floor"]["copy_bytes_per_s"] > 0 and doc["floor"]["gemm_flops_per_s"] > 0
    assert [r["model"] for r in doc["results"]] == ["S", "M"]
    for row in doc["results"]:
        assert row["rel_err_vs_float64"] < 1e-5  # the cpu backend in fp32 against float64
        assert row["forward_msamples_per_s"] > 0 and row["train_msamples_per_s"] > 0
        assert 0 < row["forward_pct_floor"] <= 100 and 0 < row["train_pct_floor"] <= 100
    table = result.with_suffix(".md").read_text()
    assert "| S | cpu:numpy |" in table and "Peer: none" in table


def test_bench_refuses_unknown_models():
    proc = subprocess.run([sys.executable, "-m", "mmad.cli", "bench", "--models", "XL", "--no-peer"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown benchmark model 'XL'; allowed: S, M, L, W" in proc.stderr
