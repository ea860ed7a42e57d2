"""What a person meets first: `mmad serve/demo/export --help`, ``GET /`` and the one line that a
daemon started on a store or a port that another one holds ends with."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import httpx
import pytest

from conftest import REPO, DaemonProcess, free_port


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env={**os.environ, "MMAD_BACKEND": "cpu", "MMAD_PROBE": "cpu", "MMAD_LOG_LEVEL": "info",
                               **(env or {})})


def words(text: str) -> str:
    return " ".join(text.split())  # argparse wraps help text at any space


def test_serve_help_shows_where_the_store_is_by_default():
    # a short path: argparse breaks a word longer than the help column
    proc = run("-m", "mmad.cli", "serve", "--help", env={"XDG_DATA_HOME": "/srv/data"})
    assert proc.returncode == 0, proc.stderr
    assert "(MMAD_STORE_DIR, default /srv/data/mmad/store, i.e. $XDG_DATA_HOME/mmad/store)" in words(proc.stdout)


def test_demo_help_explains_steps_and_batch():
    proc = run("-m", "mmad.cli", "demo", "--help")
    assert proc.returncode == 0, proc.stderr
    text = words(proc.stdout)
    assert "--steps STEPS training steps (Adam updates) to run (default 300)" in text
    assert "--batch BATCH rows per step: random points of the field" in text and "(default 4096)" in text


def test_export_help_says_what_the_command_does():
    proc = run("-m", "mmad.cli", "export", "--help")
    assert proc.returncode == 0, proc.stderr
    text = words(proc.stdout)
    assert "Write a model, given by its config and one source of weights, as an ONNX file" in text
    assert "docs/export.md" in text


def test_a_second_daemon_on_the_same_store_ends_with_one_line(daemon):
    proc = run("-m", "mmad.server.main", "--host", "127.0.0.1", "--port", str(free_port()),
               "--store", str(daemon.store))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"mmad serve: the model store {daemon.store} is in use by another mmad daemon"]
    assert httpx.get(f"{daemon.url}/v2/health/ready").status_code == 200  # the first one is untouched


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_busy_port_ends_with_one_line(tmp_path, workers):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = run("-m", "mmad.server.main", "--host", "127.0.0.1", "--port", str(port),
                   "--store", str(tmp_path / "store"), "--workers", workers)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"mmad serve: 127.0.0.1:{port} is already in use (another mmad daemon or "
                                        "another server): stop it or choose another --port"]


def test_the_daemon_serves_on_the_socket_it_bound_before_start_up(tmp_path):
    proc = DaemonProcess(tmp_path / "store", env={"MMAD_LOG_LEVEL": "info"}).start()
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", proc.port))
        assert httpx.get(f"{proc.url}/v2/models/demo/ready").status_code == 200
    finally:
        proc.stop()
    assert f"INFO mmad.server: serving http://127.0.0.1:{proc.port} (Ctrl-C stops)" in proc.log()


def test_root_points_to_the_dashboard_and_the_api_docs(http):
    doc = http.get("/").json()
    assert doc["name"] == "mmad" and doc["version"]
    links = doc["links"]
    assert links["dashboard"] == "/ui" and links["docs"] == "/docs"
    for path in links.values():
        assert http.get(path).status_code == 200, path
    page = http.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.headers["content-type"].startswith("text/html")
    assert '<a href="/ui">/ui</a>' in page.text and '<a href="/docs">/docs</a>' in page.text
