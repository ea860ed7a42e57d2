"""Forwards between CUDA shared-memory regions, run by the primary for its serving workers.

Several processes' work on one GPU is time-sliced between their CUDA contexts: on the H100 host,
one process ran 22,969 forwards a second of 65,536 FP16 rows on device arrays, two to eight
processes 6,100 together (docs/gpu-notes-cuda.md). A request whose input and outputs all lie in
CUDA regions needs no host copy, so that switch is all its cost: with ``--workers`` a worker
reads and checks such a request (HTTP, the references, the bounds) and sends only what names
the tensors to the primary, whose one thread per daemon runs every worker's region forwards in
its own context, a group at a time: each forward launched under its replica's lock, then one
synchronize per device for the group, then every answer.

The messages: 4-byte length, then JSON. A request ``{"id", "model", "input": {...},
"outputs": [{...}], "check_finite"}`` names each tensor by ``region``, ``offset``, ``byte_size``,
``datatype`` (and the input's ``shape``); the answer is ``{"id", "ok": true}`` or ``{"id",
"status", "error"}``, the error the primary's check gave, in the user's terms.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from mmad.errors import (
    ConflictError, DeviceMemoryFull, InvalidInput, LaunchError, MMADError, ModelNotFound, ModelNotReady, NotReady,
)
from mmad.server.binary import WIRE_DTYPES
from mmad.server.errors import status_for
from mmad.server.registry import INPUT

log = logging.getLogger("mmad.server.region_forwards")

HEADER = struct.Struct("<I")
GROUP_MAX = 64  # forwards launched before one synchronize
# an error's status back into the tree (the worker answers as the primary would have)
ERRORS_BY_STATUS = {400: InvalidInput, 404: ModelNotFound, 409: ConflictError, 503: NotReady, 507: DeviceMemoryFull}


WIRE_NAMES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def describe(tensor, **more: Any) -> dict[str, Any]:
    """What names a tensor in its region (a :class:`~mmad.server.shm.ShmTensor`)."""
    return {"region": tensor.region, "offset": tensor.offset, "byte_size": tensor.nbytes,
            "datatype": WIRE_NAMES[tensor.array.dtype], **more}


def _params(doc: dict[str, Any]) -> dict[str, Any]:
    return {"shared_memory_region": doc["region"], "shared_memory_offset": doc["offset"],
            "shared_memory_byte_size": doc["byte_size"]}


# -- the primary's side ------------------------------------------------------------------------
@dataclass
class _Work:
    doc: dict[str, Any]
    connection: socket.socket  # the worker's, where the answer goes
    error: MMADError | None = None
    check: Any = None  # the device word that says the input held NaN or Inf
    devices: set = field(default_factory=set)


class RegionForwardRunner:
    """The one thread that reads the workers' requests and runs them in the primary's CUDA
    context, a group at a time: everything it waits on (the sockets, the synchronize) lets go of
    the GIL, and no request crosses from an event loop to another thread (through the primary's
    event loop and a queue to this thread, 8 clients got 1,536 requests/s on the H100 host)."""

    def __init__(self, rt, path: str, cp: Any = None):
        """Listen on ``path``; ``cp``: CuPy (the default) or a stand-in with its API (tests:
        NumPy arrays as the regions)."""
        self.rt = rt
        self.cp = cp
        self._flags: dict[int, Any] = {}  # device -> GROUP_MAX device words for the finiteness checks
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(256)
        self._wake_read, self._wake_write = socket.socketpair()
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.selector.register(self._wake_read, selectors.EVENT_READ)
        self._buffers: dict[socket.socket, bytearray] = {}
        self.thread = threading.Thread(target=self._run, name="mmad-region-forwards", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Close the socket and every worker's connection (their pending requests fail with 503)."""
        if self.thread.is_alive():
            self._wake_write.send(b"x")
            self.thread.join(30)

    def _run(self) -> None:
        try:
            while True:
                group: list[_Work] = []
                for key, _ in self.selector.select():
                    sock = key.fileobj
                    if sock is self._wake_read:
                        return
                    if sock is self.listener:
                        connection, _ = self.listener.accept()
                        self.selector.register(connection, selectors.EVENT_READ)
                        self._buffers[connection] = bytearray()
                    else:
                        group.extend(self._read(sock))
                for start in range(0, len(group), GROUP_MAX):
                    self._run_group(group[start:start + GROUP_MAX])
        finally:
            for sock in [*self._buffers, self.listener, self._wake_read, self._wake_write]:
                sock.close()
            self.selector.close()

    def _read(self, sock: socket.socket) -> list[_Work]:
        """The complete requests a readable connection holds (none: it closed)."""
        try:
            data = sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(sock)
            del self._buffers[sock]
            sock.close()
            return []
        buffer = self._buffers[sock]
        buffer += data
        works = []
        while len(buffer) >= HEADER.size:
            size = HEADER.unpack_from(buffer)[0]
            if len(buffer) < HEADER.size + size:
                break
            doc = orjson.loads(bytes(buffer[HEADER.size:HEADER.size + size]))
            del buffer[:HEADER.size + size]
            works.append(_Work(doc, sock))
        return works

    def _run_group(self, group: list[_Work]) -> None:
        if self.cp is None:
            from mmad.backends.cuda.toolchain import cupy_module

            self.cp = cupy_module()
        cp = self.cp
        used: dict[int, int] = {}  # device -> flag words used
        for work in group:
            try:
                self._launch(cp, work, used)
            except MMADError as exc:
                work.error = exc
            except Exception as exc:  # noqa: BLE001 - a CUDA failure: this request's 500, the others go on
                log.exception("a region forward failed")
                work.error = LaunchError(f"the forward failed on the device: {type(exc).__name__}: {exc}")
        flags: dict[int, np.ndarray] = {}
        for device, count in used.items():
            try:
                with cp.cuda.Device(device):
                    if count:  # the copy back waits for the group's kernels (one stream): no synchronize first
                        flags[device] = cp.asnumpy(self._flags[device][:count])
                    else:
                        cp.cuda.get_current_stream().synchronize()
            except Exception as exc:  # noqa: BLE001 - every request of the group that ran there failed
                for work in group:
                    if device in work.devices and work.error is None:
                        work.error = LaunchError(f"a CUDA kernel failed: {exc}")
        for work in group:
            if work.error is None and work.check is not None and flags[work.check[0]][work.check[1]]:
                work.error = InvalidInput(f"input {INPUT!r} holds NaN or Inf (set config.allow_nonfinite to allow "
                                          "them)")
            if work.error is None:
                answer = {"id": work.doc["id"], "ok": True}
            else:
                answer = {"id": work.doc["id"], "status": status_for(work.error), "error": str(work.error)}
            body = orjson.dumps(answer)
            try:
                work.connection.sendall(HEADER.pack(len(body)) + body)
            except OSError:  # the worker went away: nobody waits for this answer
                pass

    def _launch(self, cp, work: _Work, used: dict[int, int]) -> None:
        """Resolve the request's regions here (the primary's own mappings, every check again), and
        launch its forward and output copies on the replica on the regions' GPU."""
        doc, shm = work.doc, self.rt.shm
        entry = self.rt.registry.get_ready(doc["model"])
        spec = entry.spec
        ind = doc["input"]
        shape = tuple(ind["shape"])
        if len(shape) != 2 or shape[1] != spec.n_input_dims:
            raise InvalidInput(f"input {INPUT!r} has shape {list(shape)}; model {entry.name!r} takes "
                               f"[-1, {spec.n_input_dims}]")
        source = shm.tensor(f"input {INPUT!r}", _params(ind), WIRE_DTYPES[ind["datatype"]], shape, ind["datatype"])
        out_shape = (shape[0], spec.n_output_dims)
        targets = [shm.tensor(f"output {o['name']!r}", _params(o), WIRE_DTYPES[o["datatype"]], out_shape,
                              o["datatype"], at_least=True) for o in doc["outputs"]]
        if not source.on_device or not all(t.on_device for t in targets):
            raise InvalidInput("a region forward reads and writes CUDA shared memory regions only")
        device = source.device
        if any(t.device != device for t in targets):
            raise InvalidInput(f"shared memory regions {source.region!r} and "
                               f"{next(t.region for t in targets if t.device != device)!r} are on different GPUs; "
                               "one request's regions must share a GPU")
        replica = next((r for r in entry.replicas if r.device == device), None)
        if replica is None:
            raise InvalidInput(f"shared memory region {source.region!r} is on GPU {device} but model {entry.name!r} "
                               f"runs on GPU(s) {', '.join(str(r.device) for r in entry.replicas)}")
        work.devices.add(device)
        with cp.cuda.Device(device):
            if doc.get("check_finite"):
                words = self._flags.get(device)
                if words is None:
                    words = self._flags[device] = cp.zeros(GROUP_MAX, dtype=cp.uint32)
                slot = used.get(device, 0)
                if slot == 0:
                    words.fill(0)
                used[device] = slot + 1
                x = source.array
                pointer = getattr(getattr(x, "data", None), "ptr", None)  # None: not a CuPy array
                if pointer is not None and pointer % 16 == 0:  # the one-launch check reads 16-byte vectors
                    from mmad.backends.cuda.toolchain import flag_nonfinite

                    flag_nonfinite(cp, x, words[slot:slot + 1])
                else:
                    words[slot:slot + 1] = cp.logical_not(cp.isfinite(x).all())
                work.check = (device, slot)
            else:
                used.setdefault(device, 0)
            # launched under the replica's lock, on the stream training uses too: a forward sees
            # the weights before or after a whole optimizer step
            with replica.lock:
                model = replica.model
                if model is None:
                    raise ModelNotReady(entry.name)
                model.forward_into(source.array, targets[0].array)
                for t in targets[1:]:
                    t.array[...] = targets[0].array


# -- the worker's side -------------------------------------------------------------------------
class RegionForwardClient:
    """A worker's link to the primary's region forwards: one connection, requests in flight by id."""

    def __init__(self, path: str):
        self.path = path
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._connecting = asyncio.Lock()

    @staticmethod
    def takes(sources: list, targets: list, out: Any) -> bool:
        """Whether a request is one the primary runs: input and every output in CUDA regions."""
        return (out is None and bool(sources) and bool(targets) and all(s.on_device for s in sources)
                and all(t.on_device for t in targets))

    async def _connect(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self._writer is None or self._writer.is_closing():
                reader, self._writer = await asyncio.open_unix_connection(self.path)
                self._reader_task = asyncio.ensure_future(self._read(reader))
            return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                size = HEADER.unpack(await reader.readexactly(HEADER.size))[0]
                doc = orjson.loads(await reader.readexactly(size))
                future = self._pending.pop(doc["id"], None)
                if future is not None and not future.done():
                    future.set_result(doc)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if self._writer is not None:  # the next request connects again (or fails at once)
                self._writer.close()
                self._writer = None
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(NotReady(f"the daemon's primary process is not answering ({exc})"))
            self._pending.clear()

    async def forward(self, model: str, source: dict[str, Any], outputs: list[dict[str, Any]],
                      check_finite: bool) -> None:
        """Run the forward in the primary; its error raised here as the primary gave it."""
        try:
            writer = await self._connect()
        except OSError as exc:
            raise NotReady(f"the daemon's primary process is not answering ({exc.strerror})") from exc
        ident = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[ident] = future
        if writer.is_closing():  # the primary went away since the connection was taken
            self._pending.pop(ident, None)
            raise NotReady("the daemon's primary process is not answering")
        body = orjson.dumps({"id": ident, "model": model, "input": source, "outputs": outputs,
                             "check_finite": check_finite})
        writer.write(HEADER.pack(len(body)) + body)
        answer = await future
        if not answer.get("ok"):
            raise ERRORS_BY_STATUS.get(answer["status"], LaunchError)(answer["error"])

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
