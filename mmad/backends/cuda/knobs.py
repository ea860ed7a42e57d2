"""The cuda backend's settings from the environment, parsed once per compile, typed, checked.

| variable | values | default | what |
|---|---|---|---|
| ``MMAD_DISPATCH`` | background, measure, fixed | background | compile(variant=None): a quick variant at once, the fastest measured in the background and swapped in; measure: the fastest measured before returning; fixed: wgmma or mma |
| ``MMAD_CUDA_WGMMA`` | 0, 1 | 1 | offer the wgmma variants (0: the probe reports them off) |
| ``MMAD_CUDA_FUSED_WGRAD`` | 0, 1 | 1 | mma training accumulates weight gradients inside the training kernel where they fit |
| ``MMAD_CUDA_GRAPHS`` | 0, 1 | 1 | mma training replays one captured CUDA graph per step, and mmad.torch a graph per forward and per backward of a batch size seen again (0: launches each kernel, to measure what graphs save) |
| ``MMAD_CUDA_WGMMA_WARPGROUPS`` | 1, 2 | plan | warpgroups per wgmma forward block (unset: the shared-memory plan decides) |
| ``MMAD_CUDA_WGMMA_STAGES`` | 0, 1, 2 | plan | input tiles each wgmma warpgroup prefetches (unset: the plan decides) |
| ``MMAD_CUDA_WGMMA_HALF_WARPGROUPS`` | 1, 2, 3, 4 | plan | warpgroups per block of the fp16-I/O wgmma forward |
| ``MMAD_CUDA_WGMMA_HALF_STAGES`` | 1, 2, 3, 4 | plan | input tiles in each fp16-I/O warpgroup's ring (the one computing and those in flight) |

A value outside its list is an error naming the variable, never a silent default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from mmad.errors import SpecError

DISPATCH_ENV = "MMAD_DISPATCH"
DISPATCH_MODES = ("background", "measure", "fixed")
WGMMA_ENV = "MMAD_CUDA_WGMMA"
FUSED_WGRAD_ENV = "MMAD_CUDA_FUSED_WGRAD"
CUDA_GRAPHS_ENV = "MMAD_CUDA_GRAPHS"
WGMMA_WARPGROUPS_ENV = "MMAD_CUDA_WGMMA_WARPGROUPS"
WGMMA_STAGES_ENV = "MMAD_CUDA_WGMMA_STAGES"
WGMMA_HALF_WARPGROUPS_ENV = "MMAD_CUDA_WGMMA_HALF_WARPGROUPS"
WGMMA_HALF_STAGES_ENV = "MMAD_CUDA_WGMMA_HALF_STAGES"


def env_choice(name: str, allowed: tuple[int, ...]) -> int | None:
    """An integer setting from the environment, one of ``allowed``; None when unset."""
    raw = os.environ.get(name, "")
    if raw == "":
        return None
    if not raw.isdigit() or int(raw) not in allowed:
        raise SpecError(name, f"must be one of {', '.join(map(str, allowed))}; got {raw!r}")
    return int(raw)


def env_word(name: str, allowed: tuple[str, ...]) -> str:
    """A word setting from the environment, one of ``allowed`` (case-insensitive); the first when unset."""
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return allowed[0]
    if raw not in allowed:
        raise SpecError(name, f"must be one of {', '.join(allowed)}; got {raw!r}")
    return raw


@dataclass(frozen=True)
class CudaKnobs:
    dispatch: str = "background"
    wgmma: bool = True
    fused_wgrad: bool = True
    cuda_graphs: bool = True
    wgmma_warpgroups: int | None = None
    wgmma_stages: int | None = None
    wgmma_half_warpgroups: int | None = None
    wgmma_half_stages: int | None = None

    @classmethod
    def from_env(cls) -> "CudaKnobs":
        return cls(
            dispatch=env_word(DISPATCH_ENV, DISPATCH_MODES),
            wgmma=env_choice(WGMMA_ENV, (0, 1)) != 0,
            fused_wgrad=env_choice(FUSED_WGRAD_ENV, (0, 1)) != 0,
            cuda_graphs=env_choice(CUDA_GRAPHS_ENV, (0, 1)) != 0,
            wgmma_warpgroups=env_choice(WGMMA_WARPGROUPS_ENV, (1, 2)),
            wgmma_stages=env_choice(WGMMA_STAGES_ENV, (0, 1, 2)),
            wgmma_half_warpgroups=env_choice(WGMMA_HALF_WARPGROUPS_ENV, (1, 2, 3, 4)),
            wgmma_half_stages=env_choice(WGMMA_HALF_STAGES_ENV, (1, 2, 3, 4)),
        )
