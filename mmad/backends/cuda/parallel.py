"""Data-parallel training over several GPUs of one host: NCCL all-reduce through CuPy.

One process drives every replica (``NcclCommunicator.initAll``: a communicator per device).
Each step enqueues, on every replica's device, the draw of its part of the batch from its
shard, forward, backward and the reduction of its gradient into one flat fp32 buffer
(``CudaMmaModel.parallel_gradients``); one grouped ``ncclAllReduce`` sums the buffers in place
on each device's stream; then every replica takes the same optimizer step on the same sum
(``parallel_apply``). Nothing waits on the host between steps: the host only enqueues, and the
losses come back once at the end of the call. The sums are bitwise the same on every rank, so
the replicas' weights stay identical.

NVLink multicast (NVLS) stays off (``NCCL_NVLS_ENABLE=0``, set before the communicators are
made unless the environment sets it): it is not needed for a few hundred kilobytes of
gradients, and on shared hosts it can put the GPUs out of service.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mmad.backends.contract import CompiledModel, Dataset, EpochPosition
from mmad.backends.cuda.mma import CudaMmaModel
from mmad.backends.cuda.toolchain import device_errors
from mmad.backends.parallel import DataParallel, check_parallel_run
from mmad.errors import BackendUnavailable, InvalidInput, LaunchError


def nccl_module():
    """CuPy's NCCL binding, or BackendUnavailable saying why not."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise BackendUnavailable("cuda (NCCL)", f"CuPy's NCCL binding could not be imported: {exc}") from exc
    if not getattr(nccl, "available", True):
        raise BackendUnavailable("cuda (NCCL)", "CuPy found no NCCL library (libnccl.so.2)")
    return nccl


class NcclDataParallel(DataParallel):
    """Replicas of one model on different GPUs (mma variant), gradients all-reduced by NCCL."""

    def __init__(self, replicas: list[CompiledModel]):
        super().__init__(replicas)
        for model in replicas:
            if not isinstance(model, CudaMmaModel):
                raise InvalidInput(f"data-parallel training on the cuda backend runs on the mma variant; this "
                                   f"model is compiled for {model.variant}")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self.nccl = nccl_module()
        self.cp = replicas[0].cp
        try:
            self.comms = self.nccl.NcclCommunicator.initAll([m.device_index for m in replicas])
        except Exception as exc:  # NcclError, CUDA errors: the same to the user
            raise LaunchError(f"NCCL could not connect devices {[m.device_index for m in replicas]}: "
                              f"{type(exc).__name__}: {exc}") from exc

    def train_epochs(self, shards: list[Dataset], batches: list[int], steps: int,
                     positions: list[EpochPosition]) -> np.ndarray:
        check_parallel_run(shards, batches, steps, positions)
        replicas: list[Any] = self.replicas
        total = sum(batches)
        nccl, cp = self.nccl, self.cp
        grads = []
        for model, data, batch, position in zip(replicas, shards, batches, positions):
            with model.cuda_device:
                grads.append(model.parallel_start(data, batch, steps, position))
        try:
            for _ in range(steps):
                for model in replicas:
                    with model.cuda_device:
                        model.parallel_gradients(total)
                nccl.groupStart()
                try:
                    for model, comm, g in zip(replicas, self.comms, grads):
                        with model.cuda_device:
                            comm.allReduce(g.data.ptr, g.data.ptr, g.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                           cp.cuda.get_current_stream().ptr)
                finally:
                    nccl.groupEnd()
                for model in replicas:
                    with model.cuda_device:
                        model.parallel_apply()
            losses = []
            for model, position in zip(replicas, positions):
                with model.cuda_device:
                    losses.append(model.parallel_finish(steps, position))
        except nccl.NcclError as exc:
            raise LaunchError(f"the NCCL all-reduce of the gradients failed: {exc}") from exc
        except device_errors(cp) as exc:
            raise LaunchError(f"a data-parallel training step failed: {exc}") from exc
        # each replica's loss is the mean over its rows: weighted by its rows, the batch's mean
        return (sum(loss.astype(np.float64) * batch for loss, batch in zip(losses, batches)) / total).astype(np.float32)

    def close(self) -> None:
        for comm in getattr(self, "comms", ()):
            comm.destroy()
        self.comms = []
