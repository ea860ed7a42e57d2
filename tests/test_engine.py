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
from mmad.engine.api import Caller, EngineClient, InferInput, InferRequest, JobRequest, RequestedOutput
from mmad.engine.inprocess import InProcessEngine
from mmad.errors import InvalidInput, ModelNotFound, PayloadTooLarge, Unauthorized
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
    assert isinstance(engine, EngineClient)
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


async def pieces(data: bytes, size: int = 4096):
    for start in range(0, len(data), size):
        yield data[start:start + size]


def test_datasets_and_a_training_job_through_the_engine(engine):
    """A dataset streamed in as pieces, listed, a job trained from it to the end with its events
    and loss curve, then deleted: the engine's training calls with no front end in between."""
    engine.call(engine.create_model, "jobbed", DEMO_SPEC, None, ADMIN)
    rng = np.random.default_rng()
    spec = MLPSpec.from_json(DEMO_SPEC)
    x = rng.uniform(-1, 1, (3000, spec.n_input_dims)).astype(np.float32)
    y = np.tanh(x @ rng.normal(0, 1, (spec.n_input_dims, spec.n_output_dims))).astype(np.float32)
    body = st_save({"x": x[:2000], "y": y[:2000]})
    with pytest.raises(Unauthorized):
        engine.call(engine.create_dataset, "jobbed", pieces(body), len(body), ANYONE)
    with pytest.raises(PayloadTooLarge, match="--max-dataset-bytes"):  # refused from the declared size alone
        engine.call(engine.create_dataset, "jobbed", pieces(body), 1 << 40, ADMIN)
    created = engine.call(engine.create_dataset, "jobbed", pieces(body), None, ADMIN)
    assert (created.rows, created.chunks, created.x_dtype, created.on_device) == (2000, 1, "float32", False)
    more = st_save({"x": x[2000:], "y": y[2000:]})
    grown = engine.call(engine.append_dataset_chunk, "jobbed", created.dataset, pieces(more, 999), len(more), ADMIN)
    assert (grown.rows, grown.chunks) == (3000, 2)
    with pytest.raises(InvalidInput, match=f"dataset y must have {spec.n_output_dims} columns"):
        bad = st_save({"x": x[:10], "y": np.ones((10, spec.n_output_dims + 1), np.float32)})
        engine.call(engine.append_dataset_chunk, "jobbed", created.dataset, pieces(bad), None, ADMIN)
    assert [d.rows for d in engine.call(engine.datasets, "jobbed")] == [3000]

    before = engine.call(engine.get_weights, "jobbed").data
    status = engine.call(engine.start_job, "jobbed", JobRequest(dataset=created.dataset, steps=40, batch_size=256,
                                                                checkpoint_every=20, seed=7), ADMIN)
    assert status.state in ("queued", "running") and status.steps == 40

    async def all_events():
        return [event async for event in await engine.job_events("jobbed", status.job)]
    events = engine.call(all_events)
    assert events[0].event in ("progress", "done") and events[-1].event == "done"
    assert [e.data["version"] for e in events if e.event == "checkpoint"] in ([], ["2", "3"], ["3"])
    final = engine.call(engine.job_status, "jobbed", status.job)
    assert (final.state, final.step, final.versions, final.error) == ("done", 40, ["2", "3"], None)
    assert events[-1].data == {**final.__dict__}
    losses = engine.call(engine.job_losses, "jobbed", status.job)
    assert losses.step == 40 and losses.points[-1][0] == 40 and all(np.isfinite(p[1]) for p in losses.points)
    assert engine.call(engine.get_weights, "jobbed").data != before  # the job trained the live weights
    assert [s.job for s in engine.call(engine.jobs)][:1] == [status.job]
    assert engine.call(engine.dataset, "jobbed", created.dataset).on_device  # the job's copy is held

    engine.call(engine.delete_dataset, "jobbed", created.dataset, ADMIN)
    with pytest.raises(ModelNotFound):
        engine.call(engine.dataset, "jobbed", created.dataset)
    with pytest.raises(ModelNotFound):
        engine.call(engine.job_status, "jobbed", "0" * 32)
    engine.call(engine.delete_model, "jobbed", ADMIN)
