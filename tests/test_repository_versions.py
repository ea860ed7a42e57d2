"""Triton's repository layout (``<model>/<version>/model.safetensors``, ``version_policy``),
``mmad export --to repository`` and ``mmad serve --model-control-mode poll``, against real
daemon processes on loopback: several versions served as the policy picks, layouts mmad does
not read refused with the layout expected, and one training daemon publishing to a repository
that a second daemon follows read-only.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import DaemonProcess, free_port
from oracle import case_rng, rel_err
from safetensors.numpy import load as st_load, save_file
from test_server_api import SMALL_SPEC, binary_infer, decode_binary, oracle

from mmad.backends.contract import param_shapes
from mmad.cli import main as cli
from mmad.engine.repository import read_model_folder
from mmad.spec import MLPSpec


def weights(spec: dict, *case) -> dict[str, np.ndarray]:
    rng = case_rng("repository-weights", *case)
    return {k: rng.normal(0, 0.3, shape).astype(np.float32)
            for k, shape in param_shapes(MLPSpec.from_json(spec)).items()}


def model_folder(root: Path, name: str, versions=(), policy=None, spec=SMALL_SPEC) -> dict[int, dict]:
    """A Triton-layout folder with a version folder of fresh random weights for each of ``versions``."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(spec))
    if policy is not None:
        (d / "mmad.json").write_text(json.dumps({"version_policy": policy}))
    params = {}
    for v in versions:
        params[v] = weights(spec, name, v)
        (d / str(v)).mkdir()
        save_file(params[v], str(d / str(v) / "model.safetensors"))
    return params


def index(http: httpx.Client) -> dict[str, dict]:
    return {row["name"]: row for row in http.post("/v2/repository/index").json()}


def listed(http: httpx.Client, name: str) -> list[str]:
    return [v["version"] for v in http.get(f"/v2/models/{name}/versions").json()["versions"]]


def wait_for(what: str, check, timeout_s: float = 60.0):
    """``check()``'s first truthy value, polled until the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not seen within {timeout_s} s: {what}")


def fresh_inputs(*case) -> np.ndarray:
    return case_rng("repository-inputs", *case).uniform(-1, 1, (16, 5)).astype(np.float32)


def test_triton_layout_is_read_with_its_version_policy_and_refused_where_not_understood(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    latest = model_folder(root, "latest", (1, 2, 3))
    model_folder(root, "latest-two", (1, 2, 3), {"latest": {"num_versions": 2}})
    every = model_folder(root, "every", (1, 4), {"all": {}})
    specific = model_folder(root, "specific", (1, 2, 3), {"specific": {"versions": [1, 3]}})
    # what mmad does not read: each UNAVAILABLE with the reason, none READY with the seed's weights
    model_folder(root, "no-weights", (1,))
    (root / "no-weights" / "2").mkdir()
    (root / "pbtxt").mkdir()
    (root / "pbtxt" / "config.pbtxt").write_text('name: "pbtxt"\nbackend: "onnxruntime"\n')
    (root / "pbtxt" / "1").mkdir()
    (root / "pbtxt" / "1" / "model.onnx").write_bytes(b"onnx")
    model_folder(root, "junk-folder", (1,))
    (root / "junk-folder" / "v2").mkdir()
    model_folder(root, "zero", (1,))
    (root / "zero" / "0").mkdir()
    model_folder(root, "stray-in-version", (1,))
    (root / "stray-in-version" / "1" / "model.onnx").write_bytes(b"onnx")
    model_folder(root, "stray-file", (1,))
    (root / "stray-file" / "labels.txt").write_text("cat\ndog\n")
    model_folder(root, "both-layouts", (1,))
    save_file(weights(SMALL_SPEC, "flat"), str(root / "both-layouts" / "model.safetensors"))
    model_folder(root, "missing-specific", (1, 2), {"specific": {"versions": [2, 5]}})
    model_folder(root, "bad-policy", (1,), {"newest": {}})
    model_folder(root, "bad-weights", (1,))
    (root / "bad-weights" / "1" / "model.safetensors").write_bytes(b"not safetensors")

    daemon = DaemonProcess(tmp_path / "store", "--model-repository", str(root)).start()
    try:
        with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
            rows = index(http)
            ready = {name for name, row in rows.items() if row["state"] == "READY"}
            assert ready == {"latest", "latest-two", "every", "specific"}
            assert listed(http, "latest") == ["3"]  # Triton's default: the newest version only
            assert listed(http, "latest-two") == ["2", "3"]
            assert listed(http, "every") == ["1", "4"]
            assert listed(http, "specific") == ["1", "3"]
            assert rows["latest"]["version"] == "3" and rows["latest"]["reason"] == ""
            for name, params, version in (("every", every, 1), ("specific", specific, 3)):
                stored = st_load(http.get(f"/v2/models/{name}/weights", params={"version": str(version)}).content)
                assert all(np.array_equal(stored[k], params[version][k]) for k in params[version])
            # the live weights are the newest version's; a pinned request reaches an older one
            x = fresh_inputs("layout")
            _, out = decode_binary(binary_infer(http, "latest", x))
            assert rel_err(out, oracle(http, "latest", x)) < 1e-5
            assert all(np.array_equal(v, latest[3][k]) for k, v in st_load(http.get("/v2/models/latest/weights")
                                                                            .content).items())
            _, old = decode_binary(binary_infer(http, "every", x, version="1"))
            assert rel_err(old, oracle(http, "every", x, version="1")) < 1e-5
            assert rel_err(old, decode_binary(binary_infer(http, "every", x))[1]) > 1e-2  # not version 4's

            reasons = {name: row["reason"] for name, row in rows.items() if row["state"] != "READY"}
            assert "version folder 2 has no model.safetensors" in reasons["no-weights"]
            assert "no-weights/2" not in reasons["no-weights"]  # the model's terms, not a path
            assert "config.pbtxt is Triton's model configuration, which mmad does not read" in reasons["pbtxt"]
            assert "write config.json, the tiny-cuda-nn model JSON" in reasons["pbtxt"]
            assert "folder 'v2' is not a version" in reasons["junk-folder"]
            assert "version folders 1, 2, ..." in reasons["junk-folder"]
            assert "folder '0' is not a version" in reasons["zero"]
            assert "holds model.onnx beside model.safetensors" in reasons["stray-in-version"]
            assert "'labels.txt' is not a file mmad reads" in reasons["stray-file"]
            assert "use one layout" in reasons["both-layouts"]
            assert "version_policy.specific lists version(s) 5 with no version folder" in reasons["missing-specific"]
            assert "version_policy must be one of" in reasons["bad-policy"]
            assert "1/model.safetensors" in reasons["bad-weights"] and "safetensors" in reasons["bad-weights"]
            for name in reasons:  # nothing of a refused folder is in the store
                assert http.get(f"/v2/models/{name}").status_code == 404
        daemon.stop()

        # a version published since: the stored model is served, its reason tells of the version
        model_folder(root / "tmp", "latest", (4,))
        (root / "tmp" / "latest" / "4").rename(root / "latest" / "4")
        daemon = DaemonProcess(tmp_path / "store", "--model-repository", str(root)).start()
        with httpx.Client(base_url=daemon.url, timeout=30.0) as http:
            row = index(http)["latest"]
            assert row["state"] == "READY" and row["version"] == "3"
            assert "version(s) 4 the store lacks" in row["reason"] and "--model-control-mode poll" in row["reason"]
    finally:
        daemon.stop()


def test_export_to_repository_from_files_round_trip(tmp_path, capsys):
    spec = {**SMALL_SPEC, "n_output_dims": 3}
    (tmp_path / "model.json").write_text(json.dumps({"spec": spec, "config": {"max_queue_delay_us": 250}}))
    first, second = weights(spec, "export", 1), weights(spec, "export", 2)
    save_file(first, str(tmp_path / "1.safetensors"))
    save_file(second, str(tmp_path / "2.safetensors"))
    root = tmp_path / "repo"
    base = ["export", "--to", "repository", "--config", str(tmp_path / "model.json"), "--model", "field"]

    assert cli([*base, str(root), "--params", str(tmp_path / "1.safetensors")]) == 0
    assert cli([*base, "-o", str(root), "--params", str(tmp_path / "2.safetensors")]) == 0  # the next number
    assert "version 2" in capsys.readouterr().out
    assert sorted(p.name for p in (root / "field").iterdir()) == ["1", "2", "config.json", "mmad.json"]
    assert json.loads((root / "field" / "mmad.json").read_text()) == {"max_queue_delay_us": 250}
    assert not [p for p in root.rglob(".*")]  # nothing staged is left behind

    # a serving policy written into mmad.json survives the next publication
    (root / "field" / "mmad.json").write_text(json.dumps({"max_queue_delay_us": 250, "version_policy": {"all": {}}}))
    assert cli([*base, str(root), "--params", str(tmp_path / "1.safetensors"), "--version", "7"]) == 0
    model = read_model_folder(root / "field")
    assert sorted(model.versions) == [1, 2, 7]
    assert model.config.max_queue_delay_us == 250 and model.spec.to_json() == MLPSpec.from_json(spec).to_json()
    back = st_load((root / "field" / "2" / "model.safetensors").read_bytes())
    assert all(np.array_equal(back[k], second[k]) for k in second)

    capsys.readouterr()
    before = (root / "field" / "2" / "model.safetensors").read_bytes()
    assert cli([*base, str(root), "--params", str(tmp_path / "1.safetensors"), "--version", "2"]) == 2
    err = capsys.readouterr().err
    assert "version(s) 2 of 'field' are published" in err and "never changed" in err
    assert (root / "field" / "2" / "model.safetensors").read_bytes() == before
    (tmp_path / "other.json").write_text(json.dumps(SMALL_SPEC))
    save_file(weights(SMALL_SPEC, "other"), str(tmp_path / "other.safetensors"))
    assert cli(["export", "--to", "repository", str(root), "--config", str(tmp_path / "other.json"), "--model", "field",
                "--params", str(tmp_path / "other.safetensors")]) == 2
    assert "holds another spec" in capsys.readouterr().err
    assert cli(["export", "--to", "repository", str(root), "--config", str(tmp_path / "model.json"),
                "--params", str(tmp_path / "1.safetensors")]) == 2
    assert "--model NAME" in capsys.readouterr().err


def test_two_daemons_one_repository_train_here_serve_many(tmp_path, capsys):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "flat").mkdir()  # served at start only: a followed repository numbers every version
    (root / "flat" / "config.json").write_text(json.dumps(SMALL_SPEC))
    trainer = DaemonProcess(tmp_path / "store-a", "--no-demo").start()
    server = None
    try:
        server = DaemonProcess(tmp_path / "store-b", "--model-repository", str(root), "--model-control-mode", "poll",
                               "--repository-poll-secs", "0.2").start()
        with httpx.Client(base_url=trainer.url, timeout=60.0) as a, httpx.Client(base_url=server.url,
                                                                                 timeout=60.0) as b:
            (flat,) = index(b).values()
            assert flat["state"] == "UNAVAILABLE" and "serves version folders" in flat["reason"]
            assert a.put("/v2/models/field", json={"spec": SMALL_SPEC}).status_code == 201
            capsys.readouterr()
            assert cli(["export", "--to", "repository", str(root), "--url", trainer.url, "--model", "nosuch"]) == 2
            assert "answered 404 for model 'nosuch'" in capsys.readouterr().err
            assert cli(["export", "--to", "repository", str(root), "--url", trainer.url, "--model", "field",
                        "--version", "9"]) == 2
            assert "has no version 9 (it has 1)" in capsys.readouterr().err
            assert not (root / "field").exists()
            assert cli(["export", "--to", "repository", str(root), "--url", trainer.url, "--model", "field"]) == 0
            wait_for("version 1 served by the polling daemon", lambda: index(b).get("field", {}).get("state") == "READY")
            x = fresh_inputs("two-daemons", 1)
            assert rel_err(decode_binary(binary_infer(b, "field", x))[1], oracle(a, "field", x, version="1")) < 1e-5

            # train on A, publish its version 2; B serves it once seen, A's outputs to the float64 oracle
            rng = case_rng("two-daemons", "train")
            tx = rng.uniform(-1, 1, (64, 5)).astype(np.float32)
            ty = np.sin(3 * tx[:, :4]).astype(np.float32)
            body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [64, 5], "data": tx.ravel().tolist()},
                               {"name": "TARGET", "datatype": "FP32", "shape": [64, 4], "data": ty.ravel().tolist()}],
                    "parameters": {"steps": 20}}
            assert a.post("/v2/models/field/train", json=body).status_code == 200
            assert a.post("/v2/models/field/versions").json()["version"] == "2"
            assert cli(["export", "--to", "repository", str(root), "--url", trainer.url, "--model", "field"]) == 0
            wait_for("version 2 picked up", lambda: index(b)["field"]["version"] == "2")
            assert listed(b, "field") == ["2"]  # the default policy: the newest version only
            x = fresh_inputs("two-daemons", 2)
            served = decode_binary(binary_infer(b, "field", x))[1]
            assert rel_err(served, oracle(a, "field", x, version="2")) < 1e-5
            assert rel_err(served, decode_binary(binary_infer(a, "field", x, version="2"))[1]) < 1e-6
            assert rel_err(served, oracle(a, "field", x, version="1")) > 1e-3  # the trained weights, not the seed's

            # B is read-only: the repository is the source of truth
            refused = [b.post("/v2/models/field/train", json=body),
                       b.put("/v2/models/field/weights", content=a.get("/v2/models/field/weights").content),
                       b.put("/v2/models/field", json={"spec": SMALL_SPEC}),
                       b.put("/v2/models/newcomer", json={"spec": SMALL_SPEC}),
                       b.post("/v2/models/field/versions"), b.delete("/v2/models/field"),
                       b.post("/v2/repository/models/field/unload")]
            for r in refused:
                assert r.status_code == 403, (r.request.url, r.text)
                assert "model repository" in r.json()["error"] and "mmad export --to repository" in r.json()["error"]
            assert listed(b, "field") == ["2"] and index(b)["field"]["state"] == "READY"

            # a broken new version keeps version 2 serving, with the reason; fixed, it is served
            (root / "field" / "3").mkdir()
            (root / "field" / "3" / "model.safetensors").write_bytes(b"half a file")
            reason = wait_for("the broken version's reason",
                              lambda: index(b)["field"]["reason"] if "3/model.safetensors" in index(b)["field"]["reason"]
                              else "")
            assert "version 2 is still served" in reason
            assert index(b)["field"]["state"] == "READY" and listed(b, "field") == ["2"]
            assert rel_err(decode_binary(binary_infer(b, "field", x))[1], served) < 1e-6
            third = weights(SMALL_SPEC, "third")
            save_file(third, str(root / "field" / ".staged.safetensors"))
            (root / "field" / ".staged.safetensors").replace(root / "field" / "3" / "model.safetensors")
            wait_for("version 3 picked up", lambda: index(b)["field"]["version"] == "3")
            assert index(b)["field"]["reason"] == ""
            live = st_load(b.get("/v2/models/field/weights").content)
            assert all(np.array_equal(live[k], third[k]) for k in third)

            # a new model published meanwhile is served too; one whose folder goes is unloaded
            assert a.put("/v2/models/other", json={"spec": {**SMALL_SPEC, "n_output_dims": 2}}).status_code == 201
            assert cli(["export", "--to", "repository", str(root), "--url", trainer.url, "--model", "other",
                        "--version", "all"]) == 0
            wait_for("the new model served", lambda: index(b).get("other", {}).get("state") == "READY")
            assert decode_binary(binary_infer(b, "other", x))[1].shape == (16, 2)
            (root / "other").rename(root / ".gone")
            wait_for("the removed model unloaded", lambda: index(b)["other"]["state"] == "UNAVAILABLE")
            assert "no longer in the model repository" in index(b)["other"]["reason"]

        # a restart serves the copy its store keeps, level with the repository
        server.stop()
        server = DaemonProcess(tmp_path / "store-b", "--model-repository", str(root), "--model-control-mode", "poll",
                               "--repository-poll-secs", "0.2").start()
        with httpx.Client(base_url=server.url, timeout=60.0) as b:
            rows = index(b)
            assert rows["field"]["state"] == "READY" and rows["field"]["version"] == "3" and listed(b, "field") == ["3"]
            assert rows["other"]["state"] == "UNAVAILABLE"
            live = st_load(b.get("/v2/models/field/weights").content)
            assert all(np.array_equal(live[k], third[k]) for k in third)
            assert rel_err(decode_binary(binary_infer(b, "field", x))[1], oracle(b, "field", x)) < 1e-5
    finally:
        if server is not None:
            server.stop()
        trainer.stop()


def test_poll_mode_needs_a_repository(tmp_path):
    daemon = DaemonProcess(tmp_path / "store", "--model-control-mode", "poll")
    with pytest.raises(RuntimeError, match="model_control_mode 'poll' follows a model repository"):
        daemon.start()


def test_poll_mode_refuses_grpc_load_and_unload(tmp_path):
    tg = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed (pip install -e .[dev])")
    from tritonclient.utils import InferenceServerException

    root = tmp_path / "repo"
    model_folder(root, "field", (1, 2))
    port = free_port()
    daemon = DaemonProcess(tmp_path / "store", "--model-repository", str(root), "--model-control-mode", "poll",
                           "--grpc-port", str(port)).start()
    try:
        client = tg.InferenceServerClient(f"127.0.0.1:{port}")
        assert client.is_model_ready("field", "2") and not client.is_model_ready("field", "1")
        for call in (lambda: client.unload_model("field"), lambda: client.load_model("field")):
            with pytest.raises(InferenceServerException) as info:
                call()
            assert info.value.status() == "StatusCode.PERMISSION_DENIED"
            assert "model repository" in info.value.message()
        assert client.is_model_ready("field")
        client.close()
    finally:
        daemon.stop()
