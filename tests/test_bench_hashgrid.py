"""``mmad bench --hashgrid``: checked figures on the cpu backend, refusals recorded with their
reasons, a wrong forward or a diverging training fails the run, and the PyTorch peer computes
the float64 oracle's forward."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
from oracle import rel_err, wrong_cpu_forward

from mmad import cli
from mmad.backends.cpu import CpuBackend, CpuModel
from mmad.bench import hashgrid
from mmad.errors import BackendUnavailable, SpecError

QUICK = ["--rows", "512", "--log2-hashmap-sizes", "8", "--repeats", "2", "--steps-per-sample", "2"]
HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(autouse=True)
def no_forced_backend(monkeypatch):
    monkeypatch.setenv("MMAD_BACKEND", "")


def test_cpu_run_writes_checked_figures(tmp_path, capsys):
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    peer = "torch" if HAS_TORCH else "none"
    assert hashgrid.main(["--backend", "cpu", *QUICK, "--peer", peer, "--json", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("mmad bench --hashgrid --backend cpu --rows 512")
    assert doc["rows"] == 512 and doc["steps_per_sample"] == 2 and doc["errors"] == []
    assert doc["tcnn_reference"]["source"] == "tiny-cuda-nn 2.0, native C++ API, JIT-fused, H100"
    assert doc["tcnn_reference"]["train_msps"] == {"15": 566, "19": 446}
    assert doc["config"]["encoding"]["otype"] == "HashGrid" and doc["log2_hashmap_sizes"] == [8]
    [row] = doc["results"]
    assert (row["backend"], row["status"], row["log2_hashmap_size"], row["precision"]) == ("cpu:numpy", "measured", 8,
                                                                                         "fp32")
    assert 0 < row["rel_err_vs_float64"] <= 1e-4 and row["tolerance"] == 1e-4  # fp32 positions: ~7e-5 inherent
    assert row["train_msps"] > 0 and row["infer_msps"] > 0 and row["infer_io"] == "fp32 in, fp16 out"
    assert np.isfinite(row["loss_last"]) and row["loss_last"] < row["loss_first"]
    assert row["train_steps_checked"] == 2 * (1 + 2)  # the warm-up call, then a call per repeat
    # no tcnn figures and no throughput targets for a 2^8 table; the peer's bar wherever it ran
    assert row["x_tcnn_reference_train"] is None and "train_msps" not in row["bars"]
    if HAS_TORCH:
        [p] = doc["peer"]
        assert p["peer"].startswith("torch-") and p["train_msps"] > 0 and p["infer_msps"] > 0
        assert row["x_torch_train"] == pytest.approx(row["train_msps"] / p["train_msps"])
        assert row["bars"]["x_torch_infer"]["met"] == (row["x_torch_infer"] >= 10)
    else:
        assert doc["peer"] == [] and row["x_torch_train"] is None and row["bars"] == {}
    table = md.read_text()
    assert "| cpu:numpy | 2^8 | fp32 |" in table and "tiny-cuda-nn reference (not run here; tiny-cuda-nn 2.0" in table
    assert "| cpu:numpy | 2^8 | fp32 |" in capsys.readouterr().out


def test_refused_backends_are_rows_with_their_reasons(tmp_path, monkeypatch):
    from mmad import backends

    select = backends.select

    def no_coopmat_here(forced=None):
        if forced == "vulkan:coopmat":
            raise BackendUnavailable("vulkan:coopmat", "coopmat: this device does not offer VK_KHR_cooperative_matrix")
        return select(forced)

    def refuse(self, spec, variant=None, cache=None, device=0):
        raise SpecError("encoding", "HashGrid is implemented on other backends only so far")

    monkeypatch.setattr(backends, "select", no_coopmat_here)
    monkeypatch.setattr(CpuBackend, "compile", refuse)
    out = tmp_path / "r.json"
    assert hashgrid.main(["--backend", "vulkan:coopmat,cpu", *QUICK, "--peer", "none", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["errors"] == []
    assert [(r["backend"], r["status"]) for r in doc["results"]] == [("vulkan:coopmat", "refused"), ("cpu", "refused")]
    coopmat, cpu = doc["results"]
    assert "does not offer VK_KHR_cooperative_matrix" in coopmat["reason"]
    assert cpu["reason"] == "encoding: HashGrid is implemented on other backends only so far"
    assert cpu.get("train_msps") is None and cpu["x_tcnn_reference_infer"] is None


def test_a_wrong_forward_fails_the_run_untimed(tmp_path, monkeypatch, capsys):
    def untimed(*a, **kw):
        raise AssertionError("a model whose output failed the check was timed")

    wrong_cpu_forward(monkeypatch, 1.01)
    monkeypatch.setattr(hashgrid, "_measure_host", untimed)
    out = tmp_path / "r.json"
    assert cli.main(["bench", "--hashgrid", "--backend", "cpu", *QUICK, "--peer", "none", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "mmad: error: cpu:numpy with a 2^8 table: the forward differs from the float64 oracle" in err
    [row] = json.loads(out.read_text())["results"]
    assert row["status"] == "failed" and "(> 0.0001 for fp32); not timed" in row["reason"]


def test_training_that_does_not_learn_fails_the_run(tmp_path, monkeypatch, capsys):
    def stuck(self, x, y, steps=1):
        return np.full(steps, 0.5, np.float32)

    monkeypatch.setattr(CpuModel, "train_step", stuck)
    assert cli.main(["bench", "--hashgrid", "--backend", "cpu", *QUICK, "--peer", "none"]) == 2
    assert "training did not lower the loss over 6 steps (0.5 → 0.5)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--backend", "foo"], "--backend: unknown backend 'foo'; valid: cuda, vulkan, wgpu, cpu"),
    (["--backend", "cpu:simt"], "--backend: backend 'cpu' has no variant 'simt'; valid: numpy"),
    (["--log2-hashmap-sizes", "15,big"], "--log2-hashmap-sizes: 'big' is not a whole number (e.g. 15,19)"),
    (["--log2-hashmap-sizes", "40"], "--log2-hashmap-sizes: encoding.log2_hashmap_size: "),
    (["--steps-per-sample", "0"], "--steps-per-sample: must be at least 1; got 0"),
])
def test_option_errors_are_one_clear_line(argv, message, capsys):
    assert cli.main(["bench", "--hashgrid", "--backend", "cpu", *argv, "--peer", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmad: error: ") and message in err and "Traceback" not in err


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["bench", "--hashgrid", "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: mmad bench --hashgrid")
    for option in ("--backend", "--rows", "--log2-hashmap-sizes", "--precision", "--repeats", "--steps-per-sample",
                   "--peer", "--json", "--markdown"):
        assert option in text


def test_torch_peer_computes_the_float64_oracle():
    torch = pytest.importorskip("torch", reason="torch is not installed (pip install mmad[export])")
    from mmad.export import to_torch

    spec = hashgrid.image_spec(12, "fp32")
    params = hashgrid.grid_params(spec, np.random.default_rng(3))
    x = np.random.default_rng(4).random((4096, 2), dtype=np.float32)  # the benchmark's fp32 positions
    oracle = CpuBackend("float64").compile(spec)
    oracle.set_params(params)
    ref = oracle.forward(x)  # computed in float64, returned as float32: 6e-8 apart at most
    with torch.no_grad():
        out = to_torch(spec, params).double()(torch.from_numpy(x).double()).numpy()
    assert rel_err(out, ref) <= 1e-6
    # the random tables reach the output: the same model with tcnn's ±1e-4 tables differs
    assert rel_err(out, to_torch(spec).double()(torch.from_numpy(x).double()).detach().numpy()) > 0.1
