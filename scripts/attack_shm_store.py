"""Attacks on shared memory, the store and restarts, each against a real daemon on 127.0.0.1.

One subcommand per attack, bounded by a count (never by time), each ending with a one-line
summary and exit status 1 when the daemon did anything but refuse cleanly
(docs/reliability.md, "Shared memory, the store and restarts", has the figures)::

    python scripts/attack_shm_store.py shrink-region [--rounds 1000]     # ftruncate under running infers
    python scripts/attack_shm_store.py sparse-region [--rounds 1000]     # a 64 MiB sparse object, 4 MiB /dev/shm
    python scripts/attack_shm_store.py register-foreign                  # another user's object (root)
    python scripts/attack_shm_store.py register-flood [--count 10000]    # registrations until refused
    python scripts/attack_shm_store.py versions-startup 4000             # start-up and upload p50 vs versions
    python scripts/attack_shm_store.py delete-readonly                   # DELETE on a read-only store (root)
    python scripts/attack_shm_store.py pinned-race [--rounds 200]        # pinned infers racing unload/load

The shared-memory attacks keep a second model answering throughout; every answer of it must
be a correct 200. ``--backend cuda --workers 2`` runs them against page-locked regions (the
primary's region forwards: scripts/gpu/service_check.sh's ``shm`` phase). ``sparse-region``
runs the daemon in a mount namespace of its own (``unshare``: root, or user namespaces) with a
4 MiB /dev/shm; ``register-foreign`` and ``delete-readonly`` need root (another user; a mount).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_injection import Daemon  # noqa: E402  (the shared loopback daemon launcher)

SPEC = {"n_input_dims": 5, "n_output_dims": 4, "network": {"n_neurons": 32, "n_hidden_layers": 2},
        "precision": "fp16", "seed": 7}  # fp16: what every backend computes (cuda only fp16)
IN_COLS, OUT_COLS = 2, 3  # the demo model
SHM = "/dev/shm"


def backend_args(args) -> list[str]:
    out = ["--backend", args.backend, "--probe", args.backend.split(":")[0]]
    return out + (["--workers", str(args.workers)] if args.workers else [])


class Bystander:
    """Another model asked for an answer over and over while an attack runs."""

    def __init__(self, url: str):
        self.client = httpx.Client(base_url=url, timeout=60.0)
        r = self.client.put("/v2/models/bystander", json={"spec": SPEC})
        if r.is_error:
            raise SystemExit(f"creating the bystander model failed: {r.status_code} {r.text}")
        self.x = np.random.default_rng().uniform(-1, 1, (16, 5)).astype(np.float32)
        self.want = self._infer()
        self.codes: Counter = Counter()
        self.wrong = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _infer(self) -> list | None:
        r = self.client.post("/v2/models/bystander/infer", json={"inputs": [
            {"name": "INPUT", "datatype": "FP32", "shape": [16, 5], "data": self.x.ravel().tolist()}]})
        self.last = r.status_code
        return r.json()["outputs"][0]["data"] if r.status_code == 200 else None

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                out = self._infer()
            except httpx.HTTPError:
                self.codes["dropped"] += 1
                return
            self.codes[self.last] += 1
            if out is not None and not np.allclose(out, self.want, rtol=1e-5, atol=1e-6):
                self.wrong += 1

    def finish(self) -> bool:
        self.stop.set()
        self.thread.join(60)
        self.client.close()
        return set(self.codes) == {200} and not self.wrong

    def words(self) -> str:
        wrong = f", {self.wrong} wrong" if self.wrong else ""
        return f"bystander {sum(self.codes.values())} answers {dict(self.codes)}{wrong}"


def make_object(root: str, nbytes: int, data: bytes = b"") -> str:
    key = f"/mmad-attack-{uuid.uuid4().hex[:12]}"
    fd = os.open(root + key, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        if data:
            os.pwrite(fd, data, 0)
    finally:
        os.close(fd)
    return key


def region_infer(client: httpx.Client, name: str, rows: int, out_offset: int) -> httpx.Response:
    return client.post("/v2/models/demo/infer", json={
        "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [rows, IN_COLS], "parameters": {
            "shared_memory_region": name, "shared_memory_byte_size": rows * IN_COLS * 4}}],
        "outputs": [{"name": "OUTPUT", "parameters": {
            "shared_memory_region": name, "shared_memory_offset": out_offset,
            "shared_memory_byte_size": rows * OUT_COLS * 4}}]})


def summary(name: str, ok: bool, words: str) -> int:
    print(f"{name}: {'PASS' if ok else 'FAIL'}: {words}")
    return 0 if ok else 1


def started(tmp: Path, *args: str, command: list[str] | None = None) -> Daemon:
    daemon = Daemon(tmp / "store", *args, log_path=tmp / "daemon.log", demo=True)
    if command is not None:
        daemon.command = command
    return daemon.start(timeout_s=300)


# -- shared memory ------------------------------------------------------------------------------
def shrink_region(args, tmp: Path) -> int:
    daemon = started(tmp, *backend_args(args))
    rows = 4096
    in_bytes, out_bytes = rows * IN_COLS * 4, rows * OUT_COLS * 4
    x = np.random.default_rng().uniform(-1, 1, (rows, IN_COLS)).astype(np.float32)
    key = make_object(SHM, in_bytes + out_bytes, x.tobytes())
    codes: Counter = Counter()
    try:
        with httpx.Client(base_url=daemon.url, timeout=60.0) as admin:
            admin.post("/v2/systemsharedmemory/region/target/register",
                       json={"key": key, "byte_size": in_bytes + out_bytes}).raise_for_status()
            bystander = Bystander(daemon.url)
            stop = threading.Event()

            def client() -> None:
                with httpx.Client(base_url=daemon.url, timeout=60.0) as c:
                    while not stop.is_set():
                        try:
                            codes[region_infer(c, "target", rows, in_bytes).status_code] += 1
                        except httpx.HTTPError:
                            codes["dropped"] += 1
                            return

            threads = [threading.Thread(target=client) for _ in range(3)]
            for t in threads:
                t.start()
            fd = os.open(SHM + key, os.O_RDWR)
            try:
                for i in range(args.rounds):
                    if not daemon.alive:
                        break
                    os.ftruncate(fd, (i * 997) % in_bytes)
                    time.sleep(0.001)
                    os.pwrite(fd, x.tobytes(), 0)
                    os.ftruncate(fd, in_bytes + out_bytes)
                    time.sleep(0.001)
            finally:
                os.close(fd)
                stop.set()
                for t in threads:
                    t.join(60)
            calm = bystander.finish()
            alive = daemon.alive
        ok = alive and calm and set(codes) <= {200, 400}
        return summary("shrink-region", ok, f"{args.rounds} truncation rounds, {sum(codes.values())} region infers "
                                             f"{dict(codes)}, {bystander.words()}, daemon "
                                             f"{'alive' if alive else 'DEAD: ' + daemon.log_tail(300)}")
    finally:
        os.unlink(SHM + key)
        daemon.stop()


def sparse_region(args, tmp: Path) -> int:
    if shutil.which("unshare") is None:
        return summary("sparse-region", False, "needs unshare (util-linux)")
    prefix = ["unshare", "--mount", "--map-root-user", "sh", "-c",
              'mount -t tmpfs -o size=4m mmad-small-shm /dev/shm && exec "$@"', "sh"]
    daemon = started(tmp, *backend_args(args), command=[*prefix, sys.executable, "-m", "mmad.server.main"])
    small_shm = f"/proc/{daemon.pid}/root{SHM}"  # the daemon's own 4 MiB /dev/shm
    rows = 350_000  # 4.2 MB of FP32 output into the object's holes
    x = np.random.default_rng().uniform(-1, 1, (rows, IN_COLS)).astype(np.float32)
    key = make_object(small_shm, 64 << 20, x.tobytes())
    codes: Counter = Counter()
    try:
        with httpx.Client(base_url=daemon.url, timeout=120.0) as client:
            client.post("/v2/systemsharedmemory/region/sparse/register",
                        json={"key": key, "byte_size": 64 << 20}).raise_for_status()
            bystander = Bystander(daemon.url)
            for i in range(args.rounds):
                try:
                    r = region_infer(client, "sparse", rows, (8 << 20) + (i % 16) * (3 << 20))
                except httpx.HTTPError:
                    codes["dropped"] += 1
                    break
                codes[r.status_code] += 1
            calm = bystander.finish()
            alive = daemon.alive
        ok = alive and calm and set(codes) == {507}
        return summary("sparse-region", ok, f"{args.rounds} infers writing 4.2 MB into a 64 MiB sparse object on a "
                                            f"4 MiB /dev/shm {dict(codes)}, {bystander.words()}, daemon "
                                            f"{'alive' if alive else 'DEAD'}")
    finally:
        daemon.stop()


def as_user(uid: int, call) -> str:
    """``call()`` (a str) in a forked child that became user ``uid``: another local user's
    process (nobody: 65534). The child uses only the socket and the stdlib's HTTP client,
    imported already (a forked child of a process with threads must not take their locks)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(read)
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, call().encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode()
    os.waitpid(child, 0)
    return answer


def raw_register(port: int, name: str, key: str, nbytes: int) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    connection.request("POST", f"/v2/systemsharedmemory/region/{name}/register",
                       body=json.dumps({"key": key, "byte_size": nbytes}), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    return f"{response.status} {response.read().decode()}"


def register_foreign(args, tmp: Path) -> int:
    if os.geteuid() != 0:
        return summary("register-foreign", False, "needs root (an attacker of another user: setuid)")
    daemon = started(tmp, *backend_args(args))
    key = make_object(SHM, 4096, b"root's secret")  # root's, 0600
    try:
        answer = as_user(65534, lambda: raw_register(daemon.port, "stolen", key, 4096))
        with httpx.Client(base_url=daemon.url, timeout=30.0) as c:
            held = [r["name"] for r in c.get("/v2/systemsharedmemory/status").json()]
        ok = answer.startswith("403") and not held
        return summary("register-foreign", ok, f"nobody registering root's 0600 object: {answer[:120]}; regions "
                                               f"held {held}")
    finally:
        os.unlink(SHM + key)
        daemon.stop()


def register_flood(args, tmp: Path) -> int:
    daemon = started(tmp, *backend_args(args))
    key = make_object(SHM, 64)
    fds_before = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    codes: Counter = Counter()
    first_refusal = ""
    try:
        with httpx.Client(base_url=daemon.url, timeout=30.0) as c:
            for i in range(args.count):
                r = c.post(f"/v2/systemsharedmemory/region/flood-{i}/register", json={"key": key, "byte_size": 64})
                codes[r.status_code] += 1
                if r.status_code != 200 and not first_refusal:
                    first_refusal = f"{r.status_code} {r.json()['error']}"
            fds = len(os.listdir(f"/proc/{daemon.pid}/fd"))
            weights = c.get("/v2/models/demo/weights").content
            stored = c.put("/v2/models/demo/weights", content=weights).status_code
            ready = c.get("/v2/health/ready").status_code
            c.post("/v2/systemsharedmemory/unregister")
        ok = codes[200] <= 256 and stored == 200 and ready == 200 and daemon.alive
        return summary("register-flood", ok, f"{args.count} registrations {dict(codes)} (first refused: "
                                             f"{first_refusal[:90]}); daemon descriptors {fds_before} -> {fds}; "
                                             f"a weight upload then {stored}, health {ready}")
    finally:
        os.unlink(SHM + key)
        daemon.stop()


# -- the store ----------------------------------------------------------------------------------
def write_versions(store: Path, versions: int, name: str = "m", spec: dict | None = None,
                   config: dict | None = None) -> None:
    """A store holding model ``name`` with ``versions`` acknowledged versions, written directly
    (version 1 through the store, the others copies of its files under the listing): seconds
    for thousands of versions, where a daemon would fsync each."""
    from mmad.backends.cpu import CpuBackend
    from mmad.engine.store import Store
    from mmad.spec import MLPSpec

    spec = spec or SPEC
    model = CpuBackend().compile(MLPSpec.from_json(spec))
    s = Store(store)
    try:
        first = s.create_model(name, {"spec": spec, "config": config or {}, "created": time.time()},
                               model.get_params(), model.get_optimizer_state())
    finally:
        s.close()
    folder = store / "models" / name
    listing = [first]
    for v in range(2, versions + 1):
        for sub in ("weights", "optimizer"):
            shutil.copyfile(folder / sub / "1.safetensors", folder / sub / f"{v}.safetensors")
        listing.append({**first, "version": str(v), "step": v})
    (folder / "versions.json").write_text(json.dumps({"versions": listing}))


def start_up_s(store: Path) -> float:
    """Seconds the daemon's start-up takes on ``store`` in this process, imports done: the
    lifespan (the store opened, every model loaded) as ``mmad serve`` runs it."""
    from fastapi.testclient import TestClient

    from mmad.server import Settings, create_app

    app = create_app(Settings(store_dir=store, backend="cpu", probe="cpu", demo=False, keep_versions=0))
    t0 = time.perf_counter()
    with TestClient(app) as client:
        elapsed = time.perf_counter() - t0
        assert client.get("/v2/health/ready").status_code == 200
    return elapsed


def versions_startup(args, tmp: Path) -> int:
    write_versions(tmp / "store", args.versions)
    start_up_s(tmp / "warm")  # imports and first-use costs, not counted below
    empty = statistics.median(start_up_s(tmp / f"empty{i}") for i in range(3))
    loaded = statistics.median(start_up_s(tmp / "store") for _ in range(3))
    t0 = time.perf_counter()
    daemon = started(tmp, "--keep-versions", "0", "--no-demo")
    ready_s = time.perf_counter() - t0
    try:
        uploads = []
        with httpx.Client(base_url=daemon.url, timeout=60.0) as c:
            weights = c.get("/v2/models/m/weights").content
            for _ in range(args.uploads):
                t = time.perf_counter()
                c.put("/v2/models/m/weights", content=weights).raise_for_status()
                uploads.append(time.perf_counter() - t)
            latest = c.get("/v2/models/m").json()["latest_version"]
        p50 = statistics.median(uploads) * 1000
        ok = latest == str(args.versions + args.uploads)
        return summary(f"versions-startup {args.versions}", ok,
                       f"start-up {loaded:.2f} s (an empty store {empty:.2f} s; median of 3, in process, imports "
                       f"done); the daemon process ready in {ready_s:.2f} s; {args.uploads} uploads p50 {p50:.1f} ms")
    finally:
        daemon.stop()


def delete_readonly(args, tmp: Path) -> int:
    if os.geteuid() != 0:
        return summary("delete-readonly", False, "needs root (a read-only bind mount)")
    daemon = Daemon(tmp / "store", log_path=tmp / "daemon.log").start()
    models = tmp / "store" / "models"
    try:
        with httpx.Client(base_url=daemon.url, timeout=60.0) as c:
            c.put("/v2/models/m", json={"spec": SPEC}).raise_for_status()
            rng = np.random.default_rng()
            x, y = rng.uniform(-1, 1, (32, 5)).astype(np.float32), rng.uniform(-1, 1, (32, 4)).astype(np.float32)
            c.post("/v2/models/m/train", json={"inputs": [
                {"name": "INPUT", "datatype": "FP32", "shape": [32, 5], "data": x.ravel().tolist()},
                {"name": "TARGET", "datatype": "FP32", "shape": [32, 4], "data": y.ravel().tolist()}],
                "parameters": {"steps": 5}}).raise_for_status()
            trained = c.get("/v2/models/m/weights").content
            # the models folder read-only under the running daemon (a bind mount of itself)
            subprocess.run(["mount", "--bind", str(models), str(models)], check=True)
            try:
                subprocess.run(["mount", "-o", "remount,bind,ro", str(models)], check=True)
                refused = c.delete("/v2/models/m")
            finally:
                subprocess.run(["umount", str(models)], check=True)
            state = c.get("/v2/models/m").json().get("state")
            kept = c.get("/v2/models/m/weights").content == trained
            deleted = c.delete("/v2/models/m").status_code
        ok = refused.status_code == 507 and state == "READY" and kept and deleted == 200
        return summary("delete-readonly", ok, f"DELETE on a read-only store {refused.status_code} "
                                              f"({refused.json().get('error', '')[:80]}); model {state}, unsaved "
                                              f"training {'kept' if kept else 'LOST'}; writable again: DELETE {deleted}")
    finally:
        daemon.stop()


def pinned_race(args, tmp: Path) -> int:
    daemon = started(tmp, *backend_args(args))
    codes: Counter = Counter()
    try:
        with httpx.Client(base_url=daemon.url, timeout=60.0) as c:
            c.put("/v2/models/m", json={"spec": SPEC}).raise_for_status()
            for _ in range(3):
                c.post("/v2/models/m/versions").raise_for_status()
            x = np.random.default_rng().uniform(-1, 1, (8, 5)).astype(np.float32).ravel().tolist()
            stop = threading.Event()

            def pinned(seed: int) -> None:
                with httpx.Client(base_url=daemon.url, timeout=60.0) as p:
                    k = seed
                    while not stop.is_set():
                        k += 1
                        try:
                            r = p.post(f"/v2/models/m/versions/{1 + k % 4}/infer", json={"inputs": [
                                {"name": "INPUT", "datatype": "FP32", "shape": [8, 5], "data": x}]})
                            codes[r.status_code] += 1
                        except httpx.HTTPError:
                            codes["dropped"] += 1

            threads = [threading.Thread(target=pinned, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            try:
                for _ in range(args.rounds):
                    c.post("/v2/repository/models/m/unload", json={}).raise_for_status()
                    c.post("/v2/repository/models/m/load", json={}).raise_for_status()
            finally:
                stop.set()
                for t in threads:
                    t.join(60)
        ok = set(codes) <= {200, 503} and daemon.alive
        return summary("pinned-race", ok, f"{args.rounds} unload/load rounds, {sum(codes.values())} pinned infers "
                                          f"{dict(codes)}")
    finally:
        daemon.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cpu", help="the daemon's backend (default cpu)")
    p.add_argument("--workers", type=int, default=0, help="the daemon's --workers (default 0)")
    sub = p.add_subparsers(dest="attack", required=True)
    for name, default in (("shrink-region", 1000), ("sparse-region", 1000), ("pinned-race", 200)):
        sub.add_parser(name).add_argument("--rounds", type=int, default=default)
    sub.add_parser("register-foreign")
    sub.add_parser("register-flood").add_argument("--count", type=int, default=10_000)
    startup = sub.add_parser("versions-startup")
    startup.add_argument("versions", type=int)
    startup.add_argument("--uploads", type=int, default=20)
    sub.add_parser("delete-readonly")
    args = p.parse_args(argv)
    attacks = {"shrink-region": shrink_region, "sparse-region": sparse_region, "register-foreign": register_foreign,
               "register-flood": register_flood, "versions-startup": versions_startup,
               "delete-readonly": delete_readonly, "pinned-race": pinned_race}
    with tempfile.TemporaryDirectory(prefix="mmad-attack-") as tmp:
        return attacks[args.attack](args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
