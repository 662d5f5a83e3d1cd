"""The remote engine's meter: our busy seconds at a shared vLLM server and the tokens it processed.

The write-back charges each period's busy wall seconds × our share of the server's weighted
tokens (``workers.runner.server_share``), so the meter counts both, for everyone at the server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from workers.vllm_metrics import ServerTokens, parse_server_tokens

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerUsage:
    """What a ``ServerMeter`` counted since it started: ``busy_seconds`` of wall time during which
    at least one of our requests was at the server, and the tokens the server processed (for
    everyone) in that time. Monotonic: the difference of two readings covers the time between."""

    busy_seconds: float = 0.0
    tokens: ServerTokens = ServerTokens()

    def since(self, earlier: ServerUsage) -> ServerUsage:
        return ServerUsage(
            self.busy_seconds - earlier.busy_seconds,
            ServerTokens(
                self.tokens.prompt - earlier.tokens.prompt,
                self.tokens.cached - earlier.tokens.cached,
                self.tokens.generation - earlier.tokens.generation,
            ),
        )


class ServerMeter:
    """Reads a vLLM server's token counters (``metrics_url``) every ``interval`` seconds and adds
    up, over the intervals in which ``busy()`` was true at some point, their wall seconds and the
    tokens the server processed: ``usage()``. The remote engine runs ``sample`` on its event
    loop; the write-back (our share of the server's time) and the batch lane's controller read
    ``usage()`` from other threads.
    """

    def __init__(self, metrics_url: str, interval: float, busy: Callable[[], bool]) -> None:
        self.metrics_url = metrics_url
        self.interval = interval
        self._busy = busy
        self._lock = threading.Lock()
        self._usage = ServerUsage()
        self._last: tuple[float, ServerTokens] | None = None
        #: Whether we had work at the server at some point since the last reading.
        self._was_busy = False
        #: The interval just after our work ended is already marked to count (once).
        self._tail_counted = False
        #: Reads that failed in a row (the engine counts the server as gone after a few).
        self.failures = 0

    def usage(self) -> ServerUsage:
        """Busy seconds and server tokens counted so far (thread-safe)."""
        with self._lock:
            return self._usage

    def mark_busy(self) -> None:
        """A request of ours went to the server (the interval it falls in counts)."""
        self._was_busy = True

    def record(self, at: float, tokens: ServerTokens | None) -> None:
        """Account one reading taken at monotonic ``at`` (``None``: the read failed). The interval
        since the last good reading counts when we had work at the server in it, and so does
        the one after: the server bumps its counters after it has answered, so the last step's
        tokens of a line that just finished can land after the reading that saw it finish."""
        busy = self._was_busy or self._busy()
        if tokens is None:
            self.failures += 1
            self._was_busy = busy  # the gap counts with the next good reading
            return
        self._was_busy = self._busy() or (busy and not self._tail_counted)
        self._tail_counted = busy and not self._busy()
        self.failures = 0
        with self._lock:
            if self._last is not None and busy:
                seconds = at - self._last[0]
                self._usage = ServerUsage(
                    self._usage.busy_seconds + seconds,
                    self._usage.tokens.plus(tokens.since(self._last[1])),
                )
            self._last = (at, tokens)

    async def sample(self, client: httpx.AsyncClient) -> None:
        """Read the counters once (``record``)."""
        try:
            response = await client.get(self.metrics_url, timeout=max(2.0, self.interval * 5))
            response.raise_for_status()
            tokens: ServerTokens | None = parse_server_tokens(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("cannot read %s: %s", self.metrics_url, exc)
            tokens = None
        self.record(time.monotonic(), tokens)
