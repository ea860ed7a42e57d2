"""``--model-control-mode poll``: serve a model repository read-only and follow it (Triton's
``--model-control-mode=poll`` and ``--repository-poll-secs``).

Train here, serve many: one daemon trains and publishes versions (``mmad export --to
repository``, which renames each version folder into place whole), and every serving daemon
polls the shared folder. Each pass reads the folders (mmad.engine.repository's layout, Triton's
version folders only) and brings the daemon's models level with them:

- a new version folder (one the policy picks, above the newest served) is read, checked and
  added as that version; the live weights move to it in one step, as a weight upload does, and
  the versions the policy no longer picks are dropped;
- a new folder becomes a model; a folder whose spec, config or picked versions changed in any
  other way replaces its model (a reload: the model is briefly not ready);
- whatever fails (a half-written or corrupt file, weights of other shapes, a layout mmad does
  not read) changes nothing served: a served model keeps its version and its ``reason`` says
  why; a model not served yet is UNAVAILABLE with the reason. The next pass tries again;
- a model whose folder is gone is unloaded (the daemon's store keeps it).

The daemon's store holds a copy of what the repository serves, so a restart serves it at once;
the repository is the source of truth: requests that would change a model (training, uploads,
create, delete, load, unload) are refused with 403 (:func:`refuse_changes`).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from mmad.engine.registry import ModelEntry, Registry
from mmad.engine.repository import FolderError, ModelFolder, create_versioned, read_named_folder, read_versions
from mmad.errors import Forbidden, MMADError
from mmad.settings import Settings

log = logging.getLogger("mmad.engine.repository")


def refuse_changes(settings: Settings, model: str) -> None:
    """Forbidden (403) for a request that would change ``model`` on a daemon following a repository."""
    if settings.model_control_mode == "poll":
        raise Forbidden(f"model {model!r} is served from the model repository {str(settings.model_repository)!r} "
                        "(--model-control-mode poll), its source of truth: this daemon does not train, upload, "
                        "create, delete, load or unload models. Train on a daemon of its own and publish the "
                        "versions with `mmad export --to repository`")


class RepositoryPoller:
    """Brings the registry level with ``directory`` once a pass, every ``interval_s`` seconds."""

    def __init__(self, registry: Registry, directory: Path, interval_s: float):
        self.registry = registry
        self.directory = directory
        self.interval_s = interval_s
        self.failed: set[str] = set()  # names in registry.unreadable because of their folder
        self.notes: dict[str, str] = {}  # served model -> why its folder's newest state is not served
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="mmad-repository-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync()
            except Exception:  # noqa: BLE001 - an unreadable repository (a volume gone) stops no later pass
                log.exception("model repository %s: the pass failed", self.directory)

    async def sync(self) -> None:
        """One pass over the repository."""
        registry = self.registry
        try:
            folders = await registry.run(lambda: sorted(
                p for p in self.directory.iterdir() if p.is_dir() and not p.name.startswith(".")))
        except OSError as exc:
            log.error("model repository %s cannot be read: %s; what is served stays", self.directory, exc.strerror)
            return
        for folder in folders:
            await self._sync_folder(folder)
        present = {p.name for p in folders}
        for name in sorted(self.failed - present):
            self.failed.discard(name)
            registry.unreadable.pop(name, None)
        for name, entry in sorted(registry.models.items()):
            if name not in present and entry.ready:
                await registry.unload(name)
                entry.reason = "its folder is no longer in the model repository"
                self.notes.pop(name, None)
                log.warning("model repository: model %s unloaded: %s", name, entry.reason)

    async def _sync_folder(self, folder: Path) -> None:
        registry, name = self.registry, folder.name
        try:
            model = await read_named_folder(registry, folder)
            if not model.versions:
                raise FolderError("a followed repository serves version folders: <model>/1/model.safetensors, "
                                  "... (what `mmad export --to repository` writes); this folder has none")
            entry = registry.models.get(name)
            new = _new_versions(entry, model)
            if new is None:
                keep = len(model.versions)
                await create_versioned(registry, name, model, keep)
                log.info("model repository: model %s loaded from %s, serving version %s", name, folder,
                         max(model.versions))
            elif new:
                params = await read_versions(registry, model, new)  # all checked before any is served
                for v in new:
                    await registry.run(registry.set_weights_blocking, entry, params[v], str(v), len(model.versions))
                    log.info("model repository: model %s version %s picked up, now served", name, v)
            self._clear(name)
        except Exception as exc:  # noqa: BLE001 - whatever is wrong with one folder, the others follow
            self._failed(name, exc)

    def _clear(self, name: str) -> None:
        if name in self.failed:
            self.failed.discard(name)
            self.registry.unreadable.pop(name, None)
        if self.notes.pop(name, None) is not None:
            entry = self.registry.models.get(name)
            if entry is not None:
                entry.reason = self.registry._damage_note(entry)
            log.info("model repository: model %s is level with its folder again", name)

    def _failed(self, name: str, exc: Exception) -> None:
        why = exc if isinstance(exc, (FolderError, MMADError)) else f"{type(exc).__name__}: {exc}"
        reason = f"model repository folder {name!r}: {why}"
        entry = self.registry.models.get(name)
        if entry is not None and entry.ready:  # what is served stays; its reason tells of the folder
            note = f"{reason}; version {self.registry.latest_version(name)} is still served"
            if self.notes.get(name) != note:
                log.error("%s", note)
            self.notes[name] = note
            damage = self.registry._damage_note(entry)
            entry.reason = f"{damage}; {note}" if damage else note
            return
        if self.registry.unreadable.get(name) != reason:
            log.error("%s", reason)
        self.registry.unreadable[name] = reason
        self.failed.add(name)


def _new_versions(entry: ModelEntry | None, model: ModelFolder) -> list[int] | None:
    """The versions to add to ``entry`` to serve ``model`` (those above its newest, after which
    the oldest beyond the picked number drop), or None when it must be created or replaced."""
    if (entry is None or not entry.ready or not entry.versions or entry.spec.to_json() != model.spec.to_json()
            or entry.config != model.config):
        return None
    current = [int(v["version"]) for v in entry.versions]
    want = list(model.versions)
    new = [v for v in want if v > current[-1]]
    if (current + new)[-len(want):] != want or (not new and current != want):
        return None
    return new
