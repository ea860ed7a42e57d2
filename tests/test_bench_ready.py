"""``mmad bench --ready``: time to READY and to the first answer after PUT, cold and warm cache and
after a restart, through real daemons on loopback (cpu, and vulkan:simt on lavapipe where it runs)."""

from __future__ import annotations

import json

import pytest

from mmad import cli
from mmad.backends import probe_backend


def _vulkan_simt() -> list[str]:
    _, rows = probe_backend("vulkan")
    simt = next((r for r in rows if r.variant == "simt"), None)
    return ["vulkan:simt"] if simt is not None and simt.available else []


def test_bench_ready_reports_cold_warm_and_restart_figures(tmp_path, capsys):
    backends = ["cpu", *_vulkan_simt()]
    out, table = tmp_path / "ready.json", tmp_path / "ready.md"
    assert cli.main(["bench", "--ready", "--backend", ",".join(backends), "--models", "S",
                     "--config", "tests/configs/tcnn_oneblob.json", "--rows", "256",
                     "--json", str(out), "--markdown", str(table)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("mmad bench --ready --backend ") and doc["rows"] == 256
    assert doc["models"]["tcnn_oneblob"]["n_input_dims"] == 3  # tiny-cuda-nn passes the dims apart: the default
    assert sorted(doc["models"]) == ["S", "tcnn_oneblob"]
    assert doc["models"]["tcnn_oneblob"]["encoding"]["otype"] == "OneBlob"
    assert list(doc["backends"]) == backends
    for backend, result in doc["backends"].items():
        assert "error" not in result, result.get("error")
        assert result["start_s"] > 0 and result["restart_ready_s"] > 0
        variant = backend.partition(":")[2] or "numpy"
        for name, phases in result["models"].items():
            cold, warm, restart = phases["cold"], phases["warm"], phases["restart"]
            for figures in (cold, warm):
                assert 0 < figures["ready_s"] <= figures["first_answer_s"], (backend, name, figures)
                assert figures["variant"] == variant and figures["dispatch_state"] is None  # nothing measured here
            assert restart["first_answer_s"] > 0 and restart["variant"] == variant
    markdown = table.read_text()
    assert markdown.count("\n| cpu | ") == 2 and "| backend | model | cold: READY s |" in markdown
    assert "cpu: daemon start " in capsys.readouterr().out


def test_bench_ready_reports_a_refused_model_and_goes_on(tmp_path):
    bad = tmp_path / "too_wide.json"
    bad.write_text(json.dumps({"network": {"n_neurons": 0, "n_hidden_layers": 1}}))
    out, table = tmp_path / "ready.json", tmp_path / "ready.md"
    assert cli.main(["bench", "--ready", "--backend", "cpu", "--models", "S", "--config", str(bad), "--rows", "64",
                     "--no-restart", "--json", str(out), "--markdown", str(table)]) == 0
    models = json.loads(out.read_text())["backends"]["cpu"]["models"]
    assert models["S"]["cold"]["first_answer_s"] > 0 and models["S"]["warm"]["first_answer_s"] > 0
    assert models["too_wide"]["cold"]["error"].startswith("PUT answered 400: network.n_neurons: ")
    assert "| cpu | too_wide | PUT answered 400: network.n_neurons: " in table.read_text()


@pytest.mark.parametrize("name", ["hashgrid", "oneblob32"])
def test_bench_ready_builtin_models_are_valid_specs(name):
    from mmad.bench.ready import model_docs, parse_args
    from mmad.spec import MLPSpec

    doc = model_docs(parse_args(["--models", name]))[name]
    spec = MLPSpec.from_json(doc)
    assert spec.n_encoded_dims == {"hashgrid": 32, "oneblob32": 512}[name]
