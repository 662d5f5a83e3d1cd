"""The in-process rate limiter (GCRA) and OpenAI's header formats, without Redis."""

from __future__ import annotations

import asyncio

from api.rate_limits import MemoryLimiter, duration


def checks(limiter: MemoryLimiter, key: str, limit: int, times: int) -> list[bool]:
    async def run() -> list[bool]:
        return [(await limiter.check(key, limit)).allowed for _ in range(times)]

    return asyncio.run(run())


def test_a_key_gets_its_limit_at_once_then_waits_for_the_next_slot() -> None:
    limiter = MemoryLimiter()
    assert checks(limiter, "k", 3, 5) == [True, True, True, False, False]
    refused = asyncio.run(limiter.check("k", 3))
    headers = refused.headers()
    # 3 a minute: one slot every 20 s, so the next request is due within 20 s.
    assert 1 <= int(headers["retry-after"]) <= 20
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert checks(limiter, "other", 3, 1) == [True]  # keys are apart


def test_a_limit_of_zero_refuses_everything() -> None:
    assert checks(MemoryLimiter(), "k", 0, 2) == [False, False]


def test_the_table_is_bounded() -> None:
    limiter = MemoryLimiter(size=3)
    for n in range(10):
        checks(limiter, f"k{n}", 5, 1)
    assert len(limiter) == 3


def test_durations_are_written_as_openai_writes_them() -> None:
    assert duration(250) == "250ms"
    assert duration(1500) == "1.5s"
    assert duration(20_000) == "20s"
    assert duration(60_000) == "1m0s"
    assert duration(61_250) == "1m1.25s"
