"""The messages between a primary and its serving workers (``mmad serve --workers``), typed on
both sides and carried as JSON over the private sockets."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ServedModel:
    """One ready model of the primary, as a worker compiles and follows it."""

    name: str
    incarnation: str | None  # a new one each time the model is created or replaced
    generation: int  # moves whenever its live weights change
    spec: dict[str, Any]  # tiny-cuda-nn's JSON
    config: dict[str, Any]  # its serving config
    devices: list[Any]  # the devices of its replicas
    variant: str
    version: str  # its latest version

    @property
    def shape(self) -> tuple:
        """What, if it changes, needs the model compiled again (weights alone do not)."""
        return (self.incarnation, repr(self.spec), repr(sorted(self.config.items())), tuple(self.devices),
                self.variant)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ServedModel:
        return cls(**doc)


@dataclass(frozen=True)
class PrimaryState:
    """What a worker follows: the primary's ready models and shared-memory registrations, at
    least as new as ``generation`` (read first)."""

    generation: int
    backend: str
    models: list[ServedModel]
    shm: list[dict[str, Any]]  # the shared-memory registry's registrations, as it replays them

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "backend": self.backend,
                "models": [m.to_json() for m in self.models], "shm": self.shm}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PrimaryState:
        return cls(doc["generation"], doc["backend"], [ServedModel.from_json(m) for m in doc["models"]], doc["shm"])


@dataclass(frozen=True)
class HeldModel:
    """A worker's counts of one model it holds."""

    incarnation: str | None
    stats: dict[str, Any]  # Triton's statistics document of the model
    queued: int  # requests waiting in the worker's batcher


@dataclass(frozen=True)
class WorkerRecords:
    """A worker's statistics (per model) and metric samples, added to the primary's when asked for."""

    models: dict[str, HeldModel] = field(default_factory=dict)
    samples: list[list[Any]] = field(default_factory=list)  # Metrics.samples()

    def to_json(self) -> dict[str, Any]:
        return {"models": {name: asdict(held) for name, held in self.models.items()}, "samples": self.samples}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> WorkerRecords:
        return cls({name: HeldModel(**held) for name, held in doc["models"].items()}, doc["samples"])
