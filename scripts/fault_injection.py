#!/usr/bin/env python3
"""Fault injection: kill -9 the daemon at random points during checkpointing training jobs and
weight uploads, restart it on the same store, and check that nothing acknowledged was lost.

Each round starts ``python -m mmad.server.main`` (cpu backend, 127.0.0.1, a free port) on one
store directory, checks the store, runs a random scenario (a training job that checkpoints
every few steps, a stream of weight uploads, or both at once) and SIGKILLs the process after a
random delay. A version counts as *acknowledged* once the client has seen it: the response of
``PUT /weights``, or the job's status listing it (a job lists a version only after the store
has committed it). After every restart:

- every acknowledged version is listed with the sha256 seen when it was acknowledged;
- the weights of every version acknowledged since the last restart (plus a random sample of
  older ones) download with that sha256, uploads come back bit for bit, and inference pinned
  to those versions answers (the version loads);
- the model is READY (its startup load re-checks every listed version's sha256);
- no temporary or partial file is visible in the store: no dot-file, no ``*.tmp``, no weight or
  optimizer file of a version the listing does not name.

Usage: ``python scripts/fault_injection.py --kills 200 --seed 1`` (prints a JSON report;
exit status 1 if any check failed). ``tests/test_fault_injection.py`` runs 50 kills.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from safetensors.numpy import load as st_load, save as st_save

REPO = Path(__file__).resolve().parents[1]
MODEL = "fi"
SPEC = {"n_input_dims": 4, "n_output_dims": 2, "network": {"n_neurons": 16, "n_hidden_layers": 1},
        "precision": "fp32", "seed": 11}
PARAM_SHAPES = {"W0": (16, 4), "b0": (16,), "W1": (2, 16), "b1": (2,)}
DATASET_ROWS = 256
OLD_VERSION_SAMPLE = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Zygote:
    """A process that has imported the daemon's modules once and forks a fresh daemon on request.

    A restart then costs the daemon's own startup (store, model loads, uvicorn) instead of
    also re-importing FastAPI and NumPy, which is most of the time on a small machine. Every
    forked daemon is a separate process, built from scratch by ``main(argv)``, and is what the
    harness kills with SIGKILL.
    """

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, cwd=REPO, text=True,
                                     env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the zygote did not start")

    def spawn(self, argv: list[str], log_path: Path) -> int:
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log_path)}) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(10)


def zygote_main() -> int:
    from mmad.server import app as _app  # noqa: F401  (the imports are the point)
    from mmad.server import main as daemon_main
    import uvicorn  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            sys.stdin.close()
            try:
                code = daemon_main.main(request["argv"])
            except BaseException:  # noqa: BLE001 - report anything, then leave without cleanup
                import traceback
                traceback.print_exc()
                code = 70
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(pid, flush=True)
    return 0


class Daemon:
    """The daemon on 127.0.0.1 in its own process; ``kill()`` is a kill -9.

    Started with ``python -m mmad.server.main`` or, given a :class:`Zygote`, forked from it.
    """

    def __init__(self, store: Path, *args: str, log_path: Path | None = None, zygote: Zygote | None = None,
                 demo: bool = False):
        self.store = Path(store)
        self.demo = demo
        self.args = args
        self.zygote = zygote
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or self.store.parent / "daemon.log"
        self.pid: int | None = None
        self.proc: subprocess.Popen | None = None
        self.command = [sys.executable, "-m", "mmad.server.main"]  # without a zygote

    def argv(self) -> list[str]:
        return ["--host", "127.0.0.1", "--port", str(self.port), "--store", str(self.store), "--backend", "cpu",
                "--probe", "cpu", "--log-level", "warning", "--grpc-port", "0", *([] if self.demo else ["--no-demo"]),
                *self.args]

    def start(self, timeout_s: float = 60.0) -> "Daemon":
        self.port = free_port()  # a fresh port per start: the killed one may linger in TIME_WAIT
        self.url = f"http://127.0.0.1:{self.port}"
        self.store.parent.mkdir(parents=True, exist_ok=True)
        if self.zygote is not None:
            self.proc, self.pid = None, self.zygote.spawn(self.argv(), self.log_path)
        else:
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen([*self.command, *self.argv()],
                                             stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
            self.pid = self.proc.pid
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"the daemon exited at startup:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"the daemon was not ready after {timeout_s} s:\n{self.log_tail()}")

    @property
    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self.pid is None:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def _wait_gone(self, timeout_s: float) -> None:
        if self.proc is not None:
            self.proc.wait(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        while self.alive:
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {self.pid} is still alive after {timeout_s} s")
            time.sleep(0.005)

    def kill(self) -> None:
        if self.alive:
            os.kill(self.pid, signal.SIGKILL)
        self._wait_gone(30)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (the graceful path) and wait; kill -9 if it hangs."""
        if self.alive:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self._wait_gone(timeout_s)
            except (TimeoutError, subprocess.TimeoutExpired):
                self.kill()
                raise


@dataclass
class Acked:
    version: str
    sha256: str | None  # None: seen in a job listing, killed before its sha256 could be read
    params: dict[str, np.ndarray] | None = None  # what was uploaded, for a bit-exact comparison
    round: int = 0


@dataclass
class Report:
    kills: int = 0
    rounds: int = 0
    acked_versions: int = 0
    acked_by_job: int = 0
    acked_by_upload: int = 0
    versions_downloaded: int = 0
    versions_inferred: int = 0
    kills_during_job: int = 0
    kills_during_upload: int = 0
    restart_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0

    def to_json(self) -> dict:
        doc = {k: v for k, v in self.__dict__.items() if k != "restart_s"}
        if self.restart_s:
            doc["restart_s_median"] = round(float(np.median(self.restart_s)), 3)
            doc["restart_s_max"] = round(max(self.restart_s), 3)
        doc["elapsed_s"] = round(self.elapsed_s, 1)
        return doc


def random_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(s).astype(np.float32) * 0.3 for k, s in PARAM_SHAPES.items()}


def visible_leftovers(store: Path) -> list[str]:
    """Temporary or partial files a restarted daemon has left in its store."""
    bad = []
    for path in store.rglob("*"):
        rel = path.relative_to(store)
        if any(part.startswith(".") for part in rel.parts) or path.name.endswith(".tmp"):
            bad.append(f"temporary file visible: {rel}")
    for model_dir in (store / "models").glob("*"):
        listing = model_dir / "versions.json"
        if not listing.is_file():
            bad.append(f"model directory without versions.json: {model_dir.relative_to(store)}")
            continue
        listed = {v["version"] for v in json.loads(listing.read_bytes())["versions"]}
        for sub in ("weights", "optimizer"):
            for f in (model_dir / sub).glob("*.safetensors"):
                if f.name.removesuffix(".safetensors") not in listed:
                    bad.append(f"unlisted (partial) version file: {f.relative_to(store)}")
            for v in listed:
                if not (model_dir / sub / f"{v}.safetensors").is_file():
                    bad.append(f"listed version {v} lacks {sub}/{v}.safetensors")
    return bad


class Harness:
    def __init__(self, store: Path, seed: int, zygote: Zygote | None = None):
        self.store = store
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.daemon = Daemon(store, "--keep-versions", "0", zygote=zygote)  # every acknowledged version is checked
        self.acked: dict[str, Acked] = {}
        self.lock = threading.Lock()
        self.report = Report()
        self.dataset: str | None = None
        self.seen_leftovers: set[str] = set()

    # -- acknowledgement ------------------------------------------------------------------
    def ack(self, version: str, sha256: str | None, params=None, by: str = "job") -> None:
        with self.lock:
            known = self.acked.get(version)
            if known is None:
                self.acked[version] = Acked(version, sha256, params, self.report.rounds)
                self.report.acked_versions += 1
                if by == "job":
                    self.report.acked_by_job += 1
                else:
                    self.report.acked_by_upload += 1
            elif known.sha256 is None and sha256 is not None:
                known.sha256 = sha256
            elif sha256 is not None and known.sha256 != sha256:
                self.fail(f"version {version} was acknowledged twice with different sha256")

    def fail(self, message: str) -> None:
        self.report.failures.append(f"round {self.report.rounds}: {message}")

    # -- one round ------------------------------------------------------------------------
    def setup(self, http: httpx.Client) -> None:
        r = http.put(f"/v2/models/{MODEL}", json={"spec": SPEC})
        if r.status_code != 201:
            raise RuntimeError(f"cannot create the model: {r.status_code} {r.text}")
        first = http.get(f"/v2/models/{MODEL}/versions").json()["versions"][0]
        self.ack(first["version"], first["sha256"], by="upload")

    def ensure_dataset(self, http: httpx.Client) -> str:
        if self.dataset is None:
            x = self.np_rng.standard_normal((DATASET_ROWS, 4)).astype(np.float32)
            y = np.tanh(x[:, :2] * 1.5).astype(np.float32)
            r = http.post(f"/v2/models/{MODEL}/datasets", content=st_save({"x": x, "y": y}))
            if r.status_code != 200:
                raise RuntimeError(f"cannot upload the dataset: {r.status_code} {r.text}")
            self.dataset = r.json()["dataset"]  # survives restarts: it is a file in the store
        return self.dataset

    def verify(self, http: httpx.Client) -> None:
        meta = http.get(f"/v2/models/{MODEL}")
        if meta.status_code != 200 or meta.json().get("state") != "READY":
            self.fail(f"model not READY after restart: {meta.status_code} {meta.text[:300]}")
            return
        listing = {v["version"]: v["sha256"] for v in http.get(f"/v2/models/{MODEL}/versions").json()["versions"]}
        with self.lock:
            acked = list(self.acked.values())
        for a in acked:
            if a.version not in listing:
                self.fail(f"acknowledged version {a.version} is missing after restart")
            elif a.sha256 is not None and listing[a.version] != a.sha256:
                self.fail(f"version {a.version}: sha256 {listing[a.version]} after restart, {a.sha256} when acked")
        fresh = [a for a in acked if a.round >= self.report.rounds - 1]
        older = [a for a in acked if a.round < self.report.rounds - 1]
        sample = fresh + self.rng.sample(older, min(OLD_VERSION_SAMPLE, len(older)))
        for a in sample:
            if a.version not in listing:
                continue
            r = http.get(f"/v2/models/{MODEL}/weights", params={"version": a.version})
            self.report.versions_downloaded += 1
            if r.status_code != 200:
                self.fail(f"version {a.version} does not download: {r.status_code} {r.text[:200]}")
                continue
            digest = hashlib.sha256(r.content).hexdigest()
            if digest != listing[a.version]:
                self.fail(f"version {a.version}: downloaded bytes hash to {digest}, listed {listing[a.version]}")
            if a.params is not None:
                got = st_load(r.content)
                if any(not np.array_equal(got[k], v) for k, v in a.params.items()):
                    self.fail(f"version {a.version}: the uploaded weights came back different")
        x = self.np_rng.standard_normal((3, 4)).astype(np.float32)
        body = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [3, 4], "data": x.ravel().tolist()}]}
        for a in fresh[-3:] + sample[-2:]:
            if a.version not in listing:
                continue
            r = http.post(f"/v2/models/{MODEL}/versions/{a.version}/infer", json=body)
            self.report.versions_inferred += 1
            if r.status_code != 200 or not np.isfinite(r.json()["outputs"][0]["data"]).all():
                self.fail(f"version {a.version} does not serve: {r.status_code} {r.text[:200]}")
        for problem in visible_leftovers(self.store):
            if problem not in self.seen_leftovers:  # report each leftover once, where it appeared
                self.seen_leftovers.add(problem)
                self.fail(problem)

    def job_activity(self, url: str, stop: threading.Event) -> None:
        """Start a long checkpointing job and record every version it lists, with its sha256."""
        with httpx.Client(base_url=url, timeout=5.0) as http:
            try:
                r = http.post(f"/v2/models/{MODEL}/jobs", json={
                    "dataset": self.dataset, "steps": 1_000_000, "batch_size": 32,
                    "checkpoint_every": self.rng.randint(2, 12)})
                if r.status_code != 202:
                    if r.status_code != 409:  # 409: a job of the previous life is not possible; report
                        self.fail(f"job refused: {r.status_code} {r.text[:200]}")
                    return
                job = r.json()["job"]
                while not stop.is_set():
                    status = http.get(f"/v2/models/{MODEL}/jobs/{job}").json()
                    new = [v for v in status["versions"] if v not in self.acked]
                    for v in new:
                        self.ack(v, None, by="job")
                    if new:
                        for entry in http.get(f"/v2/models/{MODEL}/versions").json()["versions"]:
                            if entry["version"] in new:
                                self.ack(entry["version"], entry["sha256"], by="job")
                    time.sleep(0.01)
            except (httpx.HTTPError, ValueError, KeyError):
                return  # the daemon was killed mid-request

    def upload_activity(self, url: str, stop: threading.Event, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with httpx.Client(base_url=url, timeout=5.0) as http:
            try:
                while not stop.is_set():
                    params = random_params(rng)
                    r = http.put(f"/v2/models/{MODEL}/weights", content=st_save(params))
                    if r.status_code != 200:
                        self.fail(f"upload refused: {r.status_code} {r.text[:200]}")
                        return
                    entry = r.json()
                    self.ack(entry["version"], entry["sha256"], params, by="upload")
            except (httpx.HTTPError, ValueError, KeyError):
                return

    def round(self) -> None:
        t0 = time.perf_counter()
        self.daemon.start()
        self.report.restart_s.append(time.perf_counter() - t0)
        url = self.daemon.url
        with httpx.Client(base_url=url, timeout=10.0) as http:
            if self.report.rounds == 0:
                self.setup(http)
            self.verify(http)
            self.ensure_dataset(http)
        scenario = self.rng.choice(["job", "upload", "both"])
        stop = threading.Event()
        threads = []
        if scenario in ("job", "both"):
            threads.append(threading.Thread(target=self.job_activity, args=(url, stop)))
            self.report.kills_during_job += 1
        if scenario in ("upload", "both"):
            threads.append(threading.Thread(target=self.upload_activity,
                                            args=(url, stop, self.rng.randrange(1 << 30))))
            self.report.kills_during_upload += 1
        for t in threads:
            t.start()
        time.sleep(self.rng.uniform(0.05, 0.8))
        self.daemon.kill()
        self.report.kills += 1
        stop.set()
        for t in threads:
            t.join(10)
        self.report.rounds += 1


def run(kills: int, seed: int = 0, store: Path | None = None, budget_s: float | None = 600.0, fork: bool = True,
        min_acks: int = 0, max_kills: int | None = None) -> Report:
    """``kills`` kill -9 rounds, then more while fewer than ``min_acks`` versions were
    acknowledged by each path (a slow machine does less between kills), up to ``max_kills``
    rounds in all; stops early, with a failure, when ``budget_s`` (None: no limit) runs out."""
    root = Path(store) if store is not None else Path(tempfile.mkdtemp(prefix="mmad-fi-"))
    zygote = Zygote() if fork else None
    harness = Harness(root / "store", seed, zygote)
    report = harness.report
    t0 = time.perf_counter()

    def more() -> bool:
        if report.kills < kills:
            return True
        return (report.kills < (max_kills or kills)
                and min(report.acked_by_job, report.acked_by_upload) < min_acks)

    try:
        while more():
            if budget_s is not None and time.perf_counter() - t0 > budget_s:
                harness.fail(f"time budget of {budget_s} s ran out after {harness.report.kills} kills")
                break
            harness.round()
        # a final restart checks the last kill too
        harness.daemon.start()
        with httpx.Client(base_url=harness.daemon.url, timeout=10.0) as http:
            harness.verify(http)
        harness.daemon.stop()
    finally:
        harness.daemon.kill()
        if zygote is not None:
            zygote.close()
        harness.report.elapsed_s = time.perf_counter() - t0
    return harness.report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--store", type=Path, help="keep the store here (default: a temporary directory)")
    p.add_argument("--budget-s", type=float, default=3600.0)
    p.add_argument("--no-fork", dest="fork", action="store_false",
                   help="start every daemon with a fresh interpreter instead of forking a preloaded one")
    p.add_argument("--zygote", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.zygote:
        return zygote_main()
    # SIGTERM (e.g. from `timeout`) unwinds like an exception, so the daemon and zygote are stopped
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    report = run(args.kills, args.seed, args.store, args.budget_s, args.fork)
    print(json.dumps(report.to_json(), indent=1))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
