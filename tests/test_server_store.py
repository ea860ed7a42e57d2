"""The model store (server/store.py): atomic versions, leftovers swept, sha256 checked, one daemon."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from safetensors.numpy import save as st_save

from mmad.errors import InvalidInput, MMADError, ModelNotFound
from mmad.engine.store import Store, check_model_name, read_chunk_header


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


def incoming_chunk(store: Store, x: np.ndarray, y: np.ndarray):
    """A chunk file as the upload route leaves it: written into the store's incoming directory."""
    path = store.incoming_path()
    path.write_bytes(st_save({"x": x, "y": y}))
    return path, read_chunk_header(path)


def test_datasets_and_delete(tmp_path):
    store = Store(tmp_path)
    store.create_model("m", {"spec": {}}, params(1), OPT)
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((6, 3)).astype(np.float32), rng.standard_normal((6, 2)).astype(np.float16)
    info = store.add_dataset("m", *incoming_chunk(store, x[:4], y[:4]))
    dataset = info.dataset
    assert (info.rows, len(info.chunks)) == (4, 1)
    info = store.append_dataset_chunk("m", dataset, *incoming_chunk(store, x[4:], y[4:]))
    assert (info.rows, len(info.chunks)) == (6, 2)
    assert sorted(p.name for p in (tmp_path / "datasets" / "m" / dataset).iterdir()) == [
        "00000000.safetensors", "00000001.safetensors"]
    assert not list((tmp_path / "datasets" / ".incoming").iterdir())  # moved, not copied
    loaded = store.load_dataset("m", dataset)  # chunks concatenated, types as sent
    assert loaded["y"].dtype == np.float16
    np.testing.assert_array_equal(loaded["x"], x)
    np.testing.assert_array_equal(loaded["y"], y)
    assert [i.to_json() for i in store.list_datasets("m")] == [
        {"dataset": dataset, "rows": 6, "bytes": info.bytes, "x_dtype": "float32", "y_dtype": "float16", "chunks": 2}]
    with pytest.raises(InvalidInput):
        store.load_dataset("m", "../../etc/passwd")
    with pytest.raises(InvalidInput, match="y is float32 in this chunk but float16 in the dataset's first chunk"):
        store.append_dataset_chunk("m", dataset, *incoming_chunk(store, x, y.astype(np.float32)))
    assert len(store.dataset_info("m", dataset).chunks) == 2
    store.delete_model("m")
    assert store.list_models() == [] and not (tmp_path / "datasets" / "m").exists()
    with pytest.raises(ModelNotFound):
        store.load_dataset("m", dataset)
    with pytest.raises(ModelNotFound):  # a deleted model's datasets directory is not brought back
        store.add_dataset("m", *incoming_chunk(store, x, y))
    assert not (tmp_path / "datasets" / "m").exists()
    store.close()


def test_legacy_one_file_dataset_is_read_and_grows_into_chunks(tmp_path):
    """A store written by an earlier mmad keeps <id>.safetensors: one chunk, appendable."""
    store = Store(tmp_path)
    store.create_model("m", {"spec": {}}, params(1), OPT)
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((10, 3)).astype(np.float32), rng.standard_normal((10, 2)).astype(np.float32)
    dataset = "ab" * 16
    (tmp_path / "datasets" / "m").mkdir(parents=True)
    (tmp_path / "datasets" / "m" / f"{dataset}.safetensors").write_bytes(st_save({"x": x[:7], "y": y[:7]}))
    info = store.dataset_info("m", dataset)
    assert (info.rows, len(info.chunks)) == (7, 1)
    np.testing.assert_array_equal(store.load_dataset("m", dataset)["x"], x[:7])
    info = store.append_dataset_chunk("m", dataset, *incoming_chunk(store, x[7:], y[7:]))
    assert (info.rows, len(info.chunks)) == (10, 2)
    assert not (tmp_path / "datasets" / "m" / f"{dataset}.safetensors").exists()
    np.testing.assert_array_equal(store.load_dataset("m", dataset)["y"], y)
    store.delete_dataset("m", dataset)
    assert store.list_datasets("m") == []
    store.close()
