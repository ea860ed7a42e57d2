"""The engine through its typed interface alone (:class:`~mmad.engine.inprocess.InProcessEngine`
over an in-process daemon on the cpu backend), with no front end in between: inference against
the float64 oracle on fresh random data, the model store's calls, and the API-key rule."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.numpy import load as st_load, save as st_save

from oracle import rel_err
from mmad.backends.cpu import CpuBackend
from mmad.engine.api import Caller, EngineClient, InferenceClient, InferInput, InferRequest, ModelStoreClient, \
    RequestedOutput
from mmad.engine.inprocess import InProcessEngine
from mmad.errors import InvalidInput, ModelNotFound, Unauthorized
from mmad.server import Settings, create_app
from mmad.engine.registry import DEMO_SPEC
from mmad.spec import MLPSpec

ADMIN = Caller(key_verified=True, loopback=True)
ANYONE = Caller(key_verified=False, loopback=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    app = create_app(Settings(store_dir=tmp_path_factory.mktemp("engine") / "store", backend="cpu", probe="cpu",
                              demo=False, api_key="engine-test-key"))
    with TestClient(app) as client:
        engine = InProcessEngine(app.state.runtime)
        engine.call = client.portal.call  # run a coroutine on the daemon's event loop
        yield engine


def forward64(engine, name: str, x: np.ndarray, version: str | None = None) -> np.ndarray:
    weights = engine.call(engine.get_weights, name, version)
    spec = MLPSpec.from_json(DEMO_SPEC)
    with CpuBackend("float64").compile(spec) as ref:
        ref.set_params(st_load(weights.data))
        return ref.forward(x.astype(np.float32))


def infer(engine, name: str, x: np.ndarray, **kwargs) -> np.ndarray:
    datatype = "FP16" if x.dtype == np.float16 else "FP32"
    request = InferRequest(name, [InferInput("INPUT", datatype, x.shape, data=x)], **kwargs)
    (out,) = engine.call(engine.infer, request).outputs
    return out.data


def test_the_in_process_engine_serves_inference_and_the_model_store(engine):
    assert isinstance(engine, InferenceClient) and isinstance(engine, ModelStoreClient)
    assert not isinstance(engine, EngineClient)  # training stays with the HTTP routers (docs/api.md)
    with pytest.raises(Unauthorized):
        engine.call(engine.create_model, "e", DEMO_SPEC, None, ANYONE)
    assert engine.call(engine.create_model, "e", DEMO_SPEC, {"max_queue_delay_us": 0}, ADMIN) is True
    assert engine.call(engine.model_ready, "e") and not engine.call(engine.model_ready, "e", "2")
    assert [v.version for v in engine.call(engine.versions, "e")] == ["1"]

    x = np.random.default_rng().uniform(-1, 1, (70_000, 2)).astype(np.float16)  # past the host check: the forward's
    out = infer(engine, "e", x)
    assert out.dtype == np.float32 and rel_err(out, forward64(engine, "e", x)) <= 3e-3
    half = infer(engine, "e", x[:33], outputs=[RequestedOutput("OUTPUT", "FP16")], version="1")
    assert half.dtype == np.float16 and rel_err(half.astype(np.float64), forward64(engine, "e", x[:33], "1")) <= 3e-3

    live = engine.call(engine.get_weights, "e")
    params = {k: (v + np.random.default_rng().normal(0, 0.05, v.shape)).astype(v.dtype)
              for k, v in st_load(live.data).items()}
    assert engine.call(engine.set_weights, "e", st_save(params), ADMIN).version == "2"
    y = np.random.default_rng().uniform(-1, 1, (9, 2)).astype(np.float32)
    assert rel_err(infer(engine, "e", y), forward64(engine, "e", y, "2")) <= 1e-5
    assert engine.call(engine.checkpoint, "e", ADMIN).version == "3"

    engine.call(engine.delete_model, "e", ADMIN)
    assert not engine.call(engine.model_ready, "e")
    with pytest.raises(ModelNotFound):
        engine.call(engine.model_metadata, "e")


def test_the_engine_checks_each_tensor_against_the_model(engine):
    engine.call(engine.create_model, "checked", DEMO_SPEC, None, ADMIN)
    x = np.ones((4, 2), np.float32)
    cases = [
        (InferInput("INPUT", "FP32", (4, 3), data=x), "its data is [4, 2] but the tensor is declared FP32 [4, 3]"),
        (InferInput("INPUT", "FP64", (4, 2), data=x.astype(np.float64)), "datatype must be one of FP32, FP16"),
        (InferInput("OTHER", "FP32", (4, 2), data=x), "unknown input 'OTHER'"),
        (InferInput("INPUT", "FP32", (4, 2)), "needs its data or a shared-memory region"),
    ]
    for tensor, words in cases:
        with pytest.raises(InvalidInput, match=words.replace("[", r"\[").replace("]", r"\]")):
            engine.call(engine.infer, InferRequest("checked", [tensor]))
    with pytest.raises(InvalidInput, match="unknown output 'SCORES'"):
        engine.call(engine.infer, InferRequest("checked", [InferInput("INPUT", "FP32", (4, 2), data=x)],
                                               [RequestedOutput("SCORES")]))
    big = np.random.default_rng().uniform(-1, 1, (20_000, 2)).astype(np.float32)  # checked by its forward
    big[-1, 1] = np.nan
    with pytest.raises(InvalidInput, match="input 'INPUT' holds NaN or Inf"):
        engine.call(engine.infer, InferRequest("checked", [InferInput("INPUT", "FP32", big.shape, data=big)]))
    stats = engine.call(engine.statistics, "checked")[0]
    assert stats.inference_stats.fail.count == len(cases) + 2 and stats.inference_count == 0
    engine.call(engine.delete_model, "checked", ADMIN)
