"""Triton's own client (``tritonclient.http``, unchanged) against the mmad daemon."""

from __future__ import annotations

import numpy as np
import pytest

th = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is not installed (pip install -e .[dev])")
from tritonclient.utils import InferenceServerException  # noqa: E402

from test_server_api import oracle, rel_err  # noqa: E402


@pytest.fixture
def triton(daemon):
    client = th.InferenceServerClient(daemon.url.removeprefix("http://"))
    yield client
    client.close()


def test_health_and_metadata(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("demo") and triton.is_model_ready("demo", "1")
    assert not triton.is_model_ready("nosuch")
    meta = triton.get_server_metadata()
    assert meta["name"] == "mmad" and "binary_tensor_data" in meta["extensions"]
    model = triton.get_model_metadata("demo")
    assert model["inputs"][0] == {"name": "INPUT", "datatype": "FP32", "shape": [-1, 2]}
    assert triton.get_model_metadata("demo", "1")["name"] == "demo"
    assert triton.get_model_config("demo")["input"][0]["name"] == "INPUT"
    with pytest.raises(InferenceServerException, match="unknown model"):
        triton.get_model_metadata("nosuch")


@pytest.mark.parametrize("datatype, binary, tol", [("FP32", False, 1e-5), ("FP32", True, 1e-5), ("FP16", True, 3e-3)])
def test_infer(triton, http, datatype, binary, tol):
    x = np.random.default_rng(21).uniform(-1, 1, (300, 2)).astype(np.float16 if datatype == "FP16" else np.float32)
    infer_input = th.InferInput("INPUT", list(x.shape), datatype)
    infer_input.set_data_from_numpy(x, binary_data=binary)
    result = triton.infer("demo", [infer_input], outputs=[th.InferRequestedOutput("OUTPUT", binary_data=binary)],
                          request_id="t-1")
    out = result.as_numpy("OUTPUT")
    assert result.get_response()["id"] == "t-1" and out.shape == (300, 3) and out.dtype == np.float32
    assert rel_err(out, oracle(http, "demo", x.astype(np.float32))) <= tol


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_requests(triton, http, algorithm):
    x = np.random.default_rng(23).uniform(-1, 1, (50, 2)).astype(np.float32)
    infer_input = th.InferInput("INPUT", [50, 2], "FP32")
    infer_input.set_data_from_numpy(x)
    out = triton.infer("demo", [infer_input], request_compression_algorithm=algorithm).as_numpy("OUTPUT")
    assert rel_err(out, oracle(http, "demo", x)) <= 1e-5


def test_infer_without_requested_outputs_and_pinned_version(triton, http):
    x = np.random.default_rng(22).uniform(-1, 1, (4, 2)).astype(np.float32)
    infer_input = th.InferInput("INPUT", [4, 2], "FP32")
    infer_input.set_data_from_numpy(x)
    out = triton.infer("demo", [infer_input], model_version="1").as_numpy("OUTPUT")  # binary_data_output
    assert rel_err(out, oracle(http, "demo", x, version="1")) <= 1e-5


def test_errors_surface_as_inference_server_exceptions(triton):
    x = np.ones((2, 2), np.float16)
    infer_input = th.InferInput("INPUT", [2, 2], "FP16")
    infer_input.set_data_from_numpy(x, binary_data=False)
    with pytest.raises(InferenceServerException) as info:
        triton.infer("demo", [infer_input])
    assert info.value.status() == "400" and "binary" in info.value.message()
    wrong = th.InferInput("INPUT", [2, 3], "FP32")
    wrong.set_data_from_numpy(np.ones((2, 3), np.float32))
    with pytest.raises(InferenceServerException) as info:
        triton.infer("demo", [wrong])
    assert info.value.status() == "400"


def test_statistics_and_repository(triton):
    x = np.ones((3, 2), np.float32)
    infer_input = th.InferInput("INPUT", [3, 2], "FP32")
    infer_input.set_data_from_numpy(x)
    before = triton.get_inference_statistics("demo")["model_stats"][0]
    triton.infer("demo", [infer_input])
    stats = triton.get_inference_statistics("demo")["model_stats"][0]
    assert stats["name"] == "demo" and stats["inference_count"] == before["inference_count"] + 3
    assert stats["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    assert stats["inference_stats"]["compute_infer"]["ns"] > 0
    assert any(s["name"] == "demo" for s in triton.get_inference_statistics()["model_stats"])
    index = triton.get_model_repository_index()
    assert any(m["name"] == "demo" and m["state"] == "READY" for m in index)
    triton.unload_model("demo")
    assert not triton.is_model_ready("demo")
    triton.load_model("demo")
    assert triton.is_model_ready("demo")
