"""The daemon as a process: kill -9 during training loses no acknowledged version, SIGTERM
checkpoints running jobs, the API key guards mutating endpoints, bad settings fail startup."""

from __future__ import annotations

import concurrent.futures
import hashlib
import subprocess
import sys
import time

import httpx
import numpy as np
import orjson
from safetensors.numpy import load as st_load, save as st_save

from conftest import REPO, DaemonProcess
from test_server_api import SMALL_SPEC, binary_infer, decode_binary, oracle, rel_err


def start_training(client: httpx.Client, steps: int, checkpoint_every: int) -> str:
    r = client.put("/v2/models/field", json={"spec": SMALL_SPEC})
    assert r.status_code == 201, r.text
    rng = np.random.default_rng(4)
    x = rng.uniform(-1, 1, (2048, 5)).astype(np.float32)
    y = np.sin(3 * x[:, :4]).astype(np.float32)
    dataset = client.post("/v2/models/field/datasets", content=st_save({"x": x, "y": y})).json()["dataset"]
    r = client.post("/v2/models/field/jobs", json={"dataset": dataset, "steps": steps, "batch_size": 128,
                                                   "checkpoint_every": checkpoint_every})
    assert r.status_code == 202, r.text
    return r.json()["job"]


def events(client: httpx.Client, job: str):
    with client.stream("GET", f"/v2/models/field/jobs/{job}/events", timeout=60) as stream:
        name = None
        for line in stream.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                yield name, orjson.loads(line[6:])


def test_kill_9_during_training_loses_no_acknowledged_version(tmp_path):
    store = tmp_path / "store"
    daemon = DaemonProcess(store, "--no-demo").start()
    acknowledged: dict[str, str] = {}  # version -> sha256 of the weights the daemon served for it
    try:
        with httpx.Client(base_url=daemon.url, timeout=30) as client:
            job = start_training(client, steps=10**6, checkpoint_every=5)
            for name, data in events(client, job):
                if name == "checkpoint":
                    weights = client.get("/v2/models/field/weights", params={"version": data["version"]})
                    assert weights.status_code == 200
                    acknowledged[data["version"]] = hashlib.sha256(weights.content).hexdigest()
                    if len(acknowledged) == 4:
                        daemon.kill()  # SIGKILL mid-training: no shutdown code runs
                        break
    finally:
        daemon.kill()
    assert daemon.proc.returncode == -9

    restarted = DaemonProcess(store, "--no-demo").start()
    try:
        with httpx.Client(base_url=restarted.url, timeout=30) as client:
            listing = {v["version"]: v for v in client.get("/v2/models/field/versions").json()["versions"]}
            x = np.random.default_rng(8).uniform(-1, 1, (64, 5)).astype(np.float32)
            for version, sha in acknowledged.items():
                assert version in listing, f"acknowledged version {version} is gone"
                assert listing[version]["sha256"] == sha
                weights = client.get("/v2/models/field/weights", params={"version": version}).content
                assert hashlib.sha256(weights).hexdigest() == sha
                _, out = decode_binary(binary_infer(client, "field", x, version=version))
                assert rel_err(out, oracle(client, "field", x, version=version)) <= 1e-5
            # the live model restarts from the newest acknowledged version, optimizer state included
            latest = max(listing, key=int)
            live = st_load(client.get("/v2/models/field/weights").content)
            stored = st_load(client.get("/v2/models/field/weights", params={"version": latest}).content)
            assert all(np.array_equal(live[k], stored[k]) for k in stored)
            assert client.get("/v2/models/field").json()["step"] == listing[latest]["step"]
        leftovers = [p for p in store.rglob("*") if p.name.startswith(".")]
        assert not leftovers, f"temp files survived the restart: {leftovers}"
    finally:
        restarted.stop()


def test_sigterm_checkpoints_the_running_job(tmp_path):
    store = tmp_path / "store"
    daemon = DaemonProcess(store, "--no-demo").start()
    with httpx.Client(base_url=daemon.url, timeout=30) as client, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        # an infer request that sits in its batcher's queue for 1.5 s while the daemon is told to stop
        r = client.put("/v2/models/slow", json={"spec": SMALL_SPEC, "config": {"max_queue_delay_us": 1_500_000}})
        assert r.status_code == 201
        job = start_training(client, steps=10**6, checkpoint_every=10**6)
        in_flight = None
        final = None
        for name, data in events(client, job):
            if name == "progress" and data["step"] >= 3 and in_flight is None:
                in_flight = pool.submit(binary_infer, httpx.Client(base_url=daemon.url, timeout=30), "slow",
                                        np.ones((2, 5), np.float32))
                deadline = time.monotonic() + 10
                while client.get("/v2/models/slow").json()["queued_requests"] == 0:
                    assert time.monotonic() < deadline, "the infer request never reached the queue"
                    time.sleep(0.02)
                daemon.proc.terminate()  # graceful: the job must write a last version, the stream must end
            if name in ("done", "cancelled", "failed"):
                final = (name, data)
        assert in_flight.result().status_code == 200  # the in-flight request finished
    assert daemon.proc.wait(30) in (0, -15)
    assert final is not None and final[0] == "cancelled" and "shutting down" in final[1]["error"]
    assert final[1]["versions"] == ["2"]
    restarted = DaemonProcess(store, "--no-demo").start()
    try:
        versions = httpx.get(f"{restarted.url}/v2/models/field/versions").json()["versions"]
        assert versions[-1]["version"] == "2" and versions[-1]["step"] >= final[1]["step"] >= 3
    finally:
        restarted.stop()


def test_api_key_guards_mutating_endpoints(tmp_path):
    daemon = DaemonProcess(tmp_path / "store", "--api-key", "s3cret").start()
    try:
        with httpx.Client(base_url=daemon.url, timeout=30) as client:
            body = {"spec": SMALL_SPEC}
            r = client.put("/v2/models/guarded", json=body)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer" and "error" in r.json()
            r = client.put("/v2/models/guarded", json=body, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 403
            good = {"Authorization": "Bearer s3cret"}
            assert client.put("/v2/models/guarded", json=body, headers=good).status_code == 201
            for method, path in (("POST", "/v2/models/guarded/versions"), ("DELETE", "/v2/models/guarded"),
                                 ("POST", "/v2/models/guarded/train"), ("PUT", "/v2/models/guarded/weights"),
                                 ("POST", "/v2/repository/models/guarded/unload"),
                                 ("POST", "/v2/models/guarded/datasets"), ("POST", "/v2/models/guarded/jobs")):
                assert client.request(method, path).status_code == 401, (method, path)
            # reads and inference need no key
            assert decode_binary(binary_infer(client, "guarded", np.ones((2, 5), np.float32)))[1].shape == (2, 4)
            assert client.get("/v2/models/guarded/versions").status_code == 200
            assert client.post("/v2/models/guarded/versions", headers=good).json()["version"] == "2"
            assert client.delete("/v2/models/guarded", headers=good).status_code == 200
    finally:
        daemon.stop()


def test_unknown_backend_fails_startup_with_the_reason(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mmad.server.main", "--backend", "bogus", "--port", "0",
                           "--store", str(tmp_path / "store")], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "unknown backend 'bogus'" in proc.stdout + proc.stderr


def test_keep_versions_setting_prunes_old_versions(tmp_path):
    """--keep-versions 2: each new version drops the oldest beyond two; pinned requests for a
    dropped version get 404, the kept ones still serve."""
    daemon = DaemonProcess(tmp_path / "store", "--no-demo", "--keep-versions", "2").start()
    try:
        with httpx.Client(base_url=daemon.url, timeout=30) as client:
            assert client.put("/v2/models/kept", json={"spec": SMALL_SPEC}).status_code == 201
            w1 = st_load(client.get("/v2/models/kept/weights").content)
            for version in ("2", "3", "4"):
                scaled = {k: (v * np.float32(int(version))).astype(np.float32) for k, v in w1.items()}
                r = client.put("/v2/models/kept/weights", content=st_save(scaled))
                assert r.status_code == 200 and r.json()["version"] == version
            listing = client.get("/v2/models/kept/versions").json()
            assert [v["version"] for v in listing["versions"]] == ["3", "4"] and listing["latest"] == "4"
            assert client.get("/v2/models/kept/weights", params={"version": "2"}).status_code == 404
            kept = st_load(client.get("/v2/models/kept/weights", params={"version": "3"}).content)
            assert all(np.array_equal(kept[k], w1[k] * np.float32(3)) for k in w1)
    finally:
        daemon.stop()
    names = sorted(p.name for p in (tmp_path / "store" / "models" / "kept" / "weights").iterdir())
    assert names == ["3.safetensors", "4.safetensors"]
