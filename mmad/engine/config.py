"""A model's serving config (the ``config`` of ``PUT /v2/models/{m}``, a repository folder's
``mmad.json``): batching limits, placement, the kernel variant, version retention. Plain data,
read by the engine and by the front ends that describe it (its JSON schema is the API's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mmad.errors import InvalidInput
from mmad.settings import Settings


@dataclass(frozen=True)
class BatchLimits:
    """What the dynamic batcher of a model merges and queues: rows per batch, the longest wait
    for more, requests waiting at most."""

    max_batch_rows: int
    max_queue_delay_us: int
    max_queue_requests: int


class ModelConfig(BaseModel):
    """Per-model serving settings; unset fields take the daemon's defaults."""

    model_config = ConfigDict(extra="forbid")

    max_batch_rows: int | None = Field(None, ge=1, le=1 << 24)
    max_queue_delay_us: int | None = Field(None, ge=0, le=10_000_000)
    max_queue_requests: int | None = Field(None, ge=1, le=1 << 20)
    allow_nonfinite: bool = False
    device: int | list[int] | None = Field(None, description="pin the model to this device, or one replica on "
                                                            "each listed device (default: placed by load)")
    replicas: int | None = Field(None, ge=1, le=64, description="replicas on that many devices (default 1)")
    variant: str | None = Field(None, min_length=1,
                                description="run the model on this variant of the daemon's backend (cuda: mma, "
                                            "cublaslt, wgmma); default: the backend's choice, on cuda the fastest "
                                            "for the model, measured (docs/cuda.md)")
    # the store's retention: only the newest N are kept (each new version drops the oldest beyond
    # them); a model repository's folders are picked by Triton's version_policy in mmad.json
    keep_versions: int | None = Field(None, ge=0, le=1_000_000,
                                      description="versions of this model kept in the store, the newest; 0 keeps "
                                                  "all (default: the daemon's --keep-versions)")

    @classmethod
    def parse(cls, doc: Any) -> "ModelConfig":
        try:
            return cls.model_validate(doc or {})
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidInput(f"config.{where}: {first['msg']}; got {first.get('input')!r}") from exc

    def limits(self, settings: Settings) -> BatchLimits:
        return BatchLimits(
            self.max_batch_rows if self.max_batch_rows is not None else settings.max_batch_rows,
            self.max_queue_delay_us if self.max_queue_delay_us is not None else settings.max_queue_delay_us,
            self.max_queue_requests if self.max_queue_requests is not None else settings.max_queue_requests,
        )
