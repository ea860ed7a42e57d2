"""Serving the variant the dispatcher measured in the background (:mod:`mmad.backends.dispatch`).

A model compiled while no decision is cached serves at once on a quick variant; the compiled
model of each replica carries a :class:`~mmad.backends.dispatch.Background` ("measuring in
background" in the model's metadata). :func:`watch` follows them; once every replica's
measurement has ended, on the dispatcher's thread (nothing waits for it):

* the quick variant chosen: each replica's ``dispatch`` becomes the decision;
* another variant chosen: it is compiled for each replica, then swapped in under the registry's
  admin lock (no create, delete or load in between) and every replica's lock (no forward or
  training step in between), with the primary's parameters and optimizer state as they are then
  (the model may have trained meanwhile: training requests and jobs ran on the quick variant and
  go on on the new one, a job with the dataset copy it holds); the old models are closed after;
* a measurement failed, or compiling the choice did: the quick variant serves on, its
  ``dispatch`` saying why.

A model replaced, deleted or unloaded meanwhile is left alone: its measurement stops before its
next variant (``Background.wanted``) and nothing is swapped into the model that replaced it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

from mmad.backends.contract import CompiledModel
from mmad.backends.dispatch import Background, in_words

if TYPE_CHECKING:  # the registry calls in: no import cycle at run time
    from mmad.engine.registry import ModelEntry, Registry

log = logging.getLogger("mmad.engine.background_dispatch")

SWAP_POLL_S = 1.0  # how often a thread waiting for the swap checks that the event loop still runs


def watch(registry: "Registry", entry: "ModelEntry") -> None:
    """Follow the background measurements of ``entry``'s replicas (called as it starts serving,
    on the event loop); nothing when none of them was left to one."""
    models = [r.model for r in entry.replicas]
    pending = [m.dispatch if isinstance(m.dispatch, Background) else None for m in models]
    waiting = [b for b in pending if b is not None]
    if not waiting:
        return
    loop = asyncio.get_running_loop()

    def served() -> bool:
        return (registry.models.get(entry.name) is entry and len(entry.replicas) == len(models)
                and all(r.model is m for r, m in zip(entry.replicas, models)))

    left = [len(waiting)]
    lock = threading.Lock()
    loop_thread = threading.get_ident()

    def ended(_: Background) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        if threading.get_ident() == loop_thread:
            # a measurement that ended before it was watched calls back here, on the event loop:
            # settle compiles and then waits for the loop to run the swap, so it must not run on it
            # (it held the loop, and the request that created the model, for good)
            threading.Thread(target=settle, args=(registry, entry, models, pending, served, loop),
                             name="mmad-dispatch-settle", daemon=True).start()
            return
        settle(registry, entry, models, pending, served, loop)

    for background in waiting:
        background.wanted = served
    for background in waiting:
        background.add_done_callback(ended)


def settle(registry: "Registry", entry: "ModelEntry", models: list[CompiledModel],
           pending: list[Background | None], served, loop: asyncio.AbstractEventLoop) -> None:
    """What follows the ended measurements (see the module's description), on the thread that
    ended the last. ``pending[i]``: replica i's measurement, None where it was compiled on a
    cached decision (it started after another replica's measurement had stored one)."""
    if not served():
        return
    waiting = [b for b in pending if b is not None]
    failed = [b for b in waiting if b.decision is None]
    if failed:
        log.warning("model %s goes on serving %s: %s", entry.name, waiting[0].variant, failed[0].error)
        registry.changed(entry)
        return
    decision = waiting[0].decision
    swapped = [b is not None and m.variant != decision.variant for m, b in zip(models, pending)]
    if not any(swapped):
        for model, background in zip(models, pending):
            if background is not None:
                model.dispatch = background.decision
        log.info("model %s: %s measured the fastest (%.1f s of measurement); it goes on serving", entry.name,
                 decision.variant, decision.measure_s)
        registry.changed(entry)
        return
    new: list[CompiledModel | None] = []
    try:
        for background, swap_it in zip(pending, swapped):
            new.append(background.build(decision.variant) if swap_it else None)
    except Exception as exc:  # noqa: BLE001 - the quick variant serves on, the metadata says why
        _close(new)
        _fail(registry, entry, waiting, f"compiling the chosen {decision.variant} failed: {in_words(exc)}")
        return
    future = asyncio.run_coroutine_threadsafe(swap(registry, entry, served, new, pending), loop)
    while True:
        try:
            future.result(SWAP_POLL_S)
            return
        except concurrent.futures.TimeoutError:
            if loop.is_closed() or not loop.is_running():  # the daemon stopped first: nothing to swap into
                future.cancel()
                _close(new)
                return
        except Exception as exc:  # noqa: BLE001
            _close(new)
            _fail(registry, entry, waiting, f"swapping {decision.variant} in failed: {in_words(exc)}")
            return


async def swap(registry: "Registry", entry: "ModelEntry", served, new: list[CompiledModel | None],
               pending: list[Background | None]) -> None:
    """``new[i]`` (where not None) serves replica i of ``entry`` from now on, with the primary's
    parameters and optimizer state; the models it replaces are closed."""
    waiting = [b for b in pending if b is not None]
    decision = waiting[0].decision
    async with registry._admin:
        if not served():  # replaced, deleted or unloaded while the choice compiled
            await registry.run(_close, new)
            return
        serving = [n if n is not None else r.model for n, r in zip(new, entry.replicas)]
        parallel = None
        if entry.parallel is not None:  # a data-parallel trainer over the old models: one over the new
            try:
                parallel = await registry.run(registry.backend.data_parallel, serving)
            except Exception as exc:  # noqa: BLE001
                await registry.run(_close, new)
                _fail(registry, entry, waiting, f"{decision.variant} cannot train this model's replicas "
                                                f"data-parallel: {in_words(exc)}")
                return
        decisions = [b.decision if b is not None else r.model.dispatch for b, r in zip(pending, entry.replicas)]
        old = await registry.run(_swap_blocking, entry, new, decisions, parallel)
        registry.datasets.forget_model(entry.name)  # copies made for the old models: the next job copies anew
    registry.changed(entry)
    log.info("model %s now serves %s, measured the fastest in %.1f s (it served %s meanwhile)", entry.name,
             decision.variant, decision.measure_s, waiting[0].variant)
    await registry.run(_close, old)


def _swap_blocking(entry: "ModelEntry", new: list[CompiledModel | None], decisions: list[Any],
                   parallel: Any) -> list[CompiledModel]:
    """The replicas' models replaced where ``new`` has one (every lock held: no forward or
    training step sees a mix); the models replaced."""
    with contextlib.ExitStack() as stack:
        for replica in entry.replicas:  # in replica order, as every trainer takes them
            stack.enter_context(replica.lock)
        params, state = entry.live.get_params(), entry.live.get_optimizer_state()
        for model in new:
            if model is not None:
                model.set_params(params)
                model.set_optimizer_state(state)
        old = []
        for replica, model, decision in zip(entry.replicas, new, decisions):
            if model is not None:
                old.append(replica.model)
                replica.model = model
            replica.model.dispatch = decision
        old_parallel, entry.parallel = entry.parallel, parallel
    if old_parallel is not None:
        old_parallel.close()
    return old


def _fail(registry: "Registry", entry: "ModelEntry", waiting: list[Background], error: str) -> None:
    for background in waiting:
        background.fail(error)
    log.warning("model %s goes on serving %s: %s", entry.name, waiting[0].variant, error)
    registry.changed(entry)


def _close(models: list[CompiledModel | None]) -> None:
    for model in models:
        if model is not None:
            model.close()
