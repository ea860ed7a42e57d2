"""The model store (server/store.py): atomic versions, leftovers swept, sha256 checked, one daemon."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from mmad.errors import InvalidInput, MMADError, ModelNotFound
from mmad.server.store import Store, check_model_name


def params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"W0": rng.standard_normal((4, 3)).astype(np.float32), "b0": rng.standard_normal(4).astype(np.float32)}


OPT = {"m.W0": np.ones((4, 3), np.float32), "step": np.array([3], np.int64)}


def test_versions_roundtrip_and_sha256(tmp_path):
    store = Store(tmp_path)
    store.create_model("m", {"spec": {}}, params(1), OPT)
    entry = store.add_version("m", params(2), OPT, step=5)
    assert entry["version"] == "2" and entry["step"] == 5
    assert [v["version"] for v in store.versions("m")] == ["1", "2"]
    loaded, opt = store.load_version("m", "2")
    assert all(np.array_equal(loaded[k], params(2)[k]) for k in loaded) and int(opt["step"][0]) == 3
    assert hashlib.sha256(store.weights_bytes("m", "2")).hexdigest() == entry["sha256"]
    with pytest.raises(ModelNotFound):
        store.load_version("m", "3")
    # a flipped byte on disk is detected, never served
    path = tmp_path / "models" / "m" / "weights" / "2.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(MMADError, match="sha256"):
        store.weights_bytes("m", "2")
    store.close()


def test_interrupted_writes_are_swept_and_unlisted_versions_removed(tmp_path):
    store = Store(tmp_path)
    store.create_model("m", {"spec": {}}, params(1), OPT)
    model = tmp_path / "models" / "m"
    # what a kill -9 in the middle of add_version / create_model leaves behind
    (model / ".versions.json.abc.tmp").write_bytes(b"{")
    (model / "weights" / "2.safetensors").write_bytes(b"partial")
    (tmp_path / "models" / ".new-x-123").mkdir()
    store.close()
    store = Store(tmp_path)
    assert not (model / ".versions.json.abc.tmp").exists() and not (tmp_path / "models" / ".new-x-123").exists()
    assert store.remove_unlisted_files("m") == 1 and not (model / "weights" / "2.safetensors").exists()
    assert store.list_models() == ["m"] and [v["version"] for v in store.versions("m")] == ["1"]
    assert store.add_version("m", params(3), OPT, step=1)["version"] == "2"
    store.close()


def test_keep_versions_drops_the_oldest_and_keeps_numbering(tmp_path):
    store = Store(tmp_path, keep_versions=3)
    store.create_model("m", {"spec": {}}, params(1), OPT)
    for seed in range(2, 7):
        store.add_version("m", params(seed), OPT, step=seed)
    assert [v["version"] for v in store.versions("m")] == ["4", "5", "6"]
    model = tmp_path / "models" / "m"
    assert sorted(p.name for p in (model / "weights").iterdir()) == ["4.safetensors", "5.safetensors", "6.safetensors"]
    assert sorted(p.name for p in (model / "optimizer").iterdir()) == ["4.safetensors", "5.safetensors", "6.safetensors"]
    with pytest.raises(ModelNotFound, match="no version '3'"):
        store.load_version("m", "3")
    loaded, _ = store.load_version("m", "6")
    assert all(np.array_equal(loaded[k], params(6)[k]) for k in loaded)
    assert store.add_version("m", params(7), OPT, step=7)["version"] == "7"
    store.close()
    # the default keeps every version
    store = Store(tmp_path / "all")
    store.create_model("m", {"spec": {}}, params(1), OPT)
    for seed in range(2, 7):
        store.add_version("m", params(seed), OPT, step=seed)
    assert [v["version"] for v in store.versions("m")] == ["1", "2", "3", "4", "5", "6"]
    store.close()
    with pytest.raises(InvalidInput, match="keep_versions"):
        Store(tmp_path / "bad", keep_versions=-1)


def test_one_daemon_per_store(tmp_path):
    first = Store(tmp_path)
    with pytest.raises(MMADError, match="in use by another"):
        Store(tmp_path)
    first.close()
    Store(tmp_path).close()


@pytest.mark.parametrize("name", ["..", "../x", "a/b", ".hidden", "", "a" * 65, "x..y", "-x", "a b"])
def test_model_names_cannot_escape_the_store(name):
    with pytest.raises(InvalidInput, match="invalid model name"):
        check_model_name(name)


def test_datasets_and_delete(tmp_path):
    store = Store(tmp_path)
    store.create_model("m", {"spec": {}}, params(1), OPT)
    dataset = store.add_dataset("m", b"bytes")
    with pytest.raises(InvalidInput):
        store.load_dataset("m", "../../etc/passwd")
    store.delete_model("m")
    assert store.list_models() == [] and not (tmp_path / "datasets" / "m").exists()
    with pytest.raises(ModelNotFound):
        store.load_dataset("m", dataset)
    store.close()
