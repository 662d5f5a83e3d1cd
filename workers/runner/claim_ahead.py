"""Claims made on a thread while the engine steps (issue 14, ``offpeak bench overhead``).

At GPU step rates (10–40 ms a step) a claim's round trips (50–100 ms for a few hundred lines)
stalled the engine for several steps each time the queue was refilled. The runner starts the
claim here instead when the engine has sequences running (there is a step to overlap with)
and accepts the lines on its own thread once the claim is done; with nothing running it claims
on its own thread, as it waits for lines anyway. The claim's lines are also prepared here
(parsed and tokenized, ``workers.runner.admission``): 25–150 µs a line, several milliseconds a
chunk that would otherwise come out of the steps. A claim in flight is settled (waited for and
its lines queued) before the runner yields, stops or hands lines back, so its lines go back
with the rest rather than wait out their lease.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class ClaimAhead(Generic[T]):
    """Claims in flight on threads of their own, at most ``depth`` at a time (the runner sets
    it: two while its engine empties every step, else one); ``T`` is what a claim returns.
    They are taken in the order they were started."""

    #: Threads, the most claims that can ever be in flight at once.
    MAX_DEPTH = 2

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._futures: deque[tuple[Future[T], int]] = deque()
        #: Claims allowed in flight at once (1 … ``MAX_DEPTH``).
        self.depth = 1

    @property
    def busy(self) -> bool:
        """As many claims in flight (started and not taken yet) as ``depth`` allows."""
        return len(self._futures) >= self.depth

    @property
    def in_flight(self) -> int:
        """Claims started and not taken yet."""
        return len(self._futures)

    def start(self, claim: Callable[[], T], limit: int) -> None:
        """Run ``claim`` (which asks for ``limit`` lines) on a claim thread."""
        assert not self.busy, f"{self.depth} claims at a time"
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.MAX_DEPTH, thread_name_prefix="claim")
        self._futures.append((self._executor.submit(claim), limit))

    def take(self, *, wait: bool) -> tuple[T, int] | None:
        """``(what the oldest claim returned, lines it asked for)`` once it is done (waiting
        for it if ``wait``), or ``None``; re-raises what the claim raised."""
        if not self._futures:
            return None
        future, limit = self._futures[0]
        if not wait and not future.done():
            return None
        self._futures.popleft()
        return future.result(), limit
