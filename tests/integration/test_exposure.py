"""Attacks on the API from outside, without a key: a real ``offpeak serve`` process is sent
large bodies on every method, deeply nested JSON, oversized and unfinished headers, stalled
bodies and more connections than it takes; it answers within its bounds, its memory stays
bounded and another client's polls are answered meanwhile. The wrong-key throttle runs on an
in-process app of its own."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from offpeak.settings import Settings
from tests.support.database import new_key
from tests.support.servers import free_port

MIB = 1 << 20
#: What an anonymous attack may add to the API's resident memory.
RSS_BOUND = 16 * MIB
ATTACK_BYTES = 64 * MIB
#: The listener's bounds for this module's server (``api/server.py``), short to keep tests quick.
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 2.0
#: Above the slow clients' connections below, so a normal client is served beside them.
MAX_CONCURRENCY = 300
LIMITS = {
    "OFFPEAK_API_HEADER_TIMEOUT_SECONDS": str(HEADER_TIMEOUT),
    "OFFPEAK_API_BODY_TIMEOUT_SECONDS": str(BODY_TIMEOUT),
    "OFFPEAK_API_MAX_CONCURRENCY": str(MAX_CONCURRENCY),
}


@pytest.fixture(scope="module")
def api(base_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``offpeak serve`` in a process of its own; yields its base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("gate") / "api.log"
    env = {**os.environ, **base_env, **LIMITS, "OFFPEAK_API_PORT": str(port)}
    cli = Path(sys.executable).with_name("offpeak")
    with log.open("wb") as out:
        proc = subprocess.Popen([str(cli), "serve"], env=env, stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code < 500:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail(f"the API did not start: {log.read_text()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _api_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
            return int(conn.pid)
    raise AssertionError("no process listens on the API's port")


def _rss(pid: int) -> int:
    return int(psutil.Process(pid).memory_info().rss)


def _send_anonymous(url: str, method: str, path: str, headers: dict[str, str]) -> bytes:
    """Send ``ATTACK_BYTES`` of body with no key, as fast as the server takes them, and return
    what the server answered (the status line and headers at least)."""
    port = int(url.rsplit(":", 1)[1])
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {ATTACK_BYTES}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode())
        chunk = b'"\\u0041bc",' * (MIB // 10)
        sent = 0
        try:
            while sent < ATTACK_BYTES:
                sock.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed: what the gate is for
        sock.settimeout(10)
        try:
            while b"\r\n\r\n" not in answer:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
        except OSError:
            pass
    return answer


class _Poller(threading.Thread):
    """Another tenant polling ``/v1/batches`` while an attack runs; keeps its latencies."""

    def __init__(self, url: str, key: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.latencies: list[float] = []
        self.statuses: set[int] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            while not self.stop.is_set():
                start = time.monotonic()
                response = client.get(
                    "/v1/batches", headers={"Authorization": f"Bearer {self.key}"}
                )
                self.latencies.append(time.monotonic() - start)
                self.statuses.add(response.status_code)
                time.sleep(0.02)


@pytest.mark.parametrize(
    ("method", "path", "headers", "surface"),
    [
        ("DELETE", "/v1/files/file-x", {}, "openai"),
        ("POST", "/v1/messages/batches", {"Content-Type": "application/json"}, "anthropic"),
        ("POST", "/v1/files", {"Content-Type": "multipart/form-data; boundary=b"}, "openai"),
        ("POST", "/v1/batches", {"Content-Type": "application/json"}, "openai"),
    ],
)
def test_an_anonymous_body_is_refused_from_the_headers_and_costs_no_memory(
    api: str, settings: Settings, method: str, path: str, headers: dict[str, str], surface: str
) -> None:
    pid = _api_pid(api)
    poller = _Poller(api, new_key(settings))
    poller.start()
    time.sleep(0.5)
    before = _rss(pid)
    answer = _send_anonymous(api, method, path, headers)
    grown = _rss(pid) - before
    poller.stop.set()
    poller.join(timeout=30)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:300]
    assert grown < RSS_BOUND, f"the API grew by {grown / MIB:.0f} MiB"
    assert poller.statuses == {200}
    assert len(poller.latencies) >= 5
    # Another client's poll never waited behind the attack's body.
    assert max(poller.latencies) < 2.0, max(poller.latencies)


def test_a_body_on_any_method_is_bounded_with_a_key(api: str, settings: Settings) -> None:
    key = new_key(settings)
    response = httpx.request(
        "DELETE",
        f"{api}/v1/files/file-x",
        headers={"Authorization": f"Bearer {key}"},
        content=b" " * (2 * MIB),
        timeout=30,
    )
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


def _nested(depth: int) -> bytes:
    return b'{"metadata": ' + b"[" * depth + b'"\\u0041"' + b"]" * depth + b"}"


def test_deeply_nested_json_is_a_400_in_the_contracts_shape(http: TestClient, api_key: str) -> None:
    response = http.post(
        "/v1/batches",
        content=_nested(5000),
        headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_value" and "nested too deeply" in error["message"]
    response = http.post(
        "/v1/messages/batches",
        content=_nested(5000),
        headers={"x-api-key": api_key, "Content-Type": "application/json"},
    )
    assert response.status_code == 400
    assert response.json()["type"] == "error"


def test_deeply_nested_json_without_a_key_is_a_401(http: TestClient) -> None:
    response = http.post(
        "/v1/batches", content=_nested(5000), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"


def test_repeated_wrong_keys_are_throttled_per_address(settings: Settings) -> None:
    strict = settings.model_copy(
        update={"auth_failures_allowed": 3, "auth_failure_window_seconds": 60.0}
    )
    good = new_key(settings)
    app = create_app(strict)
    with (
        TestClient(app, client=("203.0.113.7", 4000)) as guesser,
        TestClient(app, client=("203.0.113.8", 4000)) as other,
    ):
        for _ in range(3):
            wrong = guesser.get("/v1/batches", headers={"Authorization": "Bearer sk-offpeak-no"})
            assert wrong.status_code == 401
        throttled = guesser.get("/v1/batches", headers={"Authorization": "Bearer sk-offpeak-no"})
        assert throttled.status_code == 429
        assert 0 < int(throttled.headers["retry-after"]) <= 60
        assert throttled.json()["error"]["code"] == "rate_limit_exceeded"
        anthropic = guesser.get("/v1/messages/batches", headers={"x-api-key": "sk-offpeak-no"})
        assert anthropic.status_code == 429 and anthropic.json()["error"]["type"] == (
            "rate_limit_error"
        )
        # Another address is not affected, and a key found a moment ago still passes.
        assert (
            other.get("/v1/batches", headers={"Authorization": f"Bearer {good}"}).status_code == 200
        )
        assert (
            guesser.get("/v1/batches", headers={"Authorization": f"Bearer {good}"}).status_code
            == 200
        )


def test_the_admin_api_checks_its_key_before_the_body(http: TestClient) -> None:
    response = http.post("/v1/admin/scheduler/pause", content=_nested(5000))
    assert response.status_code == 401
    assert "admin" in response.json()["error"]["message"]


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed ``sock`` within ``seconds``, and what it wrote before."""
    sock.settimeout(0.2)
    answer = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return True, answer
        if not data:
            return True, answer
        answer += data
    return False, answer


def test_oversized_headers_are_a_431_and_cost_no_memory(api: str) -> None:
    pid = _api_pid(api)
    before = _rss(pid)
    with socket.create_connection(("127.0.0.1", _port(api)), timeout=10) as sock:
        sock.sendall(b"GET /v1/batches HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(8 * 64):  # 8 MiB of one header's value, in 16 KiB pieces
                sock.sendall(b"X-Big: " + b"a" * (16 * 1024) + b"\r\n")
        except OSError:
            pass  # refused and closed mid-send
        closed, answer = _closed_within(sock, 5)
    assert closed and answer.startswith(b"HTTP/1.1 431"), answer[:200]
    assert _rss(pid) - before < RSS_BOUND


def test_unfinished_headers_are_closed_at_their_deadline_while_others_are_served(
    api: str, settings: Settings
) -> None:
    socks = [socket.create_connection(("127.0.0.1", _port(api)), timeout=10) for _ in range(30)]
    try:
        for sock in socks:
            sock.sendall(b"GET /v1/batches HTTP/1.1\r\nHost: x\r\nX-Slow: a")
        key = new_key(settings)
        poll = httpx.get(f"{api}/v1/batches", headers={"Authorization": f"Bearer {key}"})
        assert poll.status_code == 200
        for sock in socks:
            closed, answer = _closed_within(sock, HEADER_TIMEOUT + 5)
            assert closed and answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        for sock in socks:
            sock.close()


FLOODS = 8
FLOOD_BYTES = 32 * MIB
#: The longest the floods go on while a normal client waits for its answers.
FLOODS_CAP = 60.0
SLOW_CLIENTS = 200


class _RssPeak(threading.Thread):
    """The API process's largest resident set (``/proc/PID/status`` VmRSS) while it runs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.path = Path(f"/proc/{pid}/status")
        self.peak = self.before = self._read()
        self.stop = threading.Event()

    def _read(self) -> int:
        for line in self.path.read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, self._read())


class _HealthPoller(threading.Thread):
    """A normal client asking ``/healthz`` on new connections while an attack runs."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.latencies: list[float] = []
        self.statuses: set[int | str] = set()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                self.statuses.add(httpx.get(f"{self.url}/healthz", timeout=10).status_code)
            except httpx.HTTPError as exc:
                self.statuses.add(type(exc).__name__)
            self.latencies.append(time.monotonic() - start)
            self.stop.wait(0.05)


def _flood(port: int) -> tuple[int, float, bool, bytes]:
    """One header line that never ends, sent until ``FLOOD_BYTES`` or the server stops it:
    the bytes sent, the seconds until the server closed, whether it did, what it answered."""
    start = time.monotonic()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Flood: ")
        piece = b"a" * (64 * 1024)
        try:
            while sent < FLOOD_BYTES:
                sock.sendall(piece)
                sent += len(piece)
        except OSError:
            pass  # refused and closed mid-send
        closed, answer = _closed_within(sock, HEADER_TIMEOUT + 10)
    return sent, time.monotonic() - start, closed, answer


class _Floods:
    """``FLOODS`` attackers, each flooding on a new connection as soon as one is closed, for
    ``seconds`` and then until ``enough()`` holds (at most ``FLOODS_CAP`` seconds in all);
    ``results`` holds every connection's ``_flood`` answer."""

    def __init__(
        self, port: int, seconds: float, enough: Callable[[], bool] = lambda: True
    ) -> None:
        start = time.monotonic()
        self.port, self.enough = port, enough
        self.earliest, self.latest = start + seconds, start + FLOODS_CAP
        self.results: list[tuple[int, float, bool, bytes]] = []
        self.threads = [threading.Thread(target=self._attack, daemon=True) for _ in range(FLOODS)]

    def _running(self) -> bool:
        now = time.monotonic()
        return now < self.earliest or (now < self.latest and not self.enough())

    def _attack(self) -> None:
        while self._running():
            self.results.append(_flood(self.port))

    def __enter__(self) -> _Floods:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        for thread in self.threads:
            thread.join(timeout=120)


def test_never_ending_header_floods_are_refused_and_cost_no_memory(api: str) -> None:
    rss = _RssPeak(_api_pid(api))
    health = _HealthPoller(api)
    rss.start()
    health.start()
    # The floods last until the client has been answered often enough to judge its latency,
    # however slow the host is, and no longer.
    with _Floods(_port(api), seconds=3.0, enough=lambda: len(health.latencies) >= 5) as floods:
        pass
    health.stop.set()
    rss.stop.set()
    health.join(timeout=30)
    rss.join(timeout=5)
    assert len(floods.results) >= FLOODS
    for sent, seconds, closed, answer in floods.results:
        assert closed, f"a flood was still open after {sent / MIB:.0f} MiB"
        # Stopped for its size, long before the header deadline would have.
        assert seconds < HEADER_TIMEOUT, f"closed after {seconds:.1f} s, {sent / MIB:.0f} MiB"
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:200]
    grown = rss.peak - rss.before
    assert grown < RSS_BOUND, f"the API grew by {grown / MIB:.0f} MiB under the floods"
    assert health.statuses == {200}, health.statuses
    assert len(health.latencies) >= 5
    assert max(health.latencies) < 2.0, max(health.latencies)


def test_slow_clients_are_cut_at_the_header_deadline_while_floods_run(api: str) -> None:
    """Slowloris (connections that keep their headers open by sending a byte now and then)
    beside the floods above: every slow one is cut at its deadline and a normal client is
    served meanwhile."""
    socks = []
    for _ in range(SLOW_CLIENTS):
        sock = socket.create_connection(("127.0.0.1", _port(api)), timeout=10)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        sock.setblocking(False)
        socks.append(sock)
    opened = time.monotonic()
    health = _HealthPoller(api)
    health.start()
    open_ = set(range(SLOW_CLIENTS))
    try:
        with _Floods(_port(api), seconds=HEADER_TIMEOUT + 2):
            while open_ and time.monotonic() - opened < HEADER_TIMEOUT + 20:
                for i in list(open_):
                    try:
                        socks[i].send(b"a")
                        if socks[i].recv(65536) == b"":
                            open_.discard(i)
                    except BlockingIOError:
                        pass
                    except OSError:
                        open_.discard(i)
                time.sleep(0.5)
            cut_after = time.monotonic() - opened
    finally:
        health.stop.set()
        health.join(timeout=30)
        for sock in socks:
            sock.close()
    assert not open_, f"{len(open_)} slow connections still open after {cut_after:.0f} s"
    assert cut_after < HEADER_TIMEOUT + 3, cut_after
    assert health.statuses == {200}, health.statuses
    assert max(health.latencies) < 2.0, max(health.latencies)


def test_a_stalled_body_is_closed_at_its_deadline(api: str, settings: Settings) -> None:
    key = new_key(settings)
    with socket.create_connection(("127.0.0.1", _port(api)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\nContent-Length: 100\r\n\r\n".encode()
            + b'{"input_file_id": '
        )
        started = time.monotonic()
        closed, answer = _closed_within(sock, BODY_TIMEOUT + 10)
    assert closed, "the stalled request was still open"
    assert time.monotonic() - started >= BODY_TIMEOUT - 0.5
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_past_the_concurrency_cap_requests_are_a_503(api: str, settings: Settings) -> None:
    key = new_key(settings)
    socks = [
        socket.create_connection(("127.0.0.1", _port(api)), timeout=10)
        for _ in range(MAX_CONCURRENCY)
    ]
    try:
        refused = httpx.get(f"{api}/v1/batches", headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 503
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        answer = httpx.get(f"{api}/v1/batches", headers={"Authorization": f"Bearer {key}"})
        if answer.status_code == 200:
            break
        time.sleep(0.2)
    assert answer.status_code == 200


def test_the_dashboard_carries_security_headers(http: TestClient) -> None:
    for path in ("/dashboard", "/dashboard/static/dashboard.js"):
        response = http.get(path)
        assert response.status_code == 200
        policy = response.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.headers["referrer-policy"] == "no-referrer"


def test_metrics_and_health_detail_need_an_operators_key(settings: Settings) -> None:
    operator = settings.model_copy(update={"metrics_token": "scrape-me"})
    tenant_key = new_key(settings)
    with TestClient(create_app(operator)) as client:
        assert client.get("/metrics").status_code == 401
        tenant = {"Authorization": f"Bearer {tenant_key}"}
        assert client.get("/metrics", headers=tenant).status_code == 401
        scraped = client.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
        assert scraped.status_code == 200 and "offpeak_" in scraped.text

        anonymous = client.get("/healthz").json()
        assert set(anonymous) == {"status", "checked_at"}
        full = client.get("/healthz", headers={"Authorization": "Bearer scrape-me"}).json()
        assert {"workers", "models", "problems", "version"} <= set(full)
        seen = client.get("/healthz", headers=tenant).json()
        assert {"workers", "models", "problems"} <= set(seen)
        for worker in seen["workers"]:
            assert worker["hostname"] is None and ":" not in worker["id"]
        assert "hostname" not in str(anonymous)
