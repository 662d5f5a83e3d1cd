"""Claims made on a thread while the engine steps: at GPU step rates a claim's round trips
would stall the engine for several steps (``offpeak bench overhead``, ``docs/benchmarks.md``).

The claim pipeline (``workers.runner.claims``) starts a claim here when the engine has
sequences running, and its lines are prepared here too (parsed and tokenized,
``workers.runner.admission``); the runner accepts them on its own thread once done. A claim in
flight is settled before the runner yields, stops or hands lines back, so its lines go back with
the rest rather than wait out their lease.
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
