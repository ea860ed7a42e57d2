"""mmad_client's retries against a real HTTP server on loopback that answers from a script: 503 with
Retry-After, dropped connections, then 200. The clients' sleep is replaced by a recorder, so the
waits are asserted exactly and no test waits for real."""

from __future__ import annotations

import asyncio
import http.server
import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from mmad_client import AsyncClient, Client, Retry, Timeout  # noqa: E402
from mmad_client import errors as E  # noqa: E402

SPEC = {"n_input_dims": 1, "n_output_dims": 1,
        "network": {"otype": "FullyFusedMLP", "n_neurons": 16, "n_hidden_layers": 1}}
INFER_ANSWER = {"model_name": "m", "outputs": [{"name": "OUTPUT", "datatype": "FP32", "shape": [1, 1], "data": [7.0]}]}
NO_JITTER = Retry(backoff=0.5, jitter=0.0)
# waits compared exactly: no random part
EXACT = Retry(jitter=0.0)


class Script(http.server.ThreadingHTTPServer):
    """Answers request i with ``actions[i]`` (the last one repeats): ``("status", code, headers)``,
    ``"drop"`` (close the connection without an answer) or ``("slow", seconds)`` then 200.
    Records each request's method, path and body."""

    daemon_threads = True

    def __init__(self, actions: list) -> None:
        self.actions = actions
        self.seen: list[tuple[str, str, bytes]] = []
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up (read timeout)
            super().handle_error(request, client_address)

    def next_action(self, method: str, path: str, body: bytes):
        self.seen.append((method, path, body))
        return self.actions[min(len(self.seen), len(self.actions)) - 1]


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the daemon: a drop breaks a reused connection

    def log_message(self, *args) -> None:
        pass

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        action = self.server.next_action(self.command, self.path, body)
        if action == "drop":
            self.close_connection = True
            return
        if action[0] == "slow":
            time.sleep(action[1])
            action = ("status", 200, {})
        _, code, headers = action
        if code == 200:
            doc = INFER_ANSWER if self.path.endswith("/infer") else {"name": "mmad", "version": "x", "extensions": []}
        else:
            doc = {"error": f"scripted {code}"}
        payload = json.dumps(doc).encode()
        self.send_response(code)
        for key, value in {"Content-Type": "application/json", **headers}.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _answer


@pytest.fixture
def serve():
    servers = []

    def start(*actions):
        server = Script(list(actions))
        # a short poll keeps shutdown() quick
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def client_for(server, retry: Retry | None = EXACT, **options) -> tuple[Client, list[float]]:
    client = Client(server.url, retry=retry, **options)
    sleeps: list[float] = []
    client._sleep = sleeps.append
    return client, sleeps


def unavailable(after: str | None = "2") -> tuple:
    return ("status", 503, {} if after is None else {"Retry-After": after})


OK = ("status", 200, {})


def test_503_with_retry_after_waits_what_the_server_says_then_succeeds(serve):
    server = serve(unavailable("2"), unavailable("1"), OK)
    client, sleeps = client_for(server)
    with client:
        assert client.server_metadata()["name"] == "mmad"
    assert [s[:2] for s in server.seen] == [("GET", "/v2")] * 3
    assert sleeps == [2.0, 1.0]


def test_infer_is_sent_again_whole_after_a_503_and_a_dropped_connection(serve):
    server = serve(unavailable("1"), "drop", OK)
    client, sleeps = client_for(server, NO_JITTER)
    x = np.arange(3, dtype=np.float32).reshape(3, 1)
    with client:
        out = client.infer("m", x)
    np.testing.assert_array_equal(out, [[7.0]])
    methods, paths, bodies = zip(*server.seen)
    assert methods == ("POST",) * 3 and set(paths) == {"/v2/models/m/infer"}
    assert len(set(bodies)) == 1 and len(bodies[0]) > x.nbytes  # the same binary request each time
    # Retry-After for the 503; after the drop, the backoff of the second retry: 0.5 * 2
    assert sleeps == [1.0, 1.0]


def test_dropped_connections_back_off_exponentially_until_attempts_run_out(serve):
    server = serve("drop")
    client, sleeps = client_for(server, Retry(attempts=4, backoff=0.5, jitter=0.0))
    with client, pytest.raises(E.TransportError) as info:
        client.model_metadata("m")
    assert len(server.seen) == 4
    assert sleeps == [0.5, 1.0, 2.0]
    assert "RemoteProtocolError" in str(info.value)


def test_connection_refused_is_retried_with_jitter_within_max_wait():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    retry = Retry(attempts=6, backoff=0.1, jitter=0.05, max_wait=0.5)
    client = Client(f"http://127.0.0.1:{port}", retry=retry)
    sleeps: list[float] = []
    client._sleep = sleeps.append
    with client, pytest.raises(E.TransportError, match="ConnectError"):
        client.health_live()
    assert len(sleeps) == 5
    for n, wait in enumerate(sleeps):
        low = 0.1 * 2 ** n
        assert min(low, 0.5) <= wait <= min(low + 0.05, 0.5), (n, sleeps)
    assert sleeps[-1] == 0.5  # 1.6 s of backoff is capped at max_wait


def test_503_after_the_last_attempt_is_raised_with_its_retry_after(serve):
    server = serve(unavailable("1"))
    client, sleeps = client_for(server, Retry(attempts=3, jitter=0.0))
    with client, pytest.raises(E.ServiceUnavailable) as info:
        client.infer("m", np.ones((1, 1), np.float32))
    assert len(server.seen) == 3 and sleeps == [1.0, 1.0]
    assert info.value.retry_after == 1.0


def test_jitter_is_added_to_retry_after_never_taken_from_it(serve):
    server = serve(*[unavailable("2")] * 7, OK)
    client, sleeps = client_for(server, Retry(attempts=8, jitter=0.5, max_wait=2.5))
    with client:
        client.server_metadata()
    assert len(sleeps) == 7 and all(2.0 <= s <= 2.5 for s in sleeps), sleeps
    assert len(set(sleeps)) > 1  # drawn, not a constant (no cap in reach: equal draws have probability 0)
    # max_wait cuts the jitter, never the wait the server asked for
    server = serve(*[unavailable("2")] * 7, OK)
    client, sleeps = client_for(server, Retry(attempts=8, jitter=0.5, max_wait=2.1))
    with client:
        client.server_metadata()
    assert len(sleeps) == 7 and all(2.0 <= s <= 2.1 for s in sleeps), sleeps


def test_a_retry_after_longer_than_max_wait_is_raised_at_once(serve):
    server = serve(unavailable("30"), OK)
    client, sleeps = client_for(server, Retry(max_wait=10))
    with client, pytest.raises(E.ServiceUnavailable) as info:
        client.server_metadata()
    assert len(server.seen) == 1 and sleeps == []
    assert info.value.retry_after == 30.0


def test_503_without_retry_after_backs_off(serve):
    server = serve(unavailable(None), unavailable(None), OK)
    client, sleeps = client_for(server, NO_JITTER)
    with client:
        client.server_metadata()
    assert sleeps == [0.5, 1.0]


@pytest.mark.parametrize("code", [400, 404, 500])
def test_other_statuses_are_not_retried(serve, code):
    server = serve(("status", code, {}), OK)
    client, sleeps = client_for(server)
    with client, pytest.raises(E.HTTPStatusError):
        client.server_metadata()
    assert len(server.seen) == 1 and sleeps == []


def test_statuses_are_configurable(serve):
    server = serve(("status", 429, {"Retry-After": "3"}), OK)
    client, sleeps = client_for(server, Retry(statuses={429, 503}, jitter=0.0))
    with client:
        client.server_metadata()
    assert len(server.seen) == 2 and sleeps == [3.0]


def test_a_read_timeout_is_not_retried(serve):
    # the request may still be running on the server: another try would double the caller's wait
    server = serve(("slow", 1.0))
    client, sleeps = client_for(server, timeout=Timeout(0.2))
    with client, pytest.raises(E.TimeoutError):
        client.server_metadata()
    assert len(server.seen) == 1 and sleeps == []


def test_calls_that_change_the_server_are_sent_once_unless_asked(serve):
    server = serve(unavailable("1"), OK)
    client, sleeps = client_for(server)
    with client:
        with pytest.raises(E.ServiceUnavailable):
            client.create_model("m", SPEC)
        assert len(server.seen) == 1
        server.seen.clear()
        server.actions = ["drop"]
        with pytest.raises(E.TransportError):
            client.start_job("m", "d", steps=10, batch_size=4)
        with pytest.raises(E.TransportError):
            client.checkpoint("m")
    assert [s[:2] for s in server.seen] == [("POST", "/v2/models/m/jobs"), ("POST", "/v2/models/m/versions")]
    assert sleeps == []

    server.seen.clear()
    server.actions = [unavailable("1"), OK]
    client, sleeps = client_for(server, Retry(non_idempotent=True, jitter=0.0))
    with client:
        client.create_model("m", SPEC)
    assert [s[:2] for s in server.seen] == [("PUT", "/v2/models/m")] * 2 and sleeps == [1.0]


def test_readiness_503_is_an_answer_not_retried(serve):
    server = serve(unavailable("1"), OK)
    client, sleeps = client_for(server)
    with client:
        assert client.health_ready() is False
    assert len(server.seen) == 1 and sleeps == []


def test_retry_none_and_one_attempt_send_once(serve):
    for retry in (None, Retry(attempts=1)):
        server = serve(unavailable("1"), OK)
        client, sleeps = client_for(server, retry)
        with client, pytest.raises(E.ServiceUnavailable):
            client.server_metadata()
        assert len(server.seen) == 1 and sleeps == []


def test_async_client_retries_the_same_way(serve):
    server = serve(unavailable("2"), "drop", OK)
    sleeps: list[float] = []

    async def record(seconds: float) -> None:
        sleeps.append(seconds)

    async def main():
        async with AsyncClient(server.url, retry=NO_JITTER) as client:
            client._sleep = record
            return await client.infer("m", np.ones((1, 1), np.float32))

    np.testing.assert_array_equal(asyncio.run(main()), [[7.0]])
    assert len(server.seen) == 3 and sleeps == [2.0, 1.0]


def test_each_retry_is_logged_with_the_call_and_the_wait(serve, caplog):
    server = serve(unavailable("1"), OK)
    client, _ = client_for(server)
    with client, caplog.at_level(logging.INFO, logger="mmad_client"):
        client.server_metadata()
    assert any(r.getMessage().startswith("GET /v2: 503") and "try 2 of 4 in 1.00 s" in r.getMessage()
               for r in caplog.records), caplog.text


@pytest.mark.parametrize("kwargs, match", [
    ({"attempts": 0}, "attempts"), ({"attempts": 2.5}, "attempts"), ({"backoff": -1}, "backoff"),
    ({"max_wait": float("nan")}, "max_wait"), ({"statuses": {200}}, "statuses"),
])
def test_retry_settings_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Retry(**kwargs)
    with pytest.raises(TypeError, match="Retry"):
        Client("http://127.0.0.1:1", retry=3)
