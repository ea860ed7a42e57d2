"""mmad_client end to end against a real daemon (``mmad.server``) on loopback, cpu backend.

One daemon for the module (started as a subprocess, as a user would run it), with an API key and
a 4 MiB body cap so that auth and 413 can be exercised cheaply. Numbers are checked against the
float64 cpu oracle run in this process on the weights the daemon reports.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from oracle import rel_err
import pytest

# test the checkout's client, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

import mmad_client  # noqa: E402
from mmad_client import AsyncClient, Client, Retry, Timeout  # noqa: E402
from mmad_client import errors as E  # noqa: E402

API_KEY = "live-test-key"
MAX_BODY_BYTES = 4 * 1024 * 1024
N_IN, N_OUT = 8, 3


def spec_doc(seed: int = 7, lr: float = 1e-2, precision: str = "fp32") -> dict:
    return {"n_input_dims": N_IN, "n_output_dims": N_OUT,
            "network": {"otype": "FullyFusedMLP", "activation": "Tanh", "output_activation": "None",
                        "n_neurons": 32, "n_hidden_layers": 2},
            "encoding": {"otype": "Identity"}, "loss": {"otype": "L2"},
            "optimizer": {"otype": "Adam", "learning_rate": lr, "beta1": 0.9, "beta2": 0.99, "epsilon": 1e-15},
            "precision": precision, "seed": seed}


def oracle(doc: dict, weights: dict[str, np.ndarray]):
    """The float64 cpu oracle holding ``weights``."""
    from mmad.backends.cpu import CpuBackend
    from mmad.spec import MLPSpec

    model = CpuBackend("float64").compile(MLPSpec.from_json(doc))
    model.set_params(weights)
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """Base URL of a running daemon; skips only when mmad.server is not there yet."""
    try:
        found = importlib.util.find_spec("mmad.server.main")
    except ImportError as exc:
        found, why = None, f"{type(exc).__name__}: {exc}"
    else:
        why = "no module mmad.server.main"
    if found is None:
        pytest.skip(f"the daemon (mmad.server.main) cannot be imported, so there is nothing to talk to: {why}")
    tmp = tmp_path_factory.mktemp("daemon")
    port = free_port()
    log_path = tmp / "daemon.log"
    env = {**os.environ, "MMAD_API_KEY": API_KEY, "MMAD_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}
    env.pop("MMAD_BACKEND", None)
    cmd = [sys.executable, "-c", "import sys; from mmad.server.main import main; sys.exit(main(sys.argv[1:]))",
           "--host", "127.0.0.1", "--port", str(port), "--store", str(tmp / "store"), "--backend", "cpu",
           "--no-demo", "--probe", "cpu", "--log-level", "warning"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        # the loop below is the waiting: each probe is tried once
        with Client(url, timeout=Timeout(2.0), retry=None) as probe:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    pytest.fail(f"the daemon exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
                try:
                    if probe.health_ready():
                        break
                except E.TransportError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"the daemon was not ready after 60 s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # uvicorn re-raises the SIGTERM it handled once shutdown is complete, hence -SIGTERM
    log_text = log_path.read_text()
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in log_text, \
        f"the daemon did not stop cleanly ({proc.returncode}):\n{log_text[-3000:]}"


@pytest.fixture
def client(daemon):
    with Client(daemon, api_key=API_KEY) as c:
        yield c


def random_rows(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (rows, cols)).astype(np.float32)


def test_health_metadata_devices_metrics(client):
    assert client.health_live() is True
    assert client.health_ready() is True
    meta = client.server_metadata()
    assert meta["name"] == "mmad" and isinstance(meta["extensions"], list) and meta["extensions"]
    devices = client.devices()
    assert devices["selected"]["backend"] == "cpu"
    assert any(row["backend"] == "cpu" for row in devices["rows"])
    assert "# TYPE" in client.metrics()


def test_create_infer_binary_json_fp16_against_oracle(client):
    doc = spec_doc(seed=11)
    meta = client.create_model("live-infer", doc, config={"max_batch_rows": 4096, "max_queue_delay_us": 2000})
    assert meta["name"] == "live-infer" and meta["platform"] == "mmad"
    assert meta["inputs"][0]["name"] == "INPUT" and meta["inputs"][0]["shape"][-1] == N_IN
    assert client.model_metadata("live-infer")["outputs"][0]["shape"][-1] == N_OUT
    assert client.model_metadata("live-infer", version="1")["name"] == "live-infer"
    assert client.model_ready("live-infer") is True
    assert client.model_ready("live-infer", version="1") is True
    ref_model = oracle(doc, client.get_weights("live-infer"))
    x = random_rows(333, N_IN, seed=1)
    ref = ref_model.forward(x.astype(np.float64))

    out = client.infer("live-infer", x)
    assert out.dtype == np.float32 and out.shape == (333, N_OUT)
    assert rel_err(out, ref) <= 1e-5
    assert rel_err(client.infer("live-infer", x, binary=False), ref) <= 1e-5
    assert rel_err(client.infer("live-infer", x, version="1"), ref) <= 1e-5

    x16 = x.astype(np.float16)
    ref16 = ref_model.forward(x16.astype(np.float64))
    out16 = client.infer("live-infer", x16, output_dtype=np.float16)
    assert out16.dtype == np.float16
    assert rel_err(out16, ref16) <= 3e-3
    assert rel_err(client.infer("live-infer", x16), ref16) <= 1e-5  # FP16 in, FP32 out


def test_async_client_concurrent_infers_are_each_right(daemon, client):
    doc = spec_doc(seed=12)
    client.create_model("live-async", doc, config={"max_queue_delay_us": 5000})
    ref_model = oracle(doc, client.get_weights("live-async"))
    xs = [random_rows(20 + 7 * i, N_IN, seed=100 + i) for i in range(8)]

    async def main():
        async with AsyncClient(daemon, api_key=API_KEY) as aclient:
            assert await aclient.health_ready() is True
            assert (await aclient.model_metadata("live-async"))["name"] == "live-async"
            outs = await asyncio.gather(*(aclient.infer("live-async", x) for x in xs))
            losses = await aclient.train_step("live-async", xs[0], np.zeros((len(xs[0]), N_OUT), np.float32))
            status = await aclient.train("live-async", xs[7], np.ones((len(xs[7]), N_OUT), np.float32),
                                         steps=4, batch_size=16, progress=False)
            return outs, losses, status

    outs, losses, status = asyncio.run(main())
    for x, out in zip(xs, outs, strict=True):
        assert out.shape == (len(x), N_OUT)
        assert rel_err(out, ref_model.forward(x.astype(np.float64))) <= 1e-5
    assert losses.shape == (1,) and np.isfinite(losses).all()
    assert status["state"] == "done" and status["step"] >= 4


def test_train_step_follows_the_oracle_and_versions_pin(client):
    doc = spec_doc(seed=13)
    client.create_model("live-steps", doc)
    initial = client.get_weights("live-steps", version="1")
    ref_model = oracle(doc, initial)
    x = random_rows(64, N_IN, seed=2)
    y = np.sin(3 * x[:, :N_OUT]).astype(np.float32)

    losses = client.train_step("live-steps", x, y, steps=3)
    ref_losses = ref_model.train_step(x.astype(np.float64), y.astype(np.float64), steps=3)
    assert losses.shape == (3,)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    assert losses[-1] < losses[0]

    version = client.checkpoint("live-steps")
    listing = client.versions("live-steps")
    assert listing["latest"] == version and version != "1"
    assert [v["version"] for v in listing["versions"]][-1] == version
    trained = client.get_weights("live-steps", version=version)
    for name, value in ref_model.get_params().items():
        assert rel_err(trained[name], value.astype(np.float64)) <= 1e-4, name
    x_eval = random_rows(50, N_IN, seed=3)
    ref_v1 = oracle(doc, initial).forward(x_eval.astype(np.float64))
    ref_latest = oracle(doc, trained).forward(x_eval.astype(np.float64))
    assert rel_err(client.infer("live-steps", x_eval, version="1"), ref_v1) <= 1e-5
    assert rel_err(client.infer("live-steps", x_eval, version=version), ref_latest) <= 1e-5
    assert rel_err(client.infer("live-steps", x_eval), ref_latest) <= 1e-5


def test_set_and_get_weights(client):
    doc = spec_doc(seed=14)
    client.create_model("live-weights", doc)
    current = client.get_weights("live-weights")
    rng = np.random.default_rng(5)
    new = {k: rng.standard_normal(v.shape).astype(np.float32) * 0.3 for k, v in current.items()}
    version = client.set_weights("live-weights", new)
    assert client.versions("live-weights")["latest"] == version
    back = client.get_weights("live-weights", version=version)
    assert back.keys() == new.keys()
    for k in new:
        np.testing.assert_array_equal(back[k], new[k])
    x = random_rows(40, N_IN, seed=6)
    assert rel_err(client.infer("live-weights", x), oracle(doc, new).forward(x.astype(np.float64))) <= 1e-5
    with pytest.raises(E.BadRequest):
        client.set_weights("live-weights", {"W0": new["W0"]})  # incomplete set


def test_training_job_with_progress_bar_and_checkpoints(client, capsys):
    doc = spec_doc(seed=15)
    client.create_model("live-job", doc)
    x = random_rows(512, N_IN, seed=7)
    y = np.tanh(x[:, :N_OUT] * 2 - x[:, N_OUT:2 * N_OUT]).astype(np.float32)
    initial_loss, _ = oracle(doc, client.get_weights("live-job")).loss_and_grads(x.astype(np.float64), y)
    events = []
    status = client.train("live-job", x, y, steps=40, batch_size=64, checkpoint_every=20,
                          progress=lambda event, data: events.append((event, data)))
    assert status["state"] == "done" and status["step"] >= 40
    assert np.isfinite(status["loss"]) and status["loss"] < 0.7 * initial_loss
    progress = [d for e, d in events if e == "progress"]
    assert progress and [d["step"] for d in progress] == sorted(d["step"] for d in progress)
    assert progress[-1]["step"] == 40
    assert all(np.isfinite(d["loss"]) for d in progress if d["loss"] is not None)
    checkpoints = [d["version"] for e, d in events if e == "checkpoint"]
    assert checkpoints and set(checkpoints) <= {v["version"] for v in client.versions("live-job")["versions"]}
    assert events[-1][0] == "done"

    capsys.readouterr()
    status = client.train("live-job", x, y, steps=10, batch_size=64)  # the default bar, on stderr
    assert status["state"] == "done"
    assert "10/10" in capsys.readouterr().err


def test_cancel_a_running_job(client):
    client.create_model("live-cancel", spec_doc(seed=16))
    x = random_rows(256, N_IN, seed=8)
    dataset = client.upload_dataset("live-cancel", x, x[:, :N_OUT])
    job = client.start_job("live-cancel", dataset, steps=1_000_000, batch_size=32)
    client.cancel_job("live-cancel", job)
    status = client.follow_job("live-cancel", job, progress=False)
    assert status["state"] == "cancelled" and status["step"] < 1_000_000
    assert client.job_status("live-cancel", job)["state"] == "cancelled"


def test_repository_load_unload_stats_delete(client):
    client.create_model("live-repo", spec_doc(seed=17))
    x = random_rows(10, N_IN, seed=9)
    for _ in range(3):
        client.infer("live-repo", x)
    stats = client.stats("live-repo")["model_stats"][0]
    assert stats["inference_stats"]["success"]["count"] >= 3
    assert stats["inference_count"] >= 3
    assert 'model="live-repo"' in client.metrics()
    index = {m["name"]: m for m in client.repository_index()}
    assert "live-repo" in index
    client.unload("live-repo")
    assert client.model_ready("live-repo") is False
    with pytest.raises(E.MMADClientError):
        client.infer("live-repo", x)
    client.load("live-repo")
    assert client.model_ready("live-repo") is True
    assert client.infer("live-repo", x).shape == (10, N_OUT)
    client.delete_model("live-repo")
    with pytest.raises(E.NotFound):
        client.model_metadata("live-repo")


def test_full_queue_is_service_unavailable_with_retry_after(daemon, client, caplog):
    doc = spec_doc(seed=19)
    # one waiting request at most, held 0.2 s for company: a burst must overflow
    client.create_model("live-queue", doc, config={"max_queue_requests": 1, "max_queue_delay_us": 200_000})
    ref_model = oracle(doc, client.get_weights("live-queue"))
    x = random_rows(10, N_IN, seed=10)

    async def burst(retry, n):
        async with AsyncClient(daemon, retry=retry) as aclient:
            return await asyncio.gather(*(aclient.infer("live-queue", x) for _ in range(n)), return_exceptions=True)

    # sent once, the overflow is refused with the server's Retry-After
    results = asyncio.run(burst(None, 12))
    refused = [r for r in results if isinstance(r, Exception)]
    served = [r for r in results if not isinstance(r, Exception)]
    assert refused and served
    assert all(isinstance(r, E.ServiceUnavailable) and r.retry_after and r.retry_after > 0 for r in refused), refused
    ref = ref_model.forward(x.astype(np.float64))
    assert all(rel_err(out, ref) <= 1e-5 for out in served)
    # retried, the refused ones wait the Retry-After (1 s) and are served (fewer than above, so
    # the test takes a few rounds of waits, not a dozen; 8 tries each outlast any overflow)
    with caplog.at_level(logging.INFO, logger="mmad_client"):
        results = asyncio.run(burst(Retry(attempts=8), 5))
    assert all(not isinstance(r, Exception) and rel_err(r, ref) <= 1e-5 for r in results), results
    waits = [float(r.getMessage().split(" in ")[-1].removesuffix(" s")) for r in caplog.records
             if ": 503" in r.getMessage()]
    assert waits and all(1.0 <= w <= 1.0 + Retry().jitter for w in waits), waits


def test_errors_are_typed(daemon, client):
    client.create_model("live-errors", spec_doc(seed=18))
    with pytest.raises(E.NotFound):
        client.infer("no-such-model", random_rows(2, N_IN, seed=0))
    with pytest.raises(E.NotFound):
        client.infer("live-errors", random_rows(2, N_IN, seed=0), version="999")
    with pytest.raises(E.BadRequest, match="INPUT"):
        client.infer("live-errors", random_rows(2, N_IN + 1, seed=0))  # wrong width
    with pytest.raises(E.BadRequest, match="NaN"):
        client.infer("live-errors", np.full((2, N_IN), np.nan, np.float32))
    bad = spec_doc()
    bad["network"]["n_neurons"] = 17
    with pytest.raises(E.BadRequest, match="n_neurons"):
        client.create_model("live-bad-spec", bad)
    with pytest.raises(E.NotFound):
        client.follow_job("live-errors", "no-such-job", progress=False)
    with pytest.raises(E.NotFound):
        client.job_status("live-errors", "no-such-job")
    with pytest.raises(E.PayloadTooLarge):
        client.infer("live-errors", np.zeros((MAX_BODY_BYTES // (4 * N_IN) + 1024, N_IN), np.float32))
    with Client(daemon) as anonymous:
        assert anonymous.model_metadata("live-errors")["name"] == "live-errors"  # reading needs no key
        with pytest.raises(E.Unauthorized):
            anonymous.create_model("live-no-key", spec_doc())
    with Client(daemon, api_key="wrong") as wrong:
        with pytest.raises((E.Unauthorized, E.Forbidden)):
            wrong.delete_model("live-errors")
    with pytest.raises(E.TransportError):
        with Client(f"http://127.0.0.1:{free_port()}", timeout=Timeout(2.0), retry=None) as nobody:
            nobody.health_live()
    assert mmad_client.__version__
