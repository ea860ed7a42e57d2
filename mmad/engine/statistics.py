"""Triton's statistics of a model, with the counts of the processes serving beside this one
(``mmad serve --workers``) added in: the primary's and its workers' requests are one model's."""

from __future__ import annotations

from typing import Any

from mmad.engine.messages import HeldModel, WorkerRecords
from mmad.engine.registry import ModelEntry
from mmad.engine.runtime import Runtime

_DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
              "cache_hit", "cache_miss")


async def worker_records(rt: Runtime) -> list[WorkerRecords]:
    """The serving workers' counts (``--workers``; none without), added to the primary's."""
    return await rt.workers.records() if rt.workers is not None else []


def merge_stats(doc: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """Triton's statistics of one model: ``doc`` (the primary's) with the workers' ``others``
    (the same model's, same incarnation) added in."""
    merged = {**doc, "inference_stats": {k: dict(v) for k, v in doc["inference_stats"].items()}}
    batches = {b["batch_size"]: {k: (dict(v) if isinstance(v, dict) else v) for k, v in b.items()}
               for b in doc["batch_stats"]}
    for other in others:
        merged["inference_count"] += other["inference_count"]
        merged["execution_count"] += other["execution_count"]
        merged["last_inference"] = max(merged["last_inference"], other["last_inference"])
        for key in _DURATIONS:
            for field in ("count", "ns"):
                merged["inference_stats"][key][field] += other["inference_stats"][key][field]
        for b in other["batch_stats"]:
            mine = batches.setdefault(b["batch_size"], {"batch_size": b["batch_size"],
                                                        **{k: {"count": 0, "ns": 0} for k in b if k != "batch_size"}})
            for key, value in b.items():
                if key != "batch_size":
                    mine[key]["count"] += value["count"]
                    mine[key]["ns"] += value["ns"]
    merged["batch_stats"] = [batches[size] for size in sorted(batches)]
    return merged


def _held(records: list[WorkerRecords], name: str, incarnation: str | None) -> list[HeldModel]:
    return [held for r in records for held in [r.models.get(name)]
            if held is not None and held.incarnation == incarnation]


def worker_stats(records: list[WorkerRecords], name: str, incarnation: str | None) -> list[dict[str, Any]]:
    """The workers' statistics of model ``name`` as it is now (a replaced model's are dropped)."""
    return [held.stats for held in _held(records, name, incarnation)]


def worker_queued(records: list[WorkerRecords], entry: ModelEntry) -> int:
    """Requests waiting in the workers' batchers for the model of ``entry``."""
    return sum(held.queued for held in _held(records, entry.name, entry.incarnation))


def model_statistics(rt: Runtime, records: list[WorkerRecords], name: str, version: str | None = None) -> dict[str, Any]:
    """Triton's statistics document of model ``name`` (the live version's, or ``version``'s),
    the workers' ``records`` added in."""
    registry = rt.registry
    entry = registry.get(name)
    if version is not None:
        registry.check_version(name, version)
    doc = entry.stats.to_json(name, version or registry.latest_version(name))
    others = worker_stats(records, name, entry.incarnation)
    return merge_stats(doc, others) if others else doc
