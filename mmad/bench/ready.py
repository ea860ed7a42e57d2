"""Time to READY and to the first answer after ``PUT /v2/models/{m}``, cold and warm cache.

``mmad bench --ready [options]``. For each backend of ``--backend`` (a comma list), a daemon of its
own (``mmad serve`` with ``MMAD_BACKEND`` set to it, on a free loopback port, an empty store and an
empty kernel cache of its own), driven over HTTP by mmad_client; for each model (``--models``: the
S/M/L/W benchmark models, ``hashgrid``: tiny-cuda-nn's hash-grid image config, ``oneblob32``: OneBlob
on 32 inputs, 512 encoded columns, a 256-wide Tanh MLP with a Sigmoid output; ``--config``:
tiny-cuda-nn JSON configs, e.g. tests/configs/*.json) in turn:

* **cold**: ``PUT`` timed to its answer (the daemon answers once the model is READY), then the
  first inference of ``--rows`` rows, timed from the ``PUT``; then, where the backend measures
  its variants in the background (cuda), the wait until the measurement has ended: the variant
  that served meanwhile, the one chosen, the measurement's own duration (``measure_s``);
* **warm**: the model deleted and ``PUT`` again on the same daemon (its kernels and the
  dispatcher's decision in the cache): the same two times;
* **restart**: the daemon stopped and started again on the same store and cache: the time from
  starting the process to ``/v2/health/ready`` (every model loaded), then each model's first
  inference.

``--cache-from DIR`` starts the daemons on a copy of a cache warmed by ``mmad cache warm`` (what an
image built with ``WARM_CACHE`` holds) instead of an empty one.

The JSON (``--json``) has every figure; the table (``--markdown``, and printed) one row per
backend and model. A model the backend refuses (e.g. a bf16 config on a backend computing in fp16)
is a row saying why; ``--precision`` sets every model's precision instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from mmad.spec import bench_spec

READY_TIMEOUT_S = 180.0  # a daemon's start, or a model's PUT, before it counts as failed
PENDING = ("measuring in background", "swapping in the chosen variant")  # dispatch states before the choice serves
ONEBLOB32 = {"n_input_dims": 32, "n_output_dims": 4, "encoding": {"otype": "OneBlob", "n_bins": 16},
             "network": {"otype": "FullyFusedMLP", "activation": "Tanh", "output_activation": "Sigmoid",
                         "n_neurons": 256, "n_hidden_layers": 2},
             "loss": {"otype": "L2"}, "optimizer": {"otype": "Adam", "learning_rate": 1e-3}, "seed": 7}
# a tiny-cuda-nn config without dims (tiny-cuda-nn passes them apart) gets these
CONFIG_DIMS = (3, 3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mmad bench --ready", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cpu", help="comma list of NAME[:VARIANT] (default cpu)")
    p.add_argument("--models", default="S,M,L,W,hashgrid",
                   help="comma list of S, M, L, W, hashgrid, oneblob32 (default S,M,L,W,hashgrid); '' for none")
    p.add_argument("--config", action="append", default=[], metavar="PATH",
                   help="a tiny-cuda-nn JSON config as a model too (repeatable); without n_input_dims and "
                        f"n_output_dims it gets {CONFIG_DIMS[0]} and {CONFIG_DIMS[1]}")
    p.add_argument("--precision", choices=("fp16", "fp32", "bf16"),
                   help="every model's precision (default: each model's own)")
    p.add_argument("--rows", type=int, default=1024, help="rows of the first inference (default 1024)")
    p.add_argument("--decision-timeout", type=float, default=120.0,
                   help="seconds to wait for a background measurement to end (default 120)")
    p.add_argument("--no-restart", action="store_true", help="leave out the restart phase")
    p.add_argument("--cache-from", metavar="DIR",
                   help="start each daemon on a copy of this kernel cache instead of an empty one (one made by "
                        "`mmad cache warm`, as an image built with WARM_CACHE holds): its 'cold' phase is then "
                        "what such an image serves")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    return p.parse_args(argv)


def model_docs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """name -> tiny-cuda-nn JSON of every model asked for."""
    from mmad.demo import IMAGE_CONFIG

    builtin = {"hashgrid": IMAGE_CONFIG, "oneblob32": ONEBLOB32}
    docs: dict[str, dict[str, Any]] = {}
    for name in filter(None, (n.strip() for n in args.models.split(","))):
        docs[name] = dict(builtin[name]) if name in builtin else bench_spec(name).to_json()
    for path in map(Path, args.config):
        doc = json.loads(path.read_text())
        doc.setdefault("n_input_dims", CONFIG_DIMS[0])
        doc.setdefault("n_output_dims", CONFIG_DIMS[1])
        docs[path.stem] = doc
    if args.precision:
        docs = {name: {**doc, "precision": args.precision} for name, doc in docs.items()}
    return docs


class Daemon:
    """``mmad serve`` on one backend, with a store and a kernel cache that outlive its restarts."""

    def __init__(self, backend: str, root: Path):
        self.backend = backend
        self.store, self.cache = root / "store", root / "cache"
        self.log_path = root / "serve.log"
        self.proc: subprocess.Popen | None = None
        self.log: Any = None
        self.url = ""

    def start(self) -> float:
        """Seconds from starting the process to ``/v2/health/ready``."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "MMAD_BACKEND": self.backend, "MMAD_PROBE": self.backend.split(":")[0],
               "MMAD_CACHE_DIR": str(self.cache), "MMAD_LOG_LEVEL": "info"}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(self.log_path, "ab")
        started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "mmad.server.main", "--host", "127.0.0.1", "--port",
                                      str(port), "--store", str(self.store), "--no-demo", "--grpc-port", "0"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = started + READY_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1.0).status_code == 200:
                    return time.perf_counter() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"the daemon was not ready after {READY_TIMEOUT_S:.0f} s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.log is not None:
            self.log.close()
            self.log = None

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-1500:] if self.log_path.exists() else ""


def _client_class():
    from mmad.bench.daemon_check import _client_class as client_class

    return client_class()


def put_and_answer(client: Any, url: str, name: str, doc: dict[str, Any], rows: int) -> dict[str, Any]:
    """``PUT`` the model, then its first inference: seconds from the ``PUT`` to READY and to the answer."""
    x = np.random.default_rng(0).uniform(-1, 1, (rows, doc["n_input_dims"])).astype(np.float32)
    started = time.perf_counter()
    r = httpx.put(f"{url}/v2/models/{name}", json={"spec": doc}, timeout=READY_TIMEOUT_S)
    ready_s = time.perf_counter() - started
    if r.status_code not in (200, 201):
        try:
            why = r.json().get("error", r.text)
        except ValueError:
            why = r.text
        return {"error": f"PUT answered {r.status_code}: {why}"}
    out = client.infer(name, x)
    answer_s = time.perf_counter() - started
    if not np.isfinite(out).all():
        return {"error": "the first answer holds NaN or Inf", "ready_s": ready_s}
    meta = httpx.get(f"{url}/v2/models/{name}", timeout=30).json()
    return {"ready_s": ready_s, "first_answer_s": answer_s, "variant": meta["variant"],
            "dispatch_state": (meta["dispatch"] or {}).get("state"),
            "from_cache": (meta["dispatch"] or {}).get("from_cache")}


def wait_decided(url: str, name: str, since: float, timeout_s: float) -> dict[str, Any]:
    """The background measurement's outcome once it has ended (or the wait's timeout)."""
    while True:
        dispatch = httpx.get(f"{url}/v2/models/{name}", timeout=30).json()["dispatch"] or {}
        if dispatch.get("state") not in PENDING:
            break
        if time.perf_counter() - since > timeout_s:
            return {"decision": f"still measuring after {timeout_s:.0f} s"}
        time.sleep(0.1)
    if not dispatch:
        return {}
    out: dict[str, Any] = {"decided_after_s": time.perf_counter() - since, "decision": dispatch["state"],
                           "chosen": dispatch.get("variant")}
    if dispatch["state"] == "decided":
        out.update(measure_s=dispatch.get("measure_s"), compile_s=dispatch.get("compile_s"),
                   served_meanwhile=dispatch.get("served_while_measuring"))
    else:
        out["error"] = dispatch.get("error", "")
    return out


def bench_backend(backend: str, docs: dict[str, dict[str, Any]], args: argparse.Namespace, root: Path,
                  result: dict[str, Any], save) -> None:
    """Every phase on one backend, its figures into ``result`` (``save()`` after each model: a run
    cut short keeps what it measured)."""
    Client = _client_class()
    daemon = Daemon(backend, root)
    result["models"] = {name: {} for name in docs}
    if args.cache_from:
        shutil.copytree(args.cache_from, daemon.cache)
    try:
        result["start_s"] = daemon.start()
        client = Client(daemon.url, timeout=READY_TIMEOUT_S)
        for name, doc in docs.items():
            since = time.perf_counter()
            cold = put_and_answer(client, daemon.url, name, doc, args.rows)
            if "error" not in cold and cold["dispatch_state"] in PENDING:
                cold.update(wait_decided(daemon.url, name, since, args.decision_timeout))
            result["models"][name]["cold"] = cold
            _progress(backend, name, "cold", cold)
            save()
        for name, doc in docs.items():
            if "error" in result["models"][name]["cold"]:
                continue
            httpx.delete(f"{daemon.url}/v2/models/{name}", timeout=60).raise_for_status()
            warm = put_and_answer(client, daemon.url, name, doc, args.rows)
            result["models"][name]["warm"] = warm
            _progress(backend, name, "warm", warm)
            save()
        if not args.no_restart:
            daemon.stop()
            result["restart_ready_s"] = daemon.start()
            client = Client(daemon.url, timeout=READY_TIMEOUT_S)
            for name, doc in docs.items():
                if "warm" not in result["models"][name]:
                    continue
                x = np.random.default_rng(0).uniform(-1, 1, (args.rows, doc["n_input_dims"])).astype(np.float32)
                started = time.perf_counter()
                client.infer(name, x)
                meta = httpx.get(f"{daemon.url}/v2/models/{name}", timeout=30).json()
                result["models"][name]["restart"] = {"first_answer_s": time.perf_counter() - started,
                                                     "variant": meta["variant"],
                                                     "from_cache": (meta["dispatch"] or {}).get("from_cache")}
    except Exception as exc:  # noqa: BLE001 - one backend that fails leaves the others' figures
        result["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{backend}: {result['error']}", file=sys.stderr, flush=True)
    finally:
        daemon.stop()


def _progress(backend: str, name: str, phase: str, figures: dict[str, Any]) -> None:
    if "error" in figures and "ready_s" not in figures:
        print(f"{backend} {name} {phase}: {figures['error']}", flush=True)
        return
    extra = (f", measured in the background in {figures['measure_s']:.1f} s ({figures.get('compile_s') or 0:.1f} s "
             f"compiling): {figures.get('served_meanwhile')} -> {figures['chosen']}"
             if figures.get("measure_s") is not None else "")
    print(f"{backend} {name} {phase}: READY {figures['ready_s']:.2f} s, first answer {figures['first_answer_s']:.2f} s "
          f"on {figures['variant']}{extra}", flush=True)


def _timing_s(cold: dict[str, Any]) -> float | None:
    """The background measurement's checks and timings: its duration less its compiles."""
    if cold.get("measure_s") is None:
        return None
    return cold["measure_s"] - (cold.get("compile_s") or 0.0)


def _s(value: Any) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown_table(doc: dict[str, Any]) -> str:
    head = ("| backend | model | cold: READY s | cold: first answer s | served first | background: compile s "
            "| background: measure s | chosen | warm: READY s | warm: first answer s | restart: first answer s |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for backend, result in doc["backends"].items():
        for name, phases in result["models"].items():
            cold, warm, restart = phases.get("cold", {}), phases.get("warm", {}), phases.get("restart", {})
            if "ready_s" not in cold:
                lines.append(f"| {backend} | {name} | {cold.get('error', result.get('error', 'not run'))} |"
                             + " |" * 8)
                continue
            chosen = cold.get("chosen") or cold["variant"]
            if cold.get("decision") not in (None, "decided"):
                chosen = f"{chosen} ({cold['decision']}: {cold.get('error', '')})"
            lines.append(f"| {backend} | {name} | {_s(cold['ready_s'])} | {_s(cold['first_answer_s'])} | "
                         f"{cold['variant']} | {_s(cold.get('compile_s'))} | {_s(_timing_s(cold))} | {chosen} | "
                         f"{_s(warm.get('ready_s'))} | "
                         f"{_s(warm.get('first_answer_s'))} | {_s(restart.get('first_answer_s'))} |")
    restarts = [f"{b}: daemon start {_s(r.get('start_s'))} s, restart to READY with every model {_s(r.get('restart_ready_s'))} s"
                for b, r in doc["backends"].items()]
    return "\n".join(lines + [""] + restarts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    docs = model_docs(args)
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    doc: dict[str, Any] = {
        "command": "mmad bench --ready " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": socket.gethostname().split(".")[0], "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(), "rows": args.rows, "models": docs, "backends": {}}
    json_path, markdown_path = (Path(args.json) if args.json else None), (Path(args.markdown) if args.markdown else None)

    def save() -> None:
        if json_path:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(doc, indent=2, default=str))

    root = Path(tempfile.mkdtemp(prefix="mmad-bench-ready-"))
    try:
        for backend in backends:
            doc["backends"][backend] = {}
            bench_backend(backend, docs, args, root / backend.replace(":", "-"), doc["backends"][backend], save)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from mmad.bench.kernels import write_report

    write_report(doc, markdown_table(doc), json_path, markdown_path)
    return 1 if any("error" in r for r in doc["backends"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
