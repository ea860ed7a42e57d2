"""The daemon end to end on one backend (``mmad bench --daemon-check [--backend NAME]``).

Starts ``mmad serve`` with ``MMAD_BACKEND=NAME`` (default cuda) on a free loopback port and an
empty store, then through mmad_client: creates model M over HTTP, runs a 65,536-row binary
inference and checks it against the float64 cpu oracle (the daemon starts from the same
initial parameters), runs 20 training steps, and infers again. Every check that fails makes
the whole check fail; the daemon's log tail is reported when it does not come up.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mmad.spec import bench_spec

FP16_TOLERANCE = 3e-3
READY_TIMEOUT_S = 120


def _client_class():
    """mmad_client's Client: installed, else from the repository's client/ folder (the GPU host
    runs the tree without installing it)."""
    try:
        from mmad_client import Client
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "client"))
        from mmad_client import Client
    return Client


def daemon_check(backend: str = "cuda") -> tuple[bool, list[str]]:
    """(whether every check passed, the report's lines)."""
    from mmad.backends.cpu import CpuBackend
    from mmad.spec import MLPSpec

    Client = _client_class()
    lines: list[str] = []
    ok = True
    store = Path(tempfile.mkdtemp(prefix="mmad-store-"))
    log_path = store.parent / f"{store.name}-serve.log"
    log = open(log_path, "wb")
    with socket.socket() as probe_sock:
        probe_sock.bind(("127.0.0.1", 0))
        port = probe_sock.getsockname()[1]
    env = {**os.environ, "MMAD_BACKEND": backend}
    repo = Path(__file__).resolve().parents[2]
    daemon = subprocess.Popen([sys.executable, "-m", "mmad.server.main", "--host", "127.0.0.1", "--port", str(port),
                               "--store", str(store), "--no-demo", "--log-level", "warning", "--grpc-port", "0"],
                              stdout=log, stderr=subprocess.STDOUT, env=env, cwd=repo)
    try:
        client = Client(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                if client.health_ready():
                    break
            except Exception:  # not listening yet
                pass
            if daemon.poll() is not None or time.monotonic() > deadline:
                log.flush()
                return False, [f"daemon did not become ready (exit {daemon.poll()}): "
                               f"{log_path.read_text(errors='replace')[-1500:]}"]
            time.sleep(0.2)
        selected = client.devices().get("selected", {})
        lines.append(f"daemon selected {selected.get('backend')}:{selected.get('variant')} on {selected.get('device')}")
        doc = bench_spec("M").to_json()
        meta = client.create_model("m", doc)
        lines.append(f"created model m on backend {meta.get('backend')}")
        rng = np.random.default_rng(7)
        spec = MLPSpec.from_json(doc)
        x = rng.standard_normal((65_536, spec.n_input_dims), dtype=np.float32)
        y = np.tanh(x[:, :spec.n_output_dims]).astype(np.float32)
        out = np.asarray(client.infer("m", x, binary=True), dtype=np.float64)
        ref = CpuBackend("float64").compile(spec).forward(x)
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.isfinite(out).all() else float("inf")
        passed = err <= FP16_TOLERANCE
        ok &= passed
        lines.append(f"{'PASS' if passed else 'FAIL'} infer 65536 rows over HTTP (binary): rel. err vs float64 "
                     f"oracle {err:.2e} (tolerance {FP16_TOLERANCE})")
        losses = np.asarray(client.train_step("m", x, y, steps=20))
        passed = bool(np.isfinite(losses).all()) and losses.shape == (20,)
        ok &= passed
        lines.append(f"{'PASS' if passed else 'FAIL'} train_step x20 over HTTP: loss {losses[0]:.4f} -> "
                     f"{losses[-1]:.4f}, finite {bool(np.isfinite(losses).all())}")
        after = np.asarray(client.infer("m", x[:1000]))
        stats = client.stats("m")["model_stats"][0]
        passed = bool(np.isfinite(after).all())
        ok &= passed
        lines.append(f"{'PASS' if passed else 'FAIL'} infer after training: finite {passed}; "
                     f"{stats['inference_count']} rows in {stats['execution_count']} executions")
    except Exception as exc:  # reported as a failed check, with what had passed before it
        ok = False
        lines.append(f"FAIL daemon check: {type(exc).__name__}: {exc}")
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
    return ok, lines
