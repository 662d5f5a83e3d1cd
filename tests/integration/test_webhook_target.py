"""A webhook attempt, against real receivers on 127.0.0.1: it connects to the address that was
checked, has one deadline and reads a bounded answer, and the test route holds no database
connection while a receiver answers. (Which addresses are refused: ``tests/unit/
test_webhook_target.py``.)"""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

from fastapi.testclient import TestClient

from api.app import create_app
from offpeak import webhook_target
from offpeak.settings import Settings
from storage.db import get_engine


class Receiver:
    """A raw HTTP receiver on 127.0.0.1: ``answer(conn, request)`` writes whatever it likes."""

    def __init__(self, answer: Callable[[socket.socket, bytes], None]) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            self.requests.append(data)
            with suppress(OSError):  # the client may leave mid-answer: what some tests want
                self.answer(conn, data)

    def close(self) -> None:
        self.sock.close()


@contextmanager
def receiver(answer: Callable[[socket.socket, bytes], None]) -> Iterator[Receiver]:
    server = Receiver(answer)
    try:
        yield server
    finally:
        server.close()


def _ok(conn: socket.socket, _request: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")


def _send(url: str, timeout: float = 5.0, **kwargs: object) -> webhook_target.Attempt:
    options = {"allow_http": True, "allow_private": True, **kwargs}
    return webhook_target.send(url, b"{}", {}, timeout=timeout, **options)  # type: ignore[arg-type]


def test_the_attempt_connects_to_the_address_that_was_checked() -> None:
    resolved: list[str] = []

    def resolve(host: str, _port: int) -> list[str]:
        resolved.append(host)
        return ["127.0.0.1"]

    with receiver(_ok) as server:
        # A name nothing else resolves: only the checked address can have been used.
        attempt = _send(f"http://hooks.rebind.invalid:{server.port}/in", resolve=resolve)
    assert attempt.status_code == 200, attempt
    assert resolved == ["hooks.rebind.invalid"]
    request = server.requests[0].lower()
    assert request.startswith(b"post /in http/1.1")
    assert f"host: hooks.rebind.invalid:{server.port}".encode() in request


def test_a_dripping_receiver_cannot_hold_an_attempt_past_its_deadline() -> None:
    def drip(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(b"HTTP/1.1 500 Oops\r\ncontent-length: 100000\r\n\r\n")
        for _ in range(100):
            conn.sendall(b"x")
            time.sleep(0.1)

    with receiver(drip) as server:
        started = time.monotonic()
        attempt = _send(f"http://127.0.0.1:{server.port}/", timeout=1.0)
        took = time.monotonic() - started
    assert attempt.status_code is None and "within 1 s" in (attempt.error or "")
    assert took < 2.0, took


def test_a_huge_error_body_is_read_only_in_part() -> None:
    huge = 64 << 20

    def flood(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(f"HTTP/1.1 500 Oops\r\ncontent-length: {huge}\r\n\r\n".encode())
        piece = b"e" * (1 << 20)
        for _ in range(64):
            conn.sendall(piece)

    with receiver(flood) as server:
        tracemalloc.start()
        try:
            attempt = _send(f"http://127.0.0.1:{server.port}/", timeout=10.0)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert attempt.status_code == 500
    assert attempt.error is not None and len(attempt.error) <= webhook_target.MAX_LOGGED_BODY
    assert peak < 2 << 20, f"peak {peak / (1 << 20):.1f} MiB"


def test_the_test_route_holds_no_database_connection_while_the_receiver_answers(
    settings: Settings, api_key: str
) -> None:
    release = threading.Event()

    def tarpit(conn: socket.socket, _request: bytes) -> None:
        release.wait(20)
        _ok(conn, _request)

    lenient = settings.model_copy(
        update={"webhook_allow_private_targets": True, "webhook_allow_http": True}
    )
    auth = {"Authorization": f"Bearer {api_key}"}
    pool = get_engine(settings.resolved_database_url).pool
    with receiver(tarpit) as server, TestClient(create_app(lenient)) as client:
        endpoint = client.post(
            "/v1/webhook_endpoints",
            json={"url": f"http://127.0.0.1:{server.port}/", "event_types": ["batch.completed"]},
            headers=auth,
        ).json()
        before = pool.checkedout()  # type: ignore[attr-defined]
        answers: list[int] = []
        call = threading.Thread(
            target=lambda: answers.append(
                client.post(
                    f"/v1/webhook_endpoints/{endpoint['id']}/test",
                    json={"event_type": "batch.completed"},
                    headers=auth,
                ).status_code
            )
        )
        call.start()
        deadline = time.monotonic() + 10
        while not server.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.requests, "the test event never reached the receiver"
        during = pool.checkedout()  # type: ignore[attr-defined]
        release.set()
        call.join(30)
    assert answers == [200]
    assert during == before, f"{during - before} connection(s) held across the POST"
