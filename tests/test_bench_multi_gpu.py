"""``mmad bench --multi-gpu``'s options and report, without devices (the runs themselves need two
GPUs: scripts/gpu/multi_gpu_check.sh)."""

from __future__ import annotations

import pytest

from mmad.bench import multi_gpu


def test_parts_pick_what_runs_and_a_wrong_part_is_named(capsys):
    assert multi_gpu.parse_args([]).parts == list(multi_gpu.PARTS)
    assert multi_gpu.parse_args(["--parts", "serving, jobs"]).parts == ["serving", "jobs"]
    with pytest.raises(SystemExit):
        multi_gpu.parse_args(["--parts", "serving,warp-drive"])
    assert "--parts: warp-drive; choose among loss-curve, in-process, jobs, serving" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        multi_gpu.parse_args(["--parts", ","])
    assert "--parts: none given" in capsys.readouterr().err


def test_the_table_has_a_line_for_each_part_that_ran():
    serving = {"one": {"samples_per_s": 228.3e6}, "two": {"samples_per_s": 299.4e6}, "two_vs_one": 1.3115}
    doc = {"serving": {"one": {"samples_per_s": 50.3e6}, "two": {"samples_per_s": 50.5e6}, "two_vs_one": 1.004},
           "serving_system_shm": serving}
    lines = multi_gpu.table(doc).splitlines()
    assert lines[2:] == ["| serving, 8 clients, 1 replica | 50.30 M samples/s |",
                         "| serving, 8 clients, 2 replicas | 50.50 M samples/s (1.00x) |",
                         "| system shared memory, 8 clients, 1 replica | 228.30 M samples/s |",
                         "| system shared memory, 8 clients, 2 replicas | 299.40 M samples/s (1.31x) |"]
    doc["loss_curve"] = {"max_loss_rel_diff": 1.79e-7, "steps": 60, "replica_weights_identical": True}
    assert multi_gpu.table(doc).splitlines()[2] == ("| loss curve, 2 devices vs 1 on the same global batches | "
                                                     "max rel. diff 1.79e-07 (60 steps); replicas identical: True |")
