#!/usr/bin/env python3
"""Attacks on a daemon without an API key, from a web page or a client on the same host, each
with bounded counts and a one-line summary (docs/reliability.md, "Cross-site requests, slow
clients and large headers").

Each subcommand starts its own daemon (``mmad serve`` on 127.0.0.1, cpu backend, default
settings unless ``--daemon-args`` adds some, a fresh store) and stops it after, or attacks
``--url`` (then the daemon's RSS is read only with ``--pid``):

- ``cross-site``: the forged requests a page of another site can send without a preflight
  (``Origin: https://evil.example``, ``Content-Type: text/plain``): train, checkpoint, weight
  upload, unload, shared-memory registration, model creation and deletion, dataset upload,
  infer; then each again without the Origin (text/plain alone); the stored versions, before and
  after;
- ``slow-body``: ``--connections`` connections (default 2,100: past the 2,048 cap) send a complete
  request head, then one body byte every ``--interval-s`` (2 s) for ``--duration-s`` (40 s);
  meanwhile a health probe and an infer on fresh connections every second;
- ``held-bodies``: ``--connections`` (24) infer bodies of ``--body-bytes`` (the 64 MiB cap) less one
  byte, then nothing; the daemon's RSS and what each connection got;
- ``header-bomb``: a weight upload whose safetensors header lists ``--entries`` (200,000) tensors,
  with health probes during it and the RSS before and after;
- ``gzip-bomb``: ``--rounds`` (50) infer bodies of zeros gzipped, inflating past the body cap,
  ``--concurrency`` (8) at a time; RSS before and after;
- ``versions-rss`` (a measurement, not an attack): the RSS growth of phases of infers only and of
  new versions only (weight uploads), to see what a soak's growth follows.

Exit status 1 when an attack got what it wanted (a write, a lock-out, memory kept).
Usage: ``python scripts/attack.py cross-site`` (``--help`` on each subcommand).
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import socket
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fault_injection import Daemon  # noqa: E402  (the shared loopback daemon launcher)

EVIL = "https://evil.example"
MIB = 1024 * 1024
SPEC = {"n_input_dims": 5, "n_output_dims": 4, "network": {"n_neurons": 32, "n_hidden_layers": 2},
        "precision": "fp16", "seed": 7}
INFER = orjson.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 5], "data": [0.1] * 5}]})


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def status_of(data: bytes) -> str:
    """The status code of a raw response, or what the connection saw instead."""
    return data[9:12].decode() if data.startswith(b"HTTP/1.1 ") else ("closed" if not data else "garbage")


def statuses(counter: Counter) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(counter.items())) or "none"


class Target:
    """The daemon attacked: started here (and stopped after) or reached at ``--url``."""

    def __init__(self, args):
        self.daemon = None
        if args.url:
            self.url, self.pid = args.url.rstrip("/"), args.pid
        else:
            self.store = Path(tempfile.mkdtemp(prefix="mmad-attack-"))
            self.daemon = Daemon(self.store / "store", *args.daemon_args.split(), log_path=self.store / "daemon.log")
            self.daemon.start(120)
            self.url, self.pid = self.daemon.url, self.daemon.pid
        host, _, port = self.url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port or 80)
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        r = self.http.put("/v2/models/victim", json={"spec": SPEC})
        if r.status_code not in (200, 201):
            raise SystemExit(f"could not create the model 'victim': {r.status_code} {r.text}")

    def close(self) -> None:
        self.http.close()
        if self.daemon is not None:
            self.daemon.stop()

    def connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port), timeout=10)

    def probe(self, path: str = "/v2/health/ready", body: bytes | None = None) -> tuple[str, float]:
        """One request on a fresh connection: (its status, seconds)."""
        t0 = time.monotonic()
        try:
            with self.connect() as s:
                method = "GET" if body is None else "POST"
                extra = b"" if body is None else (b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body))
                s.sendall(f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n".encode() + extra + b"\r\n"
                          + (body or b""))
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            return status_of(data), time.monotonic() - t0
        except OSError as exc:
            return type(exc).__name__, time.monotonic() - t0


def cross_site(target: Target, args) -> bool:
    http = target.http
    before = (http.get("/v2/models/victim/versions").json(), http.get("/v2/models/victim/weights").content)
    train = orjson.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 5], "data": [1e3] * 5},
                                     {"name": "TARGET", "datatype": "FP32", "shape": [1, 4], "data": [1e3] * 4}],
                          "parameters": {"steps": 5}})
    forged = [("POST", "/v2/models/victim/train", train), ("POST", "/v2/models/victim/versions", b""),
              ("PUT", "/v2/models/victim/weights", b"poison"), ("POST", "/v2/repository/models/victim/unload", b"{}"),
              ("POST", "/v2/systemsharedmemory/region/r/register", b'{"key": "/k", "byte_size": 64}'),
              ("PUT", "/v2/models/planted", orjson.dumps({"spec": SPEC})), ("POST", "/v2/models/victim/datasets", b"x"),
              ("POST", "/v2/models/victim/infer", INFER), ("DELETE", "/v2/models/victim", b"")]
    with_origin, plain = Counter(), Counter()
    for method, path, body in forged:
        with_origin[http.request(method, path, content=body, headers={"Origin": EVIL, "Content-Type": "text/plain"}
                                 ).status_code] += 1
    for method, path, body in forged[:-1]:  # the DELETE takes no body
        plain[http.request(method, path, content=body or b"{}", headers={"Content-Type": "text/plain"}).status_code] += 1
    after = (http.get("/v2/models/victim/versions").json(), http.get("/v2/models/victim/weights").content)
    own = http.post("/v2/repository/index", json={}, headers={"Origin": target.url}).status_code
    unchanged = before == after and http.get("/v2/models/planted").status_code == 404
    ok = unchanged and set(with_origin) == {403} and set(plain) == {415} and own == 200
    print(f"cross-site: {len(forged)} forged requests from {EVIL}: {statuses(with_origin)}; {sum(plain.values())} "
          f"text/plain bodies without Origin: {statuses(plain)}; the daemon's own page: {own}; versions and weights "
          f"{'unchanged' if unchanged else 'CHANGED'}: {'PASS' if ok else 'FAIL'}")
    return ok


def raise_open_files(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))


def open_bodies(target: Target, count: int, length: int, path: str) -> tuple[list[socket.socket], Counter]:
    """``count`` connections, each with a complete head of a ``length``-byte body on ``path``."""
    socks, failed = [], Counter()
    head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: 64\r\nContent-Length: {length}\r\n\r\n").encode()
    for _ in range(count):
        try:
            s = target.connect()
            s.sendall(head)
            s.setblocking(False)
            socks.append(s)
        except OSError as exc:
            failed[type(exc).__name__] += 1
    return socks, failed


def collect(socks: list[socket.socket], answers: dict[int, bytes]) -> None:
    """Read what the daemon sent on each open connection (non-blocking), closing the ones it closed."""
    for s in socks:
        if s.fileno() < 0 or s.fileno() in answers:
            continue
        try:
            data = s.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        answers[s.fileno()] = data
        s.close()


def slow_body(target: Target, args) -> bool:
    raise_open_files(args.connections + 256)
    socks, failed = open_bodies(target, args.connections, 1 * MIB, "/v2/models/victim/infer")
    answers: dict[int, bytes] = {}
    probes, infers, cut_at = Counter(), [], []
    t0 = time.monotonic()
    stop = threading.Event()

    def probe_loop() -> None:
        while not stop.is_set():
            probes[target.probe()[0]] += 1
            infers.append((time.monotonic() - t0, target.probe("/v2/models/victim/infer", INFER)[0]))
            stop.wait(1.0)

    prober = threading.Thread(target=probe_loop)
    prober.start()
    try:
        while time.monotonic() - t0 < args.duration_s:
            for s in socks:
                if s.fileno() >= 0 and s.fileno() not in answers:
                    try:
                        s.send(b"\0")
                    except OSError:
                        pass
            before = len(answers)
            collect(socks, answers)
            cut_at += [time.monotonic() - t0] * (len(answers) - before)
            time.sleep(args.interval_s)
    finally:
        stop.set()
        prober.join()
    collect(socks, answers)
    held = sum(1 for s in socks if s.fileno() >= 0)
    for s in socks:
        s.close()
    got = Counter(status_of(d) for d in answers.values())
    last = max(cut_at, default=args.duration_s)
    during = Counter(status for t, status in infers if t <= last)
    after = Counter(status for t, status in infers if t > last + 1)
    ok = held == 0 and set(probes) == {"200"} and set(after) == {"200"}
    print(f"slow-body: {len(socks)} connections dripping 1 byte every {args.interval_s:g} s ({statuses(failed)} "
          f"failed to connect): {statuses(got)}, the last cut at {last:.0f} s, {held} still open after "
          f"{args.duration_s:g} s; health probes meanwhile: {statuses(probes)}; infers until the last cut: "
          f"{statuses(during)}, after: {statuses(after)}: {'PASS' if ok else 'FAIL'}")
    return ok


def held_bodies(target: Target, args) -> bool:
    raise_open_files(args.connections + 256)
    rss0 = rss_mib(target.pid)
    socks, failed = open_bodies(target, args.connections, args.body_bytes, "/v2/models/victim/infer")
    answers: dict[int, bytes] = {}
    chunk = b"\0" * MIB
    for s in socks:  # all but the last byte, as fast as the daemon takes it
        s.setblocking(True)
        s.settimeout(30)
        try:
            left = args.body_bytes - 1
            while left:
                left -= s.send(chunk[:min(left, MIB)])
        except OSError:
            pass  # answered (503) and closed before the body was sent
        s.setblocking(False)
    collect(socks, answers)
    early = Counter(status_of(d) for d in answers.values())
    rss_held = rss_mib(target.pid)
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.wait_s and any(s.fileno() >= 0 for s in socks):
        collect(socks, answers)
        time.sleep(0.2)
    held = sum(1 for s in socks if s.fileno() >= 0)
    for s in socks:
        s.close()
    time.sleep(1.0)
    rss1 = rss_mib(target.pid)
    got = Counter(status_of(d) for d in answers.values())
    health = target.probe()[0]
    memory = "" if rss0 is None else (f"; RSS {rss0:.0f} MiB before, {rss_held:.0f} MiB with the bodies held, "
                                      f"{rss1:.0f} MiB after")
    ok = held == 0 and health == "200"
    print(f"held-bodies: {len(socks)} bodies of {args.body_bytes} bytes less one ({statuses(failed)} failed to "
          f"connect): {statuses(early)} at once, {statuses(got)} in all, {held} still open after {args.wait_s:g} s"
          f"{memory}; health {health}: {'PASS' if ok else 'FAIL'}")
    return ok


def bomb_header(entries: int) -> bytes:
    """A safetensors file whose header lists ``entries`` empty float32 tensors."""
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(entries)}
    raw = orjson.dumps(header)
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def header_bomb(target: Target, args) -> bool:
    body = bomb_header(args.entries)
    rss0 = rss_mib(target.pid)
    result: dict[str, object] = {}

    def upload() -> None:
        t0 = time.monotonic()
        r = target.http.put("/v2/models/victim/weights", content=body, headers={"Content-Type": "application/octet-stream"})
        result.update(status=r.status_code, seconds=time.monotonic() - t0, error=r.json().get("error", ""))

    thread = threading.Thread(target=upload)
    thread.start()
    slowest = 0.0
    while thread.is_alive():
        status, seconds = target.probe()
        slowest = max(slowest, seconds)
        time.sleep(0.05)
    thread.join()
    time.sleep(0.5)
    rss1 = rss_mib(target.pid)
    memory = "" if rss0 is None else f"; RSS {rss0:.0f} -> {rss1:.0f} MiB"
    ok = result["status"] == 400 and slowest < 1.0 and (rss0 is None or rss1 - rss0 < 50)
    print(f"header-bomb: a {len(body) / MIB:.1f} MiB header of {args.entries} entries: {result['status']} in "
          f"{result['seconds']:.2f} s ({str(result['error'])[:90]}); slowest health probe meanwhile "
          f"{slowest * 1000:.0f} ms{memory}: {'PASS' if ok else 'FAIL'}")
    return ok


def gzip_bomb(target: Target, args) -> bool:
    limit = args.inflated_bytes
    bomb = gzip.compress(b"\0" * limit, compresslevel=9)
    rss0 = rss_mib(target.pid)
    got, peak = Counter(), rss0 or 0.0

    def send(_) -> int:
        with httpx.Client(base_url=target.url, timeout=60.0) as http:
            return http.post("/v2/models/victim/infer", content=bomb, headers={"Content-Encoding": "gzip"}).status_code

    with ThreadPoolExecutor(args.concurrency) as pool:
        for status in pool.map(send, range(args.rounds)):
            got[status] += 1
            peak = max(peak, rss_mib(target.pid) or 0.0)
    time.sleep(1.0)
    rss1 = rss_mib(target.pid)
    x = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    good = target.http.post("/v2/models/victim/infer", content=gzip.compress(orjson.dumps(
        {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [4, 5], "data": x.ravel().tolist()}]})),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}).status_code
    memory = "" if rss0 is None else f"; RSS {rss0:.0f} MiB before, peak {peak:.0f}, {rss1:.0f} after"
    ok = set(got) == {413} and good == 200 and (rss0 is None or rss1 - rss0 < 64)
    print(f"gzip-bomb: {args.rounds} bodies of {len(bomb) / 1024:.0f} KiB inflating to {limit / MIB:.0f} MiB, "
          f"{args.concurrency} at a time: "
          f"{statuses(got)}; a gzipped infer after: {good}{memory}: {'PASS' if ok else 'FAIL'}")
    return ok


def versions_rss(target: Target, args) -> bool:
    """Where the soak's RSS goes: phases of infers only and of new versions only, alternating."""
    http, rng = target.http, np.random.default_rng(0)
    weights = http.get("/v2/models/victim/weights").content

    def infers() -> None:
        for _ in range(args.infers):
            x = rng.standard_normal((int(rng.integers(1, 64)), 5)).astype(np.float32)
            r = http.post("/v2/models/victim/infer", json={"inputs": [{"name": "INPUT", "datatype": "FP32", "shape":
                                                                       list(x.shape), "data": x.ravel().tolist()}]})
            assert r.status_code == 200, r.text

    def versions() -> None:
        for i in range(args.versions):
            r = http.put("/v2/models/victim/weights", content=weights, headers={"Content-Type": "application/octet-stream"})
            assert r.status_code == 200, r.text
            if i % 4 == 0:
                http.get("/metrics")

    infers()
    versions()  # warm-up
    growth = []
    for name, phase in (("infers", infers), ("versions", versions)) * 2:
        before = rss_mib(target.pid)
        phase()
        growth.append(f"{name} {rss_mib(target.pid) - before:+.2f}")
    print(f"versions-rss: RSS growth in MiB over {args.infers} infers / {args.versions} new versions per phase "
          f"({target_args(args) or 'default settings'}): {', '.join(growth)}")
    return True


def target_args(args) -> str:
    return args.daemon_args.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="attack this daemon instead of starting one")
    p.add_argument("--pid", type=int, help="the --url daemon's process id, for its RSS")
    p.add_argument("--daemon-args", default="", help="more `mmad serve` options for the daemon started here")
    sub = p.add_subparsers(dest="attack", required=True)
    sub.add_parser("cross-site", help="forged requests from another site's page")
    s = sub.add_parser("slow-body", help="connections dripping request bodies")
    s.add_argument("--connections", type=int, default=2100)
    s.add_argument("--interval-s", type=float, default=2.0)
    s.add_argument("--duration-s", type=float, default=40.0)
    s = sub.add_parser("held-bodies", help="bodies sent but for their last byte")
    s.add_argument("--connections", type=int, default=24)
    s.add_argument("--body-bytes", type=int, default=64 * MIB)
    s.add_argument("--wait-s", type=float, default=40.0)
    s = sub.add_parser("header-bomb", help="a safetensors upload with a huge header")
    s.add_argument("--entries", type=int, default=200_000)
    s = sub.add_parser("gzip-bomb", help="gzip bodies inflating past the body cap")
    s.add_argument("--rounds", type=int, default=50)
    s.add_argument("--inflated-bytes", type=int, default=128 * MIB)
    s.add_argument("--concurrency", type=int, default=8)
    s = sub.add_parser("versions-rss", help="RSS growth of infers alone and of new versions alone")
    s.add_argument("--infers", type=int, default=3000)
    s.add_argument("--versions", type=int, default=500)
    args = p.parse_args(argv)
    target = Target(args)
    try:
        ok = {"cross-site": cross_site, "slow-body": slow_body, "held-bodies": held_bodies,
              "header-bomb": header_bomb, "gzip-bomb": gzip_bomb, "versions-rss": versions_rss}[args.attack](target, args)
    finally:
        target.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
