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

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class ClaimAhead(Generic[T]):
    """At most one claim in flight on a thread of its own; ``T`` is what the claim returns."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[T] | None = None
        self._asked = 0

    @property
    def busy(self) -> bool:
        """A claim was started and not taken yet."""
        return self._future is not None

    def start(self, claim: Callable[[], T], limit: int) -> None:
        """Run ``claim`` (which asks for ``limit`` lines) on the claim thread."""
        assert self._future is None, "one claim at a time"
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="claim")
        self._future = self._executor.submit(claim)
        self._asked = limit

    def take(self, *, wait: bool) -> tuple[T, int] | None:
        """``(what the claim returned, lines asked for)`` once it is done (waiting for it if
        ``wait``), or ``None``; re-raises what the claim raised."""
        future = self._future
        if future is None or (not wait and not future.done()):
            return None
        self._future = None
        return future.result(), self._asked
