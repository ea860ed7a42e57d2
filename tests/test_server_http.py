"""The daemon's HTTP protocol (mmad/server/http_protocol.py): large infer bodies read in place, over raw sockets.

Bodies from ``DIRECT_BODY_MIN`` bytes up skip uvicorn's body handling; the tests split them at
awkward places, pipeline requests behind them, keep the connection alive afterwards, and cut
the connection mid-body, and compare every output with the float64 oracle.
"""

from __future__ import annotations

import socket
import time

import httpx
import numpy as np
import orjson
import pytest
from oracle import rel_err

from mmad.server.http_protocol import DIRECT_BODY_MIN
from test_server_api import SMALL_SPEC, create, oracle

ROWS = 40_000  # 5 inputs a row: 400,000 bytes of FP16 tensor data, over DIRECT_BODY_MIN


def request_bytes(x: np.ndarray, datatype: str = "FP32", extra_headers: str = "") -> bytes:
    blob = x.astype("<f2" if datatype == "FP16" else "<f4").tobytes()
    header = orjson.dumps({
        "inputs": [{"name": "INPUT", "datatype": datatype, "shape": list(x.shape),
                    "parameters": {"binary_data_size": len(blob)}}],
        "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True, "output_datatype": datatype}}]})
    body = header + blob
    head = (f"POST /v2/models/wide/infer HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n{extra_headers}\r\n").encode()
    return head + body


def read_response(sock: socket.socket, pending: bytearray) -> tuple[int, dict[str, str], bytes]:
    """One response from ``sock`` (``pending``: bytes already read past the previous one)."""
    while b"\r\n\r\n" not in pending:
        pending += sock.recv(1 << 16) or b""
    end = pending.index(b"\r\n\r\n")
    lines = bytes(pending[:end]).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    size = int(headers["content-length"])
    del pending[:end + 4]
    while len(pending) < size:
        chunk = sock.recv(1 << 20)
        assert chunk, "the server closed the connection mid-response"
        pending += chunk
    body = bytes(pending[:size])
    del pending[:size]
    return int(lines[0].split()[1]), headers, body


def decoded(status: int, headers: dict[str, str], body: bytes, datatype: str) -> np.ndarray:
    assert status == 200, body[:300]
    n = int(headers["inference-header-content-length"])
    shape = orjson.loads(body[:n])["outputs"][0]["shape"]
    return np.frombuffer(body[n:], "<f2" if datatype == "FP16" else "<f4").reshape(shape)


@pytest.fixture(scope="module")
def wide(daemon):
    with httpx.Client(base_url=daemon.url, timeout=30.0) as client:
        create(client, "wide", SMALL_SPEC)
        yield "wide"
        client.delete("/v2/models/wide")


def connect(daemon) -> socket.socket:
    return socket.create_connection(("127.0.0.1", daemon.port), timeout=30)


@pytest.mark.parametrize("datatype", ["FP32", "FP16"])
def test_large_body_split_anywhere_then_keep_alive_and_pipelining(daemon, http, wide, datatype):
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (ROWS, SMALL_SPEC["n_input_dims"])).astype(np.float32)
    sent_x = x.astype(np.float16).astype(np.float32) if datatype == "FP16" else x
    request = request_bytes(x, datatype)
    assert len(request) > DIRECT_BODY_MIN
    expected = oracle(http, wide, sent_x)
    tolerance = 3e-3 if datatype == "FP16" else 1e-5
    small_x = x[:3]
    small = request_bytes(small_x, datatype)
    with connect(daemon) as sock:
        pending = bytearray()
        # the headers with part of the body, then the rest in uneven pieces
        cut = request.index(b"\r\n\r\n") + 1000
        sock.sendall(request[:cut])
        for start in range(cut, len(request), 70_001):
            time.sleep(0.002)
            sock.sendall(request[start:start + 70_001])
        out = decoded(*read_response(sock, pending), datatype)
        assert rel_err(out, expected) <= tolerance
        # the same connection: a small request (uvicorn's own body path), then a large one with a
        # small one pipelined right behind it in the same write
        sock.sendall(small)
        assert rel_err(decoded(*read_response(sock, pending), datatype), expected[:3]) <= tolerance
        sock.sendall(request + small)
        assert rel_err(decoded(*read_response(sock, pending), datatype), expected) <= tolerance
        assert rel_err(decoded(*read_response(sock, pending), datatype), expected[:3]) <= tolerance


def test_expect_100_continue_and_a_cut_body(daemon, http, wide):
    x = np.random.default_rng(4).uniform(-1, 1, (ROWS, SMALL_SPEC["n_input_dims"])).astype(np.float32)
    request = request_bytes(x, extra_headers="Expect: 100-continue\r\n")
    head, _, body = request.partition(b"\r\n\r\n")
    with connect(daemon) as sock:
        sock.sendall(head + b"\r\n\r\n")
        assert sock.recv(1 << 10).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(body)
        out = decoded(*read_response(sock, bytearray()), "FP32")
    assert rel_err(out, oracle(http, wide, x)) <= 1e-5
    with connect(daemon) as sock:  # the client goes away halfway through a body read in place
        sock.sendall(request_bytes(x)[:len(request) // 2])
    r = http.post("/v2/models/wide/infer", content=orjson.dumps(
        {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 5], "data": [0.5] * 5}]}))
    assert r.status_code == 200 and len(r.json()["outputs"][0]["data"]) == SMALL_SPEC["n_output_dims"]
