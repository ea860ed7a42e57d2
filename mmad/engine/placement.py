"""Model placement: which devices a model's replicas go to.

A model's config may pin it (``"device": 1``, or a list: one replica on each) or ask for a
number of replicas (``"replicas": 2``); otherwise it gets one replica. Unpinned replicas go to
the devices holding the fewest replicas already, then the most free memory, then the lowest
index: new models spread over the GPUs, and a host with one device behaves as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmad.errors import InvalidInput


@dataclass(frozen=True)
class DeviceLoad:
    """What placement knows of one device: its index, free memory (None: unknown), and how many
    model replicas the daemon holds there."""

    index: int
    memory_free: int | None
    replicas: int


def _have(count: int) -> str:
    return "device 0" if count == 1 else f"devices 0 to {count - 1}"


def place(devices: list[DeviceLoad], pinned: int | list[int] | None, replicas: int | None) -> list[int]:
    """The device of each replica (the first holds the weights training updates); clear errors
    for a pin or a count the host cannot satisfy."""
    count = len(devices)
    if count == 0:
        raise InvalidInput("the backend reports no device to place the model on")
    if pinned is not None:
        wanted = [pinned] if isinstance(pinned, int) else list(pinned)
        if not wanted:
            raise InvalidInput("config.device: give a device index or a non-empty list of them")
        for index in wanted:
            if not 0 <= index < count:
                raise InvalidInput(f"config.device: device {index} does not exist; this host has {_have(count)}")
        if len(set(wanted)) != len(wanted):
            raise InvalidInput(f"config.device: each device may hold one replica of a model; got {wanted}")
        if replicas is not None and replicas != len(wanted):
            raise InvalidInput(f"config.replicas ({replicas}) must match the devices listed in config.device "
                               f"({len(wanted)}), or be left out")
        return wanted
    n = 1 if replicas is None else replicas
    if not 1 <= n <= count:
        raise InvalidInput(f"config.replicas: {n} replicas need {n} devices (one replica a device); this host has "
                           f"{_have(count)}")
    order = sorted(devices, key=lambda d: (d.replicas, -(d.memory_free or 0), d.index))
    return [d.index for d in order[:n]]
