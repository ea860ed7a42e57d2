"""The model repository (``--model-repository DIR``, Triton's flag of that name; not Triton's
repository API, which is ``routers/repository.py``).

One folder per model, named as the model, in one of two layouts::

    DIR/<model>/config.json        the tiny-cuda-nn model JSON (the ``spec`` of PUT /v2/models/<model>)
    DIR/<model>/mmad.json          optional: the serving config (the ``config`` of that PUT), and
                                   optionally Triton's "version_policy"
    DIR/<model>/model.safetensors  optional: weights, named as GET /v2/models/<model>/weights writes them

or Triton's layout, a folder per version, each holding that version's weights::

    DIR/<model>/config.json, DIR/<model>/mmad.json     as above
    DIR/<model>/<version>/model.safetensors            version: 1, 2, ... (what `mmad export --to repository` writes)

``version_policy`` (in mmad.json, Triton's JSON shape) picks the version folders served:
``{"latest": {"num_versions": N}}`` (the newest N; the default is the newest one),
``{"all": {}}`` or ``{"specific": {"versions": [1, 3]}}``. Anything else in a model folder (a
version folder without model.safetensors, a folder that is not a version number, a file mmad
does not read, Triton's config.pbtxt) is refused: the model is UNAVAILABLE with the reason.
Names starting with a dot are skipped (what a writer publishes is staged under such names).

At start (``--model-control-mode none``) the repository seeds the store: a folder becomes a
model only when the store has no model of its name, so the versions a daemon trained survive
its restarts. A model the store already has is served from the store; where the folder's spec
or config differ from the stored model's, or the folder cannot be read, the model's ``reason``
says so (and the log), and nothing stored is replaced: ``DELETE`` the model and restart, or
``PUT`` it, to take the repository's. A new flat model is created and its weights uploaded
through the registry as ``PUT /v2/models/<m>`` and ``PUT .../weights`` do: version 1 holds the
seed's weights, version 2 the folder's; a new versioned model gets the versions the policy
picks, numbered as their folders. With ``--model-control-mode poll`` the repository is followed
instead (``mmad.engine.repository_poll``).

A folder whose model cannot be created (unreadable or invalid files, weights of other shapes)
is UNAVAILABLE in the repository index with the reason and never stops the others; everything
is checked before anything is written, so a failed folder leaves nothing in the store.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmad.backends.contract import check_params
from mmad.errors import InvalidInput, MMADError
from mmad.engine.registry import ModelConfig, Registry
from mmad.engine.store import (
    VERSION_RE, _fsync_dir as fsync_dir, atomic_write, check_model_name, tensors_from_bytes, tensors_to_bytes,
)
from mmad.spec import MLPSpec

log = logging.getLogger("mmad.engine.repository")

SPEC_FILE, CONFIG_FILE, WEIGHTS_FILE = "config.json", "mmad.json", "model.safetensors"
TRITON_CONFIG_FILE = "config.pbtxt"
LAYOUT = ("a model folder holds config.json (the tiny-cuda-nn model JSON), optionally mmad.json (the serving "
          "config), and either model.safetensors beside them or version folders 1, 2, ... each holding "
          "model.safetensors")


class FolderError(Exception):
    """Why one folder of the repository gives no model (in the user's terms)."""


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise FolderError(f"{path.name} cannot be read: {exc.strerror}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FolderError(f"{path.name} is not JSON: {exc}") from exc


@dataclass(frozen=True)
class VersionPolicy:
    """Triton's version_policy: which version folders are served."""

    kind: str = "latest"  # latest | all | specific
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    @classmethod
    def parse(cls, doc) -> "VersionPolicy":
        shapes = ('{"latest": {"num_versions": N}}, {"all": {}} or {"specific": {"versions": [1, 3]}}')
        if not isinstance(doc, dict) or len(doc) != 1 or next(iter(doc)) not in ("latest", "all", "specific"):
            raise FolderError(f"{CONFIG_FILE}: version_policy must be one of {shapes}; got {doc!r:.80}")
        kind, body = next(iter(doc.items()))
        if not isinstance(body, dict):
            raise FolderError(f"{CONFIG_FILE}: version_policy.{kind} must be an object: {shapes}")
        allowed = {"latest": {"num_versions"}, "all": set(), "specific": {"versions"}}[kind]
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise FolderError(f"{CONFIG_FILE}: version_policy.{kind} has no field {unknown[0]!r}: {shapes}")
        if kind == "latest":
            n = body.get("num_versions", 1)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise FolderError(f"{CONFIG_FILE}: version_policy.latest.num_versions must be a whole number of "
                                  f"at least 1; got {n!r}")
            return cls("latest", num_versions=n)
        if kind == "specific":
            versions = body.get("versions")
            if (not isinstance(versions, list) or not versions
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in versions)):
                raise FolderError(f"{CONFIG_FILE}: version_policy.specific.versions must be a list of version "
                                  f"numbers (1, 2, ...); got {versions!r:.80}")
            return cls("specific", versions=tuple(sorted(set(versions))))
        return cls("all")

    def select(self, available: list[int]) -> list[int]:
        """The versions served of ``available`` (sorted); a policy that picks none is refused."""
        if self.kind == "latest":
            return available[-self.num_versions:]
        if self.kind == "all":
            return available
        missing = [v for v in self.versions if v not in available]
        if missing:
            raise FolderError(f"{CONFIG_FILE}: version_policy.specific lists version(s) "
                              f"{', '.join(map(str, missing))} with no version folder (there are "
                              f"{', '.join(map(str, available))})")
        return list(self.versions)


@dataclass
class ModelFolder:
    """One model folder, read and checked: spec, config and, in Triton's layout, the version
    folders its policy picks (``versions``: number -> folder); ``flat_weights`` is the layout's
    other form (model.safetensors beside config.json)."""

    spec: MLPSpec
    config: ModelConfig
    versions: dict[int, Path] = field(default_factory=dict)
    flat_weights: bool = False


def read_model_folder(folder: Path) -> ModelFolder:
    """The layout of one model folder, checked in full (every version folder, every name; the
    weights are read by :func:`read_weights`)."""
    if not (folder / SPEC_FILE).is_file():
        if (folder / TRITON_CONFIG_FILE).exists():
            raise FolderError(f"{TRITON_CONFIG_FILE} is Triton's model configuration, which mmad does not read; "
                              f"write {SPEC_FILE}, the tiny-cuda-nn model JSON (what PUT /v2/models/<model> takes as "
                              f"its spec), and the serving settings, if any, in {CONFIG_FILE}: {LAYOUT}")
        raise FolderError(f"no {SPEC_FILE} (the tiny-cuda-nn model JSON); {LAYOUT}")
    try:
        spec = MLPSpec.from_json(_read_json(folder / SPEC_FILE))
    except MMADError as exc:
        raise FolderError(f"{SPEC_FILE}: {exc}") from exc
    config, policy = ModelConfig(), None
    if (folder / CONFIG_FILE).exists():
        doc = _read_json(folder / CONFIG_FILE)
        if isinstance(doc, dict) and "version_policy" in doc:
            doc = dict(doc)
            policy = VersionPolicy.parse(doc.pop("version_policy"))
        try:
            config = ModelConfig.parse(doc)
        except MMADError as exc:
            raise FolderError(f"{CONFIG_FILE}: {exc}") from exc
    versions: dict[int, Path] = {}
    for path in sorted(folder.iterdir()):
        name = path.name
        if name.startswith(".") or (path.is_file() and name in (SPEC_FILE, CONFIG_FILE, WEIGHTS_FILE)):
            continue
        if path.is_dir() and VERSION_RE.match(name):
            versions[int(name)] = _check_version_folder(path)
        elif path.is_dir():
            raise FolderError(f"folder {name!r} is not a version: version folders are named 1, 2, ... (no leading "
                              f"zeros); {LAYOUT}")
        elif name == TRITON_CONFIG_FILE:
            raise FolderError(f"{TRITON_CONFIG_FILE} is Triton's model configuration, which mmad does not read "
                              f"({SPEC_FILE} and {CONFIG_FILE} are the model's); remove it")
        else:
            raise FolderError(f"{name!r} is not a file mmad reads; {LAYOUT}")
    flat = (folder / WEIGHTS_FILE).is_file()
    if flat and versions:
        raise FolderError(f"{WEIGHTS_FILE} beside {SPEC_FILE} and version folders "
                          f"({', '.join(map(str, sorted(versions)))}) too: use one layout; {LAYOUT}")
    if policy is not None and not versions:
        raise FolderError(f"{CONFIG_FILE} has a version_policy but the folder has no version folders; {LAYOUT}")
    if versions:
        picked = (policy or VersionPolicy()).select(sorted(versions))
        versions = {v: versions[v] for v in picked}
    return ModelFolder(spec, config, versions, flat)


def _check_version_folder(path: Path) -> Path:
    names = sorted(p.name for p in path.iterdir() if not p.name.startswith("."))
    if WEIGHTS_FILE not in names or not (path / WEIGHTS_FILE).is_file():
        raise FolderError(f"version folder {path.name} has no {WEIGHTS_FILE} (expected "
                          f"<model>/{path.name}/{WEIGHTS_FILE}, mmad's weights as GET /v2/models/<model>/weights "
                          f"writes them{'; it holds ' + ', '.join(names) if names else ''})")
    others = [n for n in names if n != WEIGHTS_FILE]
    if others:
        raise FolderError(f"version folder {path.name} holds {', '.join(others)} beside {WEIGHTS_FILE}: a version "
                          f"folder holds {WEIGHTS_FILE} only")
    return path


def read_weights(folder: Path, spec: MLPSpec, version: int | None = None) -> dict[str, np.ndarray] | None:
    """The weights of the folder (or of its ``version`` folder) checked against ``spec`` (names,
    shapes, finite), or None without a file."""
    path = folder / WEIGHTS_FILE
    what = WEIGHTS_FILE if version is None else f"{version}/{WEIGHTS_FILE}"
    if not path.exists():
        return None
    try:
        tensors = tensors_from_bytes(path.read_bytes(), what)
    except OSError as exc:
        raise FolderError(f"{what} cannot be read: {exc.strerror}") from exc
    except MMADError as exc:  # it names the file
        raise FolderError(str(exc)) from exc
    try:
        return check_params(spec, tensors)
    except MMADError as exc:
        raise FolderError(f"{what}: {exc}") from exc


async def read_named_folder(registry: Registry, folder: Path) -> ModelFolder:
    """``folder`` read as a model whose name is the folder's (a name the store refuses is the
    folder's FolderError)."""
    try:
        check_model_name(folder.name)
    except MMADError as exc:
        raise FolderError(str(exc)) from exc
    return await registry.run(read_model_folder, folder)


async def load_repository(registry: Registry, directory: Path) -> None:
    """Create the models of ``directory`` the store does not have yet, after ``load_all``; note
    where a stored model differs from its folder. Failures go to ``registry.unreadable``
    (UNAVAILABLE with the reason in the repository index) and the log."""
    folders = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    created = 0
    for folder in folders:
        name = folder.name
        try:
            model = await read_named_folder(registry, folder)
            spec, config = model.spec, model.config
            if registry.store.exists(name):
                _note_differences(registry, name, spec, config, list(model.versions))
                continue
            if model.versions:
                await create_versioned(registry, name, model)
                created += 1
                log.info("model repository: created model %s from %s (versions %s)", name, folder,
                         ", ".join(map(str, model.versions)))
                continue
            params = await registry.run(read_weights, folder, spec)  # checked before anything is written
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


async def read_versions(registry: Registry, model: ModelFolder, versions: list[int]) -> dict[int, dict[str, np.ndarray]]:
    """The weights of ``versions`` of a versioned folder, each checked against its spec."""
    return {v: await registry.run(read_weights, model.versions[v], model.spec, v) for v in versions}


async def create_versioned(registry: Registry, name: str, model: ModelFolder, keep_versions: int | None = None) -> None:
    """Create (or replace) model ``name`` holding the versions ``model``'s policy picked, numbered
    as their folders, every file checked before anything is written; ``keep_versions``: the
    versions the store keeps (default: the model's config, else the daemon's)."""
    params = await read_versions(registry, model, list(model.versions))
    first, *rest = model.versions
    await registry.create(name, model.spec, model.config, params[first], str(first))
    try:
        entry = registry.get_ready(name)
        for v in rest:
            await registry.run(registry.set_weights_blocking, entry, params[v], str(v), keep_versions)
    except BaseException:
        await registry.delete(name)  # not a model of some of the repository's versions only
        raise


def _note_differences(registry: Registry, name: str, spec: MLPSpec, config: ModelConfig,
                      versions: list[int]) -> None:
    entry = registry.models.get(name)
    if entry is None:  # in the store but unreadable: its own reason says why
        return
    stored = {int(v["version"]) for v in entry.versions}
    lacking = [v for v in versions if v not in stored]
    differ = [what for what, same in ((f"another spec ({SPEC_FILE})", entry.spec.to_json() == spec.to_json()),
                                      (f"another config ({CONFIG_FILE})", entry.config == config),
                                      (f"version(s) {', '.join(map(str, lacking))} the store lacks", not lacking))
              if not same]
    if differ:
        note = (f"the model repository's folder has {' and '.join(differ)}; the stored model is "
                "served (delete it and restart, or PUT it, to take the repository's; --model-control-mode poll "
                "follows the repository)")
        _add_note(entry, note)
        log.warning("model %s: %s", name, note)


def _add_note(entry, note: str) -> None:
    entry.reason = f"{entry.reason}; {note}" if entry.reason else note


# -- writing: `mmad export --to repository` ---------------------------------------------------
def publish_versions(root: Path, name: str, spec: MLPSpec, config: ModelConfig,
                     versions: dict[int, dict[str, np.ndarray]]) -> list[Path]:
    """Write ``versions`` of model ``name`` into repository ``root`` in Triton's layout, each
    version folder (and a new model folder, whole) written under a dot name and renamed into
    place, so that a daemon following the repository never reads half of one. A published
    version is never overwritten; a folder holding another spec is refused. Returns the folders
    written."""
    check_model_name(name)
    for v in versions:
        if v < 1:
            raise InvalidInput(f"version {v}: versions are numbered 1, 2, ...")
    params = {v: check_params(spec, p) for v, p in sorted(versions.items())}
    spec_bytes = json.dumps(spec.to_json(), indent=2, sort_keys=True).encode() + b"\n"
    config_doc = config.model_dump(exclude_defaults=True)
    root.mkdir(parents=True, exist_ok=True)
    folder = root / name
    if not folder.exists():
        staging = root / f".new-{name}-{uuid.uuid4().hex}"
        try:
            staging.mkdir()
            atomic_write(staging / SPEC_FILE, spec_bytes)
            atomic_write(staging / CONFIG_FILE, _json_bytes(config_doc))
            for v, p in params.items():
                atomic_write(staging / str(v) / WEIGHTS_FILE, tensors_to_bytes(p))
            os.rename(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_dir(root)
        return [folder / str(v) for v in params]
    try:
        theirs = MLPSpec.from_json(_read_json(folder / SPEC_FILE))
    except (FolderError, MMADError) as exc:
        raise InvalidInput(f"{folder} is there but not a model folder mmad reads ({exc}); remove it or publish "
                           "under another name") from exc
    if theirs.to_json() != spec.to_json():
        raise InvalidInput(f"{folder / SPEC_FILE} holds another spec than this model's: versions of another "
                           "network do not go beside it; publish under another name or remove the folder")
    taken = [v for v in params if (folder / str(v)).exists()]
    if taken:
        raise InvalidInput(f"version(s) {', '.join(map(str, taken))} of {name!r} are published in {root} already; "
                           "a published version is never changed: publish a newer one (--version)")
    _update_config(folder, config_doc)
    written = []
    for v, p in params.items():
        staging = folder / f".new-{v}-{uuid.uuid4().hex}"
        try:
            atomic_write(staging / WEIGHTS_FILE, tensors_to_bytes(p))
            os.rename(staging, folder / str(v))
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fsync_dir(folder)
        written.append(folder / str(v))
    return written


def newest_published(root: Path, name: str) -> int:
    """The highest version folder of ``name`` in repository ``root`` (0: none)."""
    folder = root / name
    if not folder.is_dir():
        return 0
    return max((int(p.name) for p in folder.iterdir() if p.is_dir() and VERSION_RE.match(p.name)), default=0)


def _update_config(folder: Path, config_doc: dict) -> None:
    """mmad.json holding ``config_doc``, the version_policy written there kept."""
    path = folder / CONFIG_FILE
    doc = _read_json(path) if path.exists() else {}
    if not isinstance(doc, dict):
        raise InvalidInput(f"{path} is not a JSON object; fix or remove it")
    policy = {"version_policy": doc["version_policy"]} if "version_policy" in doc else {}
    if {k: v for k, v in doc.items() if k != "version_policy"} != config_doc or not path.exists():
        atomic_write(path, _json_bytes({**config_doc, **policy}))


def _json_bytes(doc) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"
