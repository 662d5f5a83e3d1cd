"""Requests per minute per key: 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*``
headers, one limit for every API process (through Redis), none for the admin key, and a key
being limited costing the others nothing (no body read, one Redis entry per key)."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import httpx
import redis
from fastapi.testclient import TestClient

from api.app import create_app
from api.rate_limits import RedisLimiter
from api.services import keys
from api.services import tenants as tenants_service
from offpeak.settings import Settings
from offpeak.tenant_limits import LimitSettings
from storage.db import session_scope
from tests.support.database import new_key


def key_with_rate(settings: Settings, requests_per_minute: int | None) -> str:
    key = new_key(settings)
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.tenant_for_key(session, key)
        assert tenant is not None
        tenants_service.set_overrides(
            session, settings, tenant.id, {"requests_per_minute": requests_per_minute}
        )
    return key


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_key_past_its_rate_is_429_with_retry_after_on_every_api_process(
    settings: Settings,
) -> None:
    key = key_with_rate(settings, 3)
    with TestClient(create_app(settings)) as one, TestClient(create_app(settings)) as two:
        for client, remaining in ((one, "2"), (two, "1"), (one, "0")):
            answer = client.get("/v1/batches", headers=bearer(key))
            assert answer.status_code == 200
            assert answer.headers["x-ratelimit-limit-requests"] == "3"
            assert answer.headers["x-ratelimit-remaining-requests"] == remaining
            assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
        for client in (two, one):
            refused = client.get("/v1/batches", headers=bearer(key))
            assert refused.status_code == 429
            # One request every 20 s at 3 a minute: the next one is due within 20 s.
            assert 1 <= int(refused.headers["retry-after"]) <= 20
            assert 0 < int(refused.headers["retry-after-ms"]) <= 20_000
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
            assert "Limit 3" in error["message"]


def test_the_default_rate_applies_to_tenant_keys_and_never_to_the_admin_key(
    settings: Settings,
) -> None:
    limited = settings.model_copy(
        update={"admin_api_key": "admin-secret", "limits": LimitSettings(requests_per_minute=1)}
    )
    key = new_key(limited)
    with TestClient(create_app(limited)) as client:
        assert client.get("/v1/batches", headers=bearer(key)).status_code == 200
        assert client.get("/v1/batches", headers=bearer(key)).status_code == 429
        for _ in range(5):
            admin = client.get("/v1/admin/tenants", headers=bearer("admin-secret"))
            assert admin.status_code == 200
            assert "x-ratelimit-limit-requests" not in admin.headers


def _limiter_entries(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.resolved_broker_url)
    return sum(1 for _ in client.scan_iter(f"{settings.queue_prefix}:ratelimit:*"))


def test_a_key_being_limited_costs_other_tenants_nothing(settings: Settings) -> None:
    attacker, victim = key_with_rate(settings, 2), key_with_rate(settings, 1_000_000)
    app = create_app(settings)
    entries_before = _limiter_entries(settings)

    async def attack() -> tuple[list[int], list[int], list[float], bool]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:

            async def timed(key: str) -> tuple[int, float]:
                start = time.perf_counter()
                answer = await client.get("/v1/batches", headers=bearer(key))
                return answer.status_code, time.perf_counter() - start

            flood = [timed(attacker) for _ in range(400)]
            polls = [timed(victim) for _ in range(40)]
            answers = await asyncio.gather(*flood, *polls)
        body_read = await _limited_upload_reads_its_body(app, attacker)
        attacked, polled = answers[:400], answers[400:]
        return (
            [status for status, _ in attacked],
            [status for status, _ in polled],
            [seconds for _, seconds in polled],
            body_read,
        )

    attacked, polled, poll_seconds, body_read = asyncio.run(attack())
    assert sorted(attacked).count(200) == 2 and attacked.count(429) == 398
    assert polled == [200] * 40
    # A refused request is answered from its headers: its (1 GB) body is never read.
    assert body_read is False
    # At most one limiter entry per key, however many requests it sends (an entry lasts only
    # until its key's bucket is full again).
    assert 1 <= _limiter_entries(settings) - entries_before <= 2
    print(
        f"victim polls under attack: p50 {statistics.median(poll_seconds) * 1000:.1f} ms, "
        f"max {max(poll_seconds) * 1000:.1f} ms"
    )


async def _limited_upload_reads_its_body(app: Any, key: str) -> bool:
    """Whether the app asks for the body of a rate-limited upload."""
    read = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        read = True
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/files",
        "raw_path": b"/v1/files",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"api"),
            (b"authorization", f"Bearer {key}".encode()),
            (b"content-type", b"multipart/form-data; boundary=x"),
            (b"content-length", str(10**9).encode()),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("api", 80),
    }
    await app(scope, receive, send)
    assert sent[0]["status"] == 429
    return read


def test_a_flood_on_a_stalled_event_loop_stays_within_the_limit(settings: Settings) -> None:
    """A flood from one key waits for the pool's connections, even while the event loop stalls
    (a loaded host): waiting there is not Redis being unreachable, and the per-process
    fallback, with a bucket of its own, would let the key's limit through a second time."""
    limiter = RedisLimiter(settings.resolved_broker_url, f"{settings.queue_prefix}-stall")

    async def flood() -> list[bool]:
        async def stall() -> None:
            await asyncio.sleep(0)
            time.sleep(3)  # the loop does nothing else meanwhile: every waiter's clock runs

        key = f"stall-{time.time_ns()}"
        checks = [limiter.check(key, 2) for _ in range(200)]
        verdicts = await asyncio.gather(stall(), *checks)
        return [v.allowed for v in verdicts[1:]]

    allowed = asyncio.run(flood())
    assert allowed.count(True) == 2, allowed.count(True)
