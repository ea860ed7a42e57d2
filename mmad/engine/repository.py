"""The model repository loaded at start (``--model-repository DIR``, Triton's flag of that name;
not Triton's repository API, which is ``routers/repository.py``).

One folder per model, named as the model::

    DIR/<model>/config.json        the tiny-cuda-nn model JSON (the ``spec`` of PUT /v2/models/<model>)
    DIR/<model>/mmad.json          optional: the serving config (the ``config`` of that PUT)
    DIR/<model>/model.safetensors  optional: weights, named as GET /v2/models/<model>/weights writes them

The repository seeds the store: a folder becomes a model only when the store has no model of
its name, so the versions a daemon trained survive its restarts. A model the store already has
is served from the store; where the folder's spec or config differ from the stored model's, or
the folder cannot be read, the model's ``reason`` says so (and the log), and nothing stored is
replaced: ``DELETE`` the model
and restart, or ``PUT`` it, to take the repository's. A new model is created and its weights
uploaded through the registry as ``PUT /v2/models/<m>`` and ``PUT .../weights`` do: version 1
holds the seed's weights, version 2 the folder's.

A folder whose model cannot be created (unreadable or invalid files, weights of other shapes)
is UNAVAILABLE in the repository index with the reason and never stops the others; everything
is checked before anything is written, so a failed folder leaves nothing in the store.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from mmad.backends.contract import check_params
from mmad.errors import MMADError
from mmad.engine.registry import ModelConfig, Registry
from mmad.engine.store import check_model_name, tensors_from_bytes
from mmad.spec import MLPSpec

log = logging.getLogger("mmad.engine.repository")

SPEC_FILE, CONFIG_FILE, WEIGHTS_FILE = "config.json", "mmad.json", "model.safetensors"


class FolderError(Exception):
    """Why one folder of the repository gives no model (in the user's terms)."""


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FolderError(f"{path.name} cannot be read: {exc.strerror}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FolderError(f"{path.name} is not JSON: {exc}") from exc


def read_folder(folder: Path) -> tuple[MLPSpec, ModelConfig]:
    """(spec, config) of one folder, checked."""
    if not (folder / SPEC_FILE).is_file():
        raise FolderError(f"no {SPEC_FILE} (the tiny-cuda-nn model JSON)")
    try:
        spec = MLPSpec.from_json(_read_json(folder / SPEC_FILE))
    except MMADError as exc:
        raise FolderError(f"{SPEC_FILE}: {exc}") from exc
    config = ModelConfig()
    if (folder / CONFIG_FILE).exists():
        try:
            config = ModelConfig.parse(_read_json(folder / CONFIG_FILE))
        except MMADError as exc:
            raise FolderError(f"{CONFIG_FILE}: {exc}") from exc
    return spec, config


def read_weights(folder: Path, spec: MLPSpec) -> dict[str, np.ndarray] | None:
    """The folder's weights checked against ``spec`` (names, shapes, finite), or None without a file."""
    path = folder / WEIGHTS_FILE
    if not path.exists():
        return None
    try:
        return check_params(spec, tensors_from_bytes(path.read_bytes(), WEIGHTS_FILE))
    except OSError as exc:
        raise FolderError(f"{WEIGHTS_FILE} cannot be read: {exc.strerror}") from exc
    except MMADError as exc:
        raise FolderError(f"{WEIGHTS_FILE}: {exc}") from exc


async def load_repository(registry: Registry, directory: Path) -> None:
    """Create the models of ``directory`` the store does not have yet, after ``load_all``; note
    where a stored model differs from its folder. Failures go to ``registry.unreadable``
    (UNAVAILABLE with the reason in the repository index) and the log."""
    folders = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    created = 0
    for folder in folders:
        name = folder.name
        try:
            try:
                check_model_name(name)
            except MMADError as exc:
                raise FolderError(str(exc)) from exc
            spec, config = read_folder(folder)
            if registry.store.exists(name):
                _note_differences(registry, name, spec, config)
                continue
            params = read_weights(folder, spec)  # checked before anything is written
            await registry.create(name, spec, config)
            if params is not None:
                try:
                    await registry.run(registry.set_weights_blocking, registry.get_ready(name), params)
                except BaseException:
                    # a model left at its seed's weights would be taken as the repository's at the
                    # next start (the store has it): remove it, so the next start tries again
                    await registry.delete(name)
                    raise
            created += 1
            log.info("model repository: created model %s from %s", name, folder)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with one folder, the others load
            why = exc if isinstance(exc, (FolderError, MMADError)) else f"{type(exc).__name__}: {exc}"
            reason = f"model repository folder {name!r}: {why}"
            log.error("%s", reason)
            if name in registry.models:  # the store's model is served; its reason tells of the folder
                _add_note(registry.models[name], reason)
            else:
                registry.unreadable[name] = reason
    log.info("model repository %s: %d folder(s), %d model(s) created", directory, len(folders), created)


def _note_differences(registry: Registry, name: str, spec: MLPSpec, config: ModelConfig) -> None:
    entry = registry.models.get(name)
    if entry is None:  # in the store but unreadable: its own reason says why
        return
    differ = [what for what, same in ((f"spec ({SPEC_FILE})", entry.spec.to_json() == spec.to_json()),
                                      (f"config ({CONFIG_FILE})", entry.config == config)) if not same]
    if differ:
        note = (f"the model repository's folder has another {' and '.join(differ)}; the stored model is "
                "served (delete it and restart, or PUT it, to take the repository's)")
        _add_note(entry, note)
        log.warning("model %s: %s", name, note)


def _add_note(entry, note: str) -> None:
    entry.reason = f"{entry.reason}; {note}" if entry.reason else note
