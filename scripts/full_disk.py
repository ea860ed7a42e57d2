"""A real full disk: the daemon's store on a small tmpfs, weight uploads until it is full.

Run as root (it mounts a 3 MiB tmpfs): ``python scripts/full_disk.py``. Checks that the upload
that no longer fits answers 507 without a filesystem path, that inference and the live weights
are still the last acknowledged upload's, that a checkpoint is refused the same way, that health
answers, and that a daemon restarted on the full store serves the model. Exit status 1 on any
failed check. Bounded: at most 400 uploads, two daemon starts on 127.0.0.1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from safetensors.numpy import load, save

PORT = 8931
X = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 4],
                 "data": [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]]}]}


def start(store: str, cache: str) -> subprocess.Popen:
    env = dict(os.environ, MMAD_STORE_DIR=store, MMAD_CACHE_DIR=cache)
    proc = subprocess.Popen([sys.executable, "-m", "mmad.server.main", "--port", str(PORT), "--grpc-port", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(150):
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/v2/health/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the daemon did not become ready")


def main() -> int:
    mount, cache = tempfile.mkdtemp(prefix="mmad-full-"), tempfile.mkdtemp(prefix="mmad-full-cache-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", mount], check=True)
    url, failures = f"http://127.0.0.1:{PORT}", []

    def check(ok: bool, what: str) -> None:
        print(("PASS " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    try:
        proc = start(f"{mount}/store", cache)
        try:
            spec = {"n_input_dims": 4, "n_output_dims": 4, "network": {"n_neurons": 64, "n_hidden_layers": 4}}
            check(httpx.put(f"{url}/v2/models/big", json={"spec": spec}).status_code == 201, "model created")
            shapes = {k: v.shape for k, v in load(httpx.get(f"{url}/v2/models/big/weights").content).items()}
            rng = np.random.default_rng(0)
            accepted, last, served = 0, None, None
            for _ in range(400):
                params = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
                r = httpx.put(f"{url}/v2/models/big/weights", content=save(params))
                if r.status_code == 200:
                    accepted, last = accepted + 1, params
                    served = httpx.post(f"{url}/v2/models/big/infer", json=X).json()["outputs"][0]["data"]
                    continue
                print(f"upload {accepted + 1} answered {r.status_code}: {r.text}")
                check(r.status_code == 507, "the upload that does not fit is a 507")
                check(mount not in r.text and "/" not in r.json()["error"], "no filesystem path in the body")
                now = httpx.post(f"{url}/v2/models/big/infer", json=X).json()["outputs"][0]["data"]
                check(now == served, "inference serves the last acknowledged weights")
                live = load(httpx.get(f"{url}/v2/models/big/weights").content)
                check(all(np.array_equal(live[k], last[k]) for k in live), "live weights = last acknowledged")
                check(httpx.post(f"{url}/v2/models/big/versions").status_code == 507, "a checkpoint is a 507")
                check(httpx.get(f"{url}/v2/health/ready").status_code == 200, "health answers")
                break
            else:
                check(False, "the store filled up within 400 uploads")
        finally:
            proc.terminate()
            proc.wait(10)
        proc = start(f"{mount}/store", cache)
        try:
            meta = httpx.get(f"{url}/v2/models/big").json()
            check(meta["state"] == "READY" and meta["latest_version"] == str(accepted + 1),
                  f"restarted on the full store: {meta['state']}, latest version {meta['latest_version']}")
        finally:
            proc.terminate()
            proc.wait(10)
    finally:
        subprocess.run(["umount", mount], check=False)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
