"""Smoke run of the service load benchmark (mmad.bench.load): a tiny but complete run.

Starts the daemon, the NumPy peer and the load generators as real processes on loopback, with
small sizes and short bounds, and checks the results' structure and the facts that must hold
whatever the machine's speed: every request answered correctly, batching off runs every request
alone, batching on never runs more executions than requests, the report files are written.
"""

from __future__ import annotations

import json

import pytest

from mmad.bench import load

pytest.importorskip("matplotlib", reason="the report's plot needs matplotlib (dev extra)")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("service-bench")
    docs = out / "service-performance.md"
    docs.write_text(f"# Service performance\n\nprose kept\n\n{load.MARK_BEGIN}\nold table\n{load.MARK_END}\n\ntail kept\n")
    argv = ["--out", str(out), "--docs", str(docs), "--concurrency", "1,8", "--sweep-wires", "json",
            "--duration-s", "0.6", "--warmup-s", "0.2", "--large-rows", "2048", "--large-requests", "2",
            "--large-duration-s", "2", "--tritonclient-concurrency", "4", "--in-process-repeats", "3",
            "--uvicorn-matrix", "asyncio/h11", "--pairs", "1", "--pair-duration-s", "0.4",
            "--grpc-clients", "2,4", "--grpc-processes", "2"]
    assert load.main(argv) == 0
    return json.loads((out / "service-cpu.json").read_text()), docs


def test_outputs_checked_against_oracle(smoke_run):
    doc, _ = smoke_run
    errors = doc["oracle_relative_error"]
    assert set(errors) == {"mmad binary16", "mmad binary32", "mmad json", "peer json"}
    assert errors["mmad binary16"] <= load.FP16_TOLERANCE
    assert max(errors["mmad binary32"], errors["mmad json"], errors["peer json"]) <= load.FP32_TOLERANCE


def test_large_batches_measured(smoke_run):
    doc, _ = smoke_run
    ip = doc["in_process"]
    # float32: BLAS's threads, one BLAS thread, the daemon's chunked way; and that way on FP16 in/out
    assert len(ip["samples_per_s_by_way"]) == 4 and set(ip["cpu_ms_by_way"]) == set(ip["samples_per_s_by_way"])
    assert all(v > 0 for v in ip["samples_per_s_by_way"].values())
    float32 = {k: v for k, v in ip["samples_per_s_by_way"].items() if not k.startswith(load.FP16_WAY)}
    assert load.fastest_float32(ip) == max(float32.values())
    assert ip["reference_by_wire"]["binary16"].startswith(load.FP16_WAY)
    assert ip["reference_by_wire"]["binary32"] == ip["reference_by_wire"]["json"] == ip["fastest_float32"]
    assert [r["wire"] for r in doc["large"]] == ["binary16", "binary32", "json"]
    for r in doc["large"]:
        assert r["errors"] == {} and 1 <= r["requests"] <= 2
        assert r["samples_per_s"] > 0 and r["mb_per_s"] > 0
        # bytes on the wire: binary FP16 is 2 bytes per value each way, FP32 4, JSON several
        assert r["mb_per_s"] * 1e6 / r["samples_per_s"] >= (2 * 4 * 64 if r["wire"] == "binary32" else 2 * 2 * 64)


def test_sweep_batching_and_peer(smoke_run):
    doc, _ = smoke_run
    points = {(r["server"], r["batching"], r["clients"]): r for r in doc["sweep"]}
    assert set(points) == {(s, b, c) for s, b in (("mmad", "on"), ("mmad", "off"), ("peer", "none"))
                           for c in (1, 8)}
    for r in doc["sweep"]:
        assert r["errors"] == {}, r["first_error"]
        assert r["requests"] > 0 and r["requests_per_s"] > 0
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
    for clients in (1, 8):
        assert points["mmad", "off", clients]["executions_per_request"] == 1.0
        assert 0 < points["mmad", "on", clients]["executions_per_request"] <= 1.0
    assert points["mmad", "on", 1]["executions_per_request"] == 1.0  # one client: nothing to merge


def test_tritonclient_against_daemon(smoke_run):
    doc, _ = smoke_run
    assert {r["client"] for r in doc["tritonclient"]} == set(load.CLIENT_LABELS.values())
    for r in doc["tritonclient"]:
        assert r["errors"] == {}, r["first_error"]
        assert r["requests"] > 0


def test_grpc_rows_beside_http(smoke_run):
    doc, docs = smoke_run
    assert [(r["datatype"], r["clients"]) for r in doc["grpc"]] == [("FP16", 2), ("FP32", 4)]
    for r in doc["grpc"]:
        assert r["errors"] == {}, r["first_error"]
        assert r["requests"] > 0 and r["processes"] == 2
    assert "**gRPC**" in docs.read_text()


def test_report_written(smoke_run):
    doc, docs = smoke_run
    text = docs.read_text()
    assert text.count(load.MARK_BEGIN) == 1 and "old table" not in text
    assert "prose kept" in text and "tail kept" in text and "| mmad | on | json | 8 |" in text
    assert docs.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    figures = [t["figure"] for t in doc["targets"]]
    assert any("in-process" in f for f in figures) and any("JSON" in f for f in figures)
    assert all(isinstance(t["met"], bool) for t in doc["targets"])


def test_uvicorn_setting_measured(smoke_run):
    doc, docs = smoke_run
    assert [(r["loop"], r["http"]) for r in doc["uvicorn"]] == [("asyncio", "h11")]
    assert doc["uvicorn"][0]["errors"] == {} and doc["uvicorn"][0]["requests"] > 0
    assert "| asyncio | h11 | json |" in docs.read_text()


def test_paired_targets(smoke_run):
    doc, docs = smoke_run
    assert len(doc["pairs"]["large"]) == 1 and len(doc["pairs"]["small"]) == 1
    assert set(doc["pairs"]["small"][0]) == {"mmad json", "peer json"}
    assert all(v["requests_per_s"] > 0 for v in doc["pairs"]["small"][0].values())
    paired = [t["figure"] for t in doc["targets"] if t["figure"].startswith("PAIRED")]
    assert len(paired) == 4 and "**Interleaved pairs**" in docs.read_text()  # FP16 both readings, 64 clients
