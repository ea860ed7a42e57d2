"""Replace / delete racing weight uploads and checkpoints.

Each round starts a runtime on the same store (the lifespan's own ``start_runtime``, cpu
backend), fires 24 writers (``PUT .../weights`` and ``POST .../versions`` through the very
registry calls those routes make) and one replace or delete within ~60 ms, stops the runtime,
then checks the store on disk: every listed version's files exist, match their sha256 and fit
the model's spec (no version of the replaced model slipped into the new one), and a deleted
model leaves neither directory nor listing. The next round's start is the "a fresh daemon
starts on it" check: every model it finds must be READY.

``MMAD_RACE_ROUNDS`` sets the rounds per variant (40 by default; >= 300 by hand).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from mmad.backends.contract import param_shapes
from mmad.errors import ConflictError, InvalidInput, ModelNotFound, NotReady
from mmad.server.app import start_runtime, stop_runtime
from mmad.engine.runtime import Runtime
from mmad.engine.metrics import Metrics
from mmad.engine.registry import ModelConfig
from mmad.settings import Settings
from mmad.spec import MLPSpec

ROUNDS = int(os.environ.get("MMAD_RACE_ROUNDS", "40"))
WRITERS = 24
WINDOW_S = 0.06
SPECS = [MLPSpec.from_json({"n_input_dims": 3, "n_output_dims": 2, "precision": "fp32", "seed": s,
                            "network": {"n_neurons": n, "n_hidden_layers": 1}})
         for s, n in ((1, 16), (2, 32))]


def runtime(store: Path) -> Runtime:
    settings = Settings(store_dir=store, backend="cpu", probe="cpu", demo=False, compute_threads=4,
                        forward_threads=1)
    return Runtime(settings=settings, metrics=Metrics(),
                   executor=ThreadPoolExecutor(settings.compute_threads, thread_name_prefix="race-compute"),
                   forward_pool=ThreadPoolExecutor(1, thread_name_prefix="race-forward"))


def check_store(store: Path, name: str, deleted: bool) -> int:
    """The store on disk is consistent; returns how many versions the model lists."""
    model = store / "models" / name
    if deleted:
        assert not model.exists(), f"a deleted model came back: {sorted(p.name for p in model.rglob('*'))}"
        assert not (store / "datasets" / name).exists()
        return 0
    doc = json.loads((model / "model.json").read_bytes())
    shapes = param_shapes(MLPSpec.from_json(doc["spec"]))
    listing = json.loads((model / "versions.json").read_bytes())["versions"]
    assert listing, "an empty listing"
    for v in listing:
        weights = model / "weights" / f"{v['version']}.safetensors"
        assert weights.is_file(), f"version {v['version']} is listed without its weights"
        assert (model / "optimizer" / f"{v['version']}.safetensors").is_file(), f"v{v['version']} has no optimizer"
        data = weights.read_bytes()
        assert hashlib.sha256(data).hexdigest() == v["sha256"], f"version {v['version']} does not match its sha256"
        params = st_load(data)
        assert {k: a.shape for k, a in params.items()} == shapes, \
            f"version {v['version']} holds weights of another model (a replaced one)"
    return len(listing)


async def one_round(store: Path, variant: str, rnd: int, rng: random.Random) -> dict[str, int]:
    rt = runtime(store)
    await start_runtime(rt)
    outcomes = {"ok": 0, "refused": 0}
    try:
        registry = rt.registry
        for name, entry in registry.models.items():  # a fresh start on the previous round's store
            assert entry.ready, f"round {rnd}: model {name} is UNAVAILABLE after a restart: {entry.reason}"
        spec = SPECS[rnd % 2]
        if "m" not in registry.models:
            await registry.create("m", spec, ModelConfig())
        shapes = param_shapes(registry.get("m").spec)
        np_rng = np.random.default_rng(rng.randrange(1 << 30))
        uploads = [{k: np_rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
                   for _ in range(WRITERS // 2)]

        async def writer(i: int) -> None:
            await asyncio.sleep(rng.uniform(0, WINDOW_S))
            try:  # what the routes do: look the model up, then write on the compute threads
                entry = registry.get_ready("m")
                if i % 2:
                    await registry.run(registry.set_weights_blocking, entry, uploads[i // 2])
                else:
                    await registry.run(registry.checkpoint_blocking, entry)
                outcomes["ok"] += 1
            # 409 / 404 / 503 (or 400: the old model's weights sent to the new one): a clean refusal
            except (ConflictError, ModelNotFound, NotReady, InvalidInput):
                outcomes["refused"] += 1

        async def admin() -> None:
            await asyncio.sleep(rng.uniform(0, WINDOW_S))
            if variant == "replace":
                await registry.create("m", SPECS[(rnd + 1) % 2], ModelConfig())
            else:
                await registry.delete("m")

        await asyncio.gather(admin(), *(writer(i) for i in range(WRITERS)))
    finally:
        await stop_runtime(rt)
    check_store(store, "m", deleted=variant == "delete")
    return outcomes


@pytest.mark.parametrize("variant", ["replace", "delete"])
def test_replace_or_delete_racing_uploads_keeps_the_store_consistent(tmp_path, variant):
    store = tmp_path / "store"
    rng = random.Random(21)
    totals = {"ok": 0, "refused": 0}
    for rnd in range(ROUNDS):
        for k, n in asyncio.run(one_round(store, variant, rnd, rng)).items():
            totals[k] += n
    # the last round's store must also start
    rt = runtime(store)

    async def last_start() -> None:
        await start_runtime(rt)
        try:
            assert all(e.ready for e in rt.registry.models.values())
        finally:
            await stop_runtime(rt)

    asyncio.run(last_start())
    print(f"\n{variant}: {ROUNDS} rounds x {WRITERS} writers: {totals['ok']} written, "
          f"{totals['refused']} refused cleanly")
    assert totals["ok"] > 0  # the race was real: writers did get through before the swap
