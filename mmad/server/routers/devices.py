"""``GET /v2/devices``: the probe report taken once at startup, each device's memory and load now,
and the variants the dispatcher chose for the loaded models."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from mmad.server.bodies import json_response
from mmad.engine.runtime import Runtime
from mmad.server.deps import runtime
from mmad.server.errors import ERROR_RESPONSES

router = APIRouter(tags=["devices"], responses=ERROR_RESPONSES)


def device_report(rt: Runtime) -> list[dict]:
    """Every device models can be placed on: memory (bytes, read now; null where the backend
    cannot tell), the models with a replica there, and the forwards running or waiting there."""
    placed: dict[int, list[str]] = {}
    in_flight: dict[int, int] = {}
    for entry in rt.registry.models.values():
        for replica in entry.replicas:
            if replica.model is not None:
                placed.setdefault(replica.device, []).append(entry.name)
                in_flight[replica.device] = in_flight.get(replica.device, 0) + replica.in_flight
    return [{**d.to_json(), "models": sorted(placed.get(d.index, [])), "in_flight": in_flight.get(d.index, 0)}
            for d in rt.backend.devices()]


def dispatch_report(rt: Runtime) -> list[dict]:
    """One entry per loaded replica whose variant the backend chose by measurement: the model, its
    device and the decision (every variant's figures, or why it was skipped)."""
    return [{"model": entry.name, "device_index": replica.device, **replica.model.dispatch.to_json()}
            for entry in rt.registry.models.values() for replica in entry.replicas
            if replica.model is not None and replica.model.dispatch is not None]


@router.get("/v2/devices")
async def devices(rt: Runtime = Depends(runtime)):
    report = await rt.registry.run(device_report, rt)  # memory queries talk to the driver: off the event loop
    return json_response({"selected": rt.selected.to_json(), "rows": [r.to_json() for r in rt.probe_rows],
                          "devices": report, "dispatch": dispatch_report(rt)})
