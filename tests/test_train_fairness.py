"""Long ``/train`` requests share the daemon: they never take every compute
thread from inference on other models, and one whose client went away stops at its next slice.

A real daemon on loopback with 2 compute threads; the train requests go over raw sockets so the
test can hang up on them. The thresholds are generous (not a benchmark): a daemon whose trains held every compute thread
would keep the inference waiting for the trains' whole duration (minutes), and trains that ignored
the hang-up would run to their end.
"""

from __future__ import annotations

import select
import socket
import time

import httpx
import numpy as np
import orjson

from conftest import DaemonProcess
from test_server_api import SMALL_SPEC

STEPS = 100_000  # the most one request may ask; at 1024 rows this is minutes of work
TRAINS = 4  # more than the compute threads


def send_train(port: int, body: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v2/models/a/train HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def answered(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def step_of(client: httpx.Client, model: str) -> int:
    r = client.get(f"/v2/models/{model}")
    assert r.status_code == 200, r.text
    return r.json()["step"]


def test_long_trains_leave_inference_its_threads_and_stop_when_the_client_goes(tmp_path):
    daemon = DaemonProcess(tmp_path / "store", "--compute-threads", "2", "--forward-threads", "1",
                           "--no-demo").start()
    socks: list[socket.socket] = []
    try:
        with httpx.Client(base_url=daemon.url, timeout=30.0) as client:
            for name in ("a", "b"):
                assert client.put(f"/v2/models/{name}", json={"spec": SMALL_SPEC}).status_code == 201
            rng = np.random.default_rng()
            x = rng.uniform(-1, 1, (1024, 5)).astype(np.float32)
            y = rng.uniform(-1, 1, (1024, 4)).astype(np.float32)
            body = orjson.dumps({"inputs": [
                {"name": "INPUT", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()},
                {"name": "TARGET", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}],
                "parameters": {"steps": STEPS}})
            socks = [send_train(daemon.port, body) for _ in range(TRAINS)]
            deadline = time.monotonic() + 30
            while step_of(client, "a") == 0:
                assert time.monotonic() < deadline, "the train requests never started"
                time.sleep(0.05)

            # inference on another model answers while every train request is still running
            xb = rng.uniform(-1, 1, (4, 5)).astype(np.float32)
            started = time.monotonic()
            r = client.post("/v2/models/b/infer", timeout=20.0, json={"inputs": [
                {"name": "INPUT", "datatype": "FP32", "shape": [4, 5], "data": xb.ravel().tolist()}]})
            waited = time.monotonic() - started
            assert r.status_code == 200, r.text
            assert waited < 10.0, f"inference on b waited {waited:.1f} s behind the trains on a"
            assert not any(answered(s) for s in socks), "a train request ended before the inference answered"

            # the clients go away: the trains stop at their next slice instead of running to the end
            for s in socks:
                s.close()
            socks = []
            hung_up = step_of(client, "a")
            deadline = time.monotonic() + 30
            last = -1
            while (now := step_of(client, "a")) != last:
                assert time.monotonic() < deadline, f"training went on after the clients left: step {now}"
                last = now
                time.sleep(1.0)
            assert last < STEPS, last  # each request asked for STEPS; none ran them all
            print(f"\ninference waited {waited:.2f} s; steps at hang-up {hung_up}, when stopped {last} "
                  f"(of {TRAINS} x {STEPS} asked)")
            # the daemon still trains and serves afterwards
            assert client.post("/v2/models/b/infer", json={"inputs": [
                {"name": "INPUT", "datatype": "FP32", "shape": [4, 5], "data": xb.ravel().tolist()}]}).status_code == 200
    finally:
        for s in socks:
            s.close()
        daemon.kill()
