"""Requests per minute per API key: the generic cell rate algorithm (GCRA, the leaky bucket as
a meter: ATM Forum TM 4.1), one timestamp per key.

A key of limit L may send L requests at once and then one every 60/L seconds; each request moves
the key's theoretical arrival time (TAT) ``60/L`` s on, and one whose TAT would end more than a
minute ahead is refused until it is not. Unlike fixed one-minute windows it never lets 2 L
through across a window's edge, and the wait it gives is exact.

Shared by every API process through the broker's Redis (one Lua script per request: the check
and the update are one atomic step, with Redis's clock, so API hosts need not agree on the
time). Without a Redis broker (the embedded default: kombu's filesystem transport) each API
process keeps its own table, so on one machine with ``api_workers`` processes a key may get up
to that many times its limit. While Redis cannot be reached each process falls back to its own
table (logged): a rate limit must neither take the API down with the broker nor lapse.

The answers carry OpenAI's headers (``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests``, the reset as a duration
such as ``1.5s`` or ``6m0s``), and a refusal ``Retry-After`` (whole seconds) and
``retry-after-ms``, which OpenAI's SDKs read first and honour up to two minutes before their
own retry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from offpeak.settings import Settings

log = logging.getLogger(__name__)

#: The limit's period, in milliseconds.
PERIOD_MS = 60_000
#: Keys the in-process table remembers at most (least recently used go first).
MEMORY_TABLE_SIZE = 100_000
#: Redis connections per API process and event loop.
POOL_CONNECTIONS = 32
#: Seconds a call to Redis may take before Redis counts as unreachable.
SOCKET_TIMEOUT_SECONDS = 2.0
#: Seconds a request may wait for one of the pool's connections.
POOL_WAIT_SECONDS = 10.0
#: Seconds between two warnings that Redis cannot be reached.
WARN_EVERY_SECONDS = 60.0

# KEYS[1]: the key's TAT (ms); ARGV: ms per request, the period (ms).
# Returns {allowed (1/0), ms until the bucket is full again, ms until a request would pass}.
_GCRA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local interval = tonumber(ARGV[1])
local period = tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
local new_tat = tat + interval
local wait = new_tat - period - now
if wait > 0 then
  return {0, math.ceil(tat - now), math.ceil(wait)}
end
redis.call('SET', KEYS[1], tostring(new_tat), 'PX', math.ceil(new_tat - now))
return {1, math.ceil(new_tat - now), 0}
"""


@dataclass(frozen=True)
class Verdict:
    """One request's answer: passed or not, the limit, what is left of it, milliseconds until
    it is whole again, and (refused) milliseconds until a request would pass."""

    allowed: bool
    limit: int
    remaining: int
    reset_ms: int
    retry_ms: int

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*-requests`` headers, and the retry ones when refused."""
        headers = {
            "x-ratelimit-limit-requests": str(self.limit),
            "x-ratelimit-remaining-requests": str(self.remaining),
            "x-ratelimit-reset-requests": duration(self.reset_ms),
        }
        if not self.allowed:
            headers["retry-after"] = str(max(1, math.ceil(self.retry_ms / 1000)))
            headers["retry-after-ms"] = str(max(1, self.retry_ms))
        return headers


def duration(ms: int) -> str:
    """Milliseconds as OpenAI's reset headers write them: ``250ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    minutes, seconds = divmod(ms / 1000, 60)
    text = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def _verdict(allowed: bool, limit: int, reset_ms: int, retry_ms: int) -> Verdict:
    interval = PERIOD_MS / limit
    remaining = max(0, math.floor((PERIOD_MS - reset_ms) / interval)) if allowed else 0
    return Verdict(allowed, limit, min(remaining, limit), reset_ms, retry_ms)


def _refused_outright() -> Verdict:
    # A limit of 0 refuses every request; a minute is as long as any wait can be.
    return Verdict(False, 0, 0, PERIOD_MS, PERIOD_MS)


class MemoryLimiter:
    """GCRA in this process: ``key → TAT`` (monotonic ms), LRU-bounded, thread-safe."""

    def __init__(self, size: int = MEMORY_TABLE_SIZE) -> None:
        self.size = size
        self._tats: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tats)

    async def check(self, key: str, limit: int) -> Verdict:
        if limit <= 0:
            return _refused_outright()
        interval = PERIOD_MS / limit
        now = time.monotonic() * 1000
        with self._lock:
            tat = max(self._tats.get(key, now), now)
            new_tat = tat + interval
            wait = new_tat - PERIOD_MS - now
            if wait > 0:
                return _verdict(False, limit, math.ceil(tat - now), math.ceil(wait))
            self._tats[key] = new_tat
            self._tats.move_to_end(key)
            # Entries older than a period are spent anyway: the oldest go first.
            while len(self._tats) > self.size:
                self._tats.popitem(last=False)
        return _verdict(True, limit, math.ceil(new_tat - now), 0)


class RedisLimiter:
    """GCRA in Redis, shared by every API process on it: one ``EVALSHA`` per request."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = f"{prefix}:ratelimit:"
        # One client per event loop: an asyncio connection belongs to the loop that opened it
        # (an app served by several loops in turn, as test clients do, gets one each).
        self._clients: dict[int, tuple[asyncio.AbstractEventLoop, Any, Any]] = {}
        self._warned_at = 0.0
        self._fallback = MemoryLimiter()

    def _script(self) -> Any:
        loop = asyncio.get_running_loop()
        entry = self._clients.get(id(loop))
        if entry is None or entry[0] is not loop:
            import redis.asyncio

            # Requests beyond the pool's connections wait for one rather than fail: a flood
            # from one key queues here instead of passing unchecked. That wait is for this
            # process's own calls ahead (each ends within the socket timeout), so it is longer:
            # on a starved event loop a short one sent a flood to the per-process fallback.
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                self.url,
                max_connections=POOL_CONNECTIONS,
                timeout=POOL_WAIT_SECONDS,
                socket_timeout=SOCKET_TIMEOUT_SECONDS,
            )
            client = redis.asyncio.Redis(connection_pool=pool)
            entry = (loop, client, client.register_script(_GCRA))
            self._clients[id(loop)] = entry
        return entry[2]

    async def check(self, key: str, limit: int) -> Verdict:
        if limit <= 0:
            return _refused_outright()
        try:
            allowed, reset_ms, retry_ms = await self._script()(
                keys=[self.prefix + key], args=[PERIOD_MS / limit, PERIOD_MS]
            )
        except Exception as exc:  # the broker down must not take the API with it
            if time.monotonic() - self._warned_at > WARN_EVERY_SECONDS:
                self._warned_at = time.monotonic()
                log.warning("rate limit kept per process, Redis unreachable: %s", exc)
            return await self._fallback.check(key, limit)
        return _verdict(bool(allowed), limit, int(reset_ms), int(retry_ms))


def limiter_for(settings: Settings) -> MemoryLimiter | RedisLimiter:
    """The broker's Redis when the broker is one, else this process's table."""
    url = settings.resolved_broker_url
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisLimiter(url, settings.queue_prefix)
    return MemoryLimiter()
