"""Several processes serving one port: ``mmad serve --workers N``.

One Python process answers a 65,536-row shared-memory request in ~0.66 ms of which the device
needs 0.34 (measured on an H100): its event loop, not the GPU, bounds serving. With
``--workers N`` the port is served by N inference workers, with the primary behind them:

- the *primary* (this module's :class:`WorkerPool`) is the daemon as it is alone, serving the
  workers on a private socket: it owns the store, the registry, training, datasets and every
  admin call, and (on the cuda backend) runs every worker's forwards between shared-memory
  regions (CUDA or system) in its one CUDA context per GPU (:mod:`mmad.engine.region_forwards`);
- each *worker* (:mod:`mmad.server.worker`) holds a compiled copy of every ready model with the
  primary's live weights and answers infer requests for them itself; every other request
  (admin, training, metadata, a pinned version, a model it does not hold) it passes to the
  primary unchanged, bodies and responses streamed (SSE included).

Connections: the primary listens on the port and passes each connection it accepts to the
ready worker with the fewest open connections (:class:`WorkerPool`'s dealer thread, the
descriptor sent over a Unix socket pair). A client's requests all go to the worker that holds
its connection, so the spread of connections is the spread of the load; the kernel's own
spreading (``SO_REUSEPORT``, a hash of each connection) left one of 8 workers with three of 8
persistent clients and three with none (measured on an H100 with 8 workers). The port
refuses connections while no worker is ready (at start, and while every worker is being
started again).

Consistency: the primary bumps a counter in shared memory after every change inference can see
(weights, versions, models, shared-memory regions; :meth:`Registry.changed`) and before it
answers the request that made it; a worker compares the counter with the one it last synced at
the start of each infer request and re-reads what changed first. So a request sent after an
admin call's answer sees its effect, whichever worker it lands on.

The primary and the workers talk over Unix sockets in a private directory, and the internal
routes need a token made at start (:data:`TOKEN_HEADER`). Statistics and metrics are read from
every worker when asked for and added to the primary's (:func:`mmad.engine.statistics.merge_stats`,
:meth:`Metrics.render`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx
import numpy as np

from mmad.engine.messages import WorkerRecords
from mmad.server.internal import INTERNAL_PREFIX, TOKEN_HEADER
from mmad.settings import Settings

log = logging.getLogger("mmad.server.workers")

RECORDS_TIMEOUT_S = 5.0
# a worker that exits sooner than this after its start is not started again at once
RESTART_BACKOFF_S = (1.0, 60.0)
LISTEN_BACKLOG = 2048  # uvicorn's default
DEAL_POLL_S = 0.1  # how soon the dealer notices a worker ready or gone, or the daemon stopping
DEAL_SEND_TIMEOUT_S = 5.0  # a worker whose loop takes no descriptor in this long is passed over


class SharedCounter:
    """int64 slots in a file mapping, each written by one process and read by the others (an
    aligned 8-byte store is atomic on the CPUs CPython runs on)."""

    def __init__(self, path: str, create: bool = False, slots: int = 1):
        if create:
            with open(path, "wb") as f:
                f.write(bytes(8 * slots))
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 8 * slots)
        finally:
            os.close(fd)
        self._values = np.frombuffer(self._map, dtype=np.int64)

    @property
    def value(self) -> int:
        return int(self._values[0])

    def get(self, slot: int) -> int:
        return int(self._values[slot])

    def store(self, value: int, slot: int = 0) -> None:
        self._values[slot] = value


@dataclass(frozen=True)
class WorkerLink:
    """What a worker is given at start (pickled into the spawned process)."""

    index: int  # 1..N; the primary is process 0
    private_dir: str
    token: str
    port: int  # the public port, resolved when it was given as 0
    primary_pid: int  # a worker whose parent is no longer this process stops

    @property
    def primary_alive(self) -> bool:
        return os.getppid() == self.primary_pid

    @property
    def primary_socket(self) -> str:
        return os.path.join(self.private_dir, "primary.sock")

    @property
    def region_forwards_socket(self) -> str:
        return os.path.join(self.private_dir, "region-forwards.sock")

    @property
    def counter_path(self) -> str:
        return os.path.join(self.private_dir, "generation")

    @property
    def closed_path(self) -> str:
        """Each worker's count of the dealt connections it has closed (slot = its index)."""
        return os.path.join(self.private_dir, "closed-connections")

    def worker_socket(self, index: int | None = None) -> str:
        return os.path.join(self.private_dir, f"worker-{self.index if index is None else index}.sock")


def bind_shared_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound with ``SO_REUSEPORT``, not listening: the primary holds the port with
    one for the daemon's life, and its dealer binds another beside it while it listens."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def bind_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock.bind(path)
    return sock


class WorkerPool:
    """The primary's side: the private directory, the shared counter, the worker processes
    (started again when one dies), the dealer of the port's connections, and reading the
    workers' statistics."""

    def __init__(self, settings: Settings, count: int,
                 run_worker: Callable[[Settings, WorkerLink, socket.socket], None]):
        self.settings = settings
        self.run_worker = run_worker  # what a spawned worker process runs (importable by the spawn)
        self.count = count  # the worker processes (the primary serves only them)
        self.private_dir = tempfile.mkdtemp(prefix="mmad-workers-")  # mode 0700
        self.token = secrets.token_urlsafe(32)
        self.port = 0
        self.counter = SharedCounter(os.path.join(self.private_dir, "generation"), create=True)
        self.closed = SharedCounter(self.link(0).closed_path, create=True, slots=count + 1)
        self._procs: dict[int, Any] = {}
        self._ready: set[int] = set()  # workers serving since their last start
        self._started_at: dict[int, float] = {}
        self._failures: dict[int, int] = {}
        self._channels: dict[int, socket.socket] = {}  # the primary's end of each worker's pair
        self._dealt: dict[int, int] = {}  # connections passed to each worker since its start
        self._last_dealt: dict[int, int] = {}  # when each worker was last passed one (ties go round)
        self._deals = itertools.count()
        self._lock = threading.Lock()  # the ready set and the channels: the loop, monitor and dealer
        self._stopping = threading.Event()
        self._monitor: threading.Thread | None = None
        self._dealer: threading.Thread | None = None
        self._context = multiprocessing.get_context("spawn")  # a fork would copy CUDA state and threads

    def link(self, index: int) -> WorkerLink:
        return WorkerLink(index, self.private_dir, self.token, self.port, os.getpid())

    @property
    def primary_socket(self) -> str:
        return self.link(0).primary_socket

    @property
    def region_forwards_socket(self) -> str:
        return self.link(0).region_forwards_socket

    def publish(self, generation: int) -> None:
        """Tell the workers that what inference sees changed (they sync before their next infer)."""
        self.counter.store(generation)

    def start(self, port: int) -> None:
        self.port = port
        for index in range(1, self.count + 1):
            self._spawn(index)
        self._monitor = threading.Thread(target=self._watch, name="mmad-workers", daemon=True)
        self._monitor.start()
        self._dealer = threading.Thread(target=self._deal, name="mmad-connections", daemon=True)
        self._dealer.start()

    def _spawn(self, index: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.settimeout(DEAL_SEND_TIMEOUT_S)
        with self._lock:
            self._ready.discard(index)
            previous = self._channels.pop(index, None)
            self._dealt[index] = 0
            self.closed.store(0, index)
        if previous is not None:
            previous.close()
        proc = self._context.Process(target=self.run_worker, args=(self.settings, self.link(index), theirs),
                                     name=f"mmad-worker-{index}", daemon=False)
        proc.start()
        theirs.close()
        with self._lock:
            self._channels[index] = ours
        self._procs[index] = proc
        self._started_at[index] = time.monotonic()
        log.info("started serving worker %d (pid %d)", index, proc.pid)

    def _watch(self) -> None:
        """Start a worker again when it exits (not while the daemon stops); one that keeps dying
        at start waits longer each time (up to a minute), logged each time."""
        while not self._stopping.wait(0.5):
            for index, proc in list(self._procs.items()):
                if proc.is_alive() or self._stopping.is_set():
                    continue
                with self._lock:
                    self._ready.discard(index)  # no more connections for it
                lived = time.monotonic() - self._started_at[index]
                self._failures[index] = self._failures.get(index, 0) + 1 if lived < 10 else 1
                delay = min(RESTART_BACKOFF_S[1], RESTART_BACKOFF_S[0] * 2 ** (self._failures[index] - 1))
                log.error("serving worker %d (pid %d) exited with %s after %.1f s; starting it again in %.0f s",
                          index, proc.pid, proc.exitcode, lived, delay)
                if self._stopping.wait(delay):
                    return
                self._spawn(index)

    def mark_ready(self, index: int) -> None:
        """Worker ``index`` takes connections (it says so once its start-up is done)."""
        if index in self._procs:
            with self._lock:
                self._ready.add(index)
            log.info("serving worker %d is ready", index)

    @property
    def waiting(self) -> list[int]:
        """The workers not serving yet (starting, or started again after they exited)."""
        return sorted(i for i in range(1, self.count + 1) if i not in self._ready)

    # -- the port's connections ----------------------------------------------------------------
    def _deal(self) -> None:
        """Listen while a worker is ready, and pass each accepted connection on."""
        listener: socket.socket | None = None
        try:
            while not self._stopping.is_set():
                with self._lock:
                    serving = bool(self._ready)
                if not serving:
                    if listener is not None:
                        log.warning("no serving worker is ready: the port refuses connections until one is")
                        listener.close()
                        listener = None
                    self._stopping.wait(DEAL_POLL_S)
                    continue
                if listener is None:
                    try:
                        listener = self._listen()
                    except OSError as exc:
                        log.error("could not listen on port %d (%s); trying again", self.port, exc)
                        self._stopping.wait(1.0)
                        continue
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:  # out of descriptors, or the peer gone before the accept
                    log.warning("accepting a connection failed (%s)", exc)
                    self._stopping.wait(DEAL_POLL_S)
                    continue
                with conn:
                    self._pass_on(conn)
        finally:
            if listener is not None:
                listener.close()

    def _listen(self) -> socket.socket:
        listener = bind_shared_port(self.settings.host, self.port)
        listener.listen(LISTEN_BACKLOG)
        listener.settimeout(DEAL_POLL_S)
        return listener

    def _pass_on(self, conn: socket.socket) -> None:
        """To the ready worker with the fewest open connections (of equals, the one passed one
        longest ago). A worker whose end of the pair is closed has died (the monitor starts it
        again); one whose loop takes nothing within :data:`DEAL_SEND_TIMEOUT_S` is passed over
        for this connection only."""
        passed_over: set[int] = set()
        while True:
            with self._lock:
                ready = [i for i in self._ready if i in self._channels and i not in passed_over]
                if not ready:
                    log.warning("a connection was closed unanswered: no serving worker took it")
                    return
                index = min(ready, key=lambda i: (self._dealt[i] - self.closed.get(i), self._last_dealt.get(i, -1)))
                channel = self._channels[index]
            try:
                socket.send_fds(channel, [b"c"], [conn.fileno()])
            except TimeoutError:
                log.warning("serving worker %d took no connection in %.0f s: passed over for this one",
                            index, DEAL_SEND_TIMEOUT_S)
                passed_over.add(index)
                continue
            except OSError as exc:
                log.warning("serving worker %d took no connection (%s): passed over until it is started again",
                            index, exc)
                with self._lock:
                    self._ready.discard(index)
                continue
            with self._lock:
                self._dealt[index] += 1
                self._last_dealt[index] = next(self._deals)
            return

    def signal_stop(self) -> None:
        """Ask every worker to finish its requests and exit (SIGTERM: uvicorn's graceful path);
        the port stops taking connections."""
        self._stopping.set()
        for proc in self._procs.values():
            if proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)

    def stop(self, timeout_s: float) -> None:
        self.signal_stop()
        deadline = time.monotonic() + timeout_s
        for index, proc in self._procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("serving worker %d did not stop in %.0f s; killed", index, timeout_s)
                proc.kill()
                proc.join(5)
        if self._dealer is not None:
            self._dealer.join(5)
        for channel in self._channels.values():
            channel.close()
        shutil.rmtree(self.private_dir, ignore_errors=True)

    async def records(self) -> list[WorkerRecords]:
        """Every live worker's statistics and metric samples (:meth:`mmad.server.worker.WorkerApp.records`);
        a worker that does not answer in time is left out, logged."""

        async def one(index: int) -> WorkerRecords | None:
            transport = httpx.AsyncHTTPTransport(uds=self.link(index).worker_socket())
            try:
                async with httpx.AsyncClient(transport=transport, base_url="http://worker",
                                             timeout=RECORDS_TIMEOUT_S) as client:
                    response = await client.get(f"{INTERNAL_PREFIX}/records", headers={TOKEN_HEADER: self.token})
                    response.raise_for_status()
                    return WorkerRecords.from_json(response.json())
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                log.warning("serving worker %d gave no statistics (%s): they are missing from this answer",
                            index, exc)
                return None

        answers = await asyncio.gather(*(one(i) for i, p in self._procs.items() if p.is_alive()))
        return [a for a in answers if a is not None]
