"""scripts/plot_benchmarks.py reads its figures from the benchmark JSON and draws a PNG.

Runs on the checkout (matplotlib, no device): the series come from fresh random figures written
as the two JSON files the script reads, so a series taken from the wrong row, mode or file fails.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
pytest.importorskip("matplotlib", reason="matplotlib is not installed (scripts/setup.sh --dev)")


def load_script():
    spec = importlib.util.spec_from_file_location("plot_benchmarks", REPO / "scripts" / "plot_benchmarks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_results(folder: Path, rng: np.random.Generator, device: str = "NVIDIA H100 80GB HBM3") -> dict:
    rows = 1 << 20
    expected = {mode: {"mmad": [], "PyTorch": [], "tiny-cuda-nn": []} for mode in ("forward", "train")}
    results, tcnn = [], {}
    for model in ("S", "M", "L", "W"):
        tcnn[model] = {}
        for mode in ("forward", "train"):
            mmad, torch, ref = rng.uniform(10, 20000, size=3)
            results.append({"model": model, "backend": f"cuda:variant-{model}", "device": device, "mode": mode,
                            "rows": rows, "samples_per_s": mmad * 1e6, "peer_seconds": rows / (torch * 1e6)})
            tcnn[model][f"{mode}_msps"] = ref
            expected[mode]["mmad"].append(mmad)
            expected[mode]["PyTorch"].append(torch)
            expected[mode]["tiny-cuda-nn"].append(ref)
    rng.shuffle(results)  # the script finds rows by model and mode, not by position
    (folder / "dispatch-h100-bench.json").write_text(json.dumps({"rows": rows, "results": results}))
    (folder / "tcnn-h100-reference.json").write_text(json.dumps({"device": device, "models": tcnn}))
    return expected


def test_series_are_the_json_figures(tmp_path):
    plot = load_script()
    expected = write_results(tmp_path, np.random.default_rng())
    data = plot.figures(tmp_path)
    for mode, series in expected.items():
        for name, values in series.items():
            np.testing.assert_allclose(data["series"][mode][name], values, rtol=1e-12, err_msg=f"{mode} {name}")
    assert data["variants"] == {m: f"cuda:variant-{m}" for m in "SMLW"}


def test_writes_a_png(tmp_path):
    plot = load_script()
    write_results(tmp_path, np.random.default_rng())
    out = tmp_path / "chart.png"
    assert plot.main(["--results-dir", str(tmp_path), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_model_is_named(tmp_path):
    plot = load_script()
    write_results(tmp_path, np.random.default_rng())
    path = tmp_path / "dispatch-h100-bench.json"
    doc = json.loads(path.read_text())
    doc["results"] = [r for r in doc["results"] if not (r["model"] == "L" and r["mode"] == "train")]
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="no measured train row for model L"):
        plot.figures(tmp_path)


def test_another_gpu_kind_is_refused(tmp_path):
    plot = load_script()
    write_results(tmp_path, np.random.default_rng())
    path = tmp_path / "tcnn-h100-reference.json"
    doc = json.loads(path.read_text())
    doc["device"] = "NVIDIA A100"
    path.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="one GPU kind"):
        plot.figures(tmp_path)


def test_committed_results_give_every_model():
    plot = load_script()
    data = plot.figures(REPO / "bench" / "results")
    for mode in ("forward", "train"):
        for name in ("mmad", "PyTorch", "tiny-cuda-nn"):
            values = data["series"][mode][name]
            assert len(values) == 4 and all(v > 0 for v in values), (mode, name, values)
