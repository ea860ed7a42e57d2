"""Shared fixtures: a REAL mmad daemon (``python -m mmad.server.main``) on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from oracle import TEST_SEED_ENV, run_seed

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    run_seed()  # drawn here, before pytest-xdist's workers start, so that they inherit it
    # the tests' daemons (subprocesses and in-process apps) listen on free ports: gRPC's fixed
    # default (8001) would be taken by the first of them; a test that serves gRPC gives a port
    os.environ["MMAD_GRPC_PORT"] = "0"


def pytest_report_header(config) -> str:
    return f"random test data: {TEST_SEED_ENV}={run_seed()} (set it to draw this run's data again)"


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if exitstatus != 0:  # also under -q, which hides the header
        terminalreporter.write_line(f"random test data of this run: {TEST_SEED_ENV}={run_seed()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """``mmad serve`` in a subprocess with its own store; ``kill()`` is a kill -9."""

    def __init__(self, store: Path, *args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None,
                 main: list[str] | None = None):
        """``prefix``: a command that runs the daemon's command line (e.g. ``unshare ...``);
        ``main``: the command before the daemon's arguments (default ``python -m mmad.server.main``)."""
        self.store = store
        self.args = args
        self.prefix = prefix or []
        self.main = main or [sys.executable, "-m", "mmad.server.main"]
        self.env = {**os.environ, "MMAD_BACKEND": "cpu", "MMAD_PROBE": "cpu", "MMAD_LOG_LEVEL": "warning",
                    **(env or {})}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log_path = store.parent / f"daemon-{self.port}.log"

    def start(self, timeout_s: float = 60.0) -> "DaemonProcess":
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([*self.prefix, *self.command()], env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"the daemon did not become ready in {timeout_s} s:\n{self.log()}")

    def command(self) -> list[str]:
        return [*self.main, "--host", "127.0.0.1", "--port", str(self.port), "--store", str(self.store), *self.args]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait: the graceful path."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        return self.proc.returncode


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    """One shared daemon (cpu backend, demo model, 4 MiB body cap) for the read-mostly tests."""
    store = tmp_path_factory.mktemp("store") / "store"
    proc = DaemonProcess(store, "--max-body-bytes", str(4 * 1024 * 1024)).start()
    yield proc
    proc.stop()


@pytest.fixture
def http(daemon):
    with httpx.Client(base_url=daemon.url, timeout=30.0) as client:
        yield client
