"""The lease heartbeat: a thread that renews a worker's leases while its loop is slow.

The runner renews its leases at every write-back, after an engine step. One step can take
longer than a lease (a large prefill, a host under load), and then another worker would take
lines that are still running here. The heartbeat renews them in between, but only while the
loop is running and has turned within ``stall_seconds``: a hung loop must lose its lines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

#: A loop that has not turned for this long is hung: the heartbeat stops covering it.
STALL_SECONDS = 300.0


class LeaseHeartbeat:
    """Calls ``renew()`` whenever no renewal happened for a third of ``lease_seconds``, while
    inside ``running()`` and while ``tick()`` is called at least every ``stall_seconds``."""

    def __init__(
        self,
        renew: Callable[[], object],
        lease_seconds: float,
        stall_seconds: float = STALL_SECONDS,
    ) -> None:
        self._renew = renew
        self.interval = max(0.2, lease_seconds / 3)
        self.stall_seconds = stall_seconds
        self._active = threading.Event()
        self._tick = self._renewed = time.monotonic()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        """The loop turned."""
        self._tick = time.monotonic()

    def renewed(self) -> None:
        """The loop renewed the leases itself (a write-back)."""
        self._renewed = time.monotonic()

    @contextmanager
    def running(self) -> Iterator[None]:
        """Cover the leases for the duration of the block (lines are held only inside it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
            self._thread.start()
        self.tick()
        self._active.set()
        try:
            yield
        finally:
            self._active.clear()

    def _beat(self) -> None:
        while True:
            time.sleep(self.interval / 2)
            self._active.wait()
            now = time.monotonic()
            if now - self._renewed < self.interval or now - self._tick > self.stall_seconds:
                continue
            try:
                self._renew()
                self._renewed = now
            except Exception as exc:  # the database is down: the next beat tries again
                log.warning("lease heartbeat failed: %s", exc)
