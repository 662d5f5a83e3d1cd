"""The release check: each engine worker releases its idle models' engines, between drains.

``workers.engine.release`` frees an engine after a drain that found the gate closed long enough;
but drains come only while the model has running batches, so an engine whose batches all ended
keeps its memory until the next batch arrives. Here a thread of the engine worker looks at each
of its runners every ``sweep_seconds``, between drains (a runner that is draining is skipped:
the engine is not thread-safe), reads the load into its gate and releases the engine when the
runner holds no line and either the gate has been closed ``release_after_seconds`` or the
runner has held no line for ``release_idle_after_seconds``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from offpeak.settings import Settings
from workers.engine.release import ReleasableEngine

log = logging.getLogger(__name__)


def release_reason(
    engine: Any, gate: Any, settings: Settings, at: float, idle: float
) -> str | None:
    """Why ``engine`` should be released now (``None``: it should not): at unix time ``at``,
    its runner having held no line for ``idle`` seconds. Only a loaded ``ReleasableEngine``
    with nothing in flight qualifies."""
    if not isinstance(engine, ReleasableEngine) or engine.released or engine.num_unfinished():
        return None
    policy = settings.scheduler
    closed = gate.closed_for(at)
    if policy.release_after_seconds and not gate.open and closed >= policy.release_after_seconds:
        return f"no batch running and batch work held back for {closed:.0f} s ({gate.reason})"
    if policy.release_idle_after_seconds and idle >= policy.release_idle_after_seconds:
        return f"no line held for {idle:.0f} s"
    return None


class ReleaseCheck:
    """The check of the module docstring over ``runners()`` (model -> ``Runner``), every
    ``every`` seconds on a daemon thread (``start``), or once (``check``). ``busy(model)``
    is the lock a drain of the model holds while it runs."""

    def __init__(
        self,
        settings: Settings,
        runners: Callable[[], Mapping[str, Any]],
        every: float,
    ) -> None:
        self.settings, self.runners, self.every = settings, runners, every
        self._locks: dict[str, threading.Lock] = {}
        self._idle_since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def busy(self, model: str) -> Iterator[None]:
        """Held by a drain of ``model`` while it runs: the check leaves the runner alone."""
        lock = self._locks.setdefault(model, threading.Lock())
        with lock:
            yield
        self._idle_since[model] = time.monotonic()

    def check(self, at: float | None = None, now: float | None = None) -> list[str]:
        """One look at every runner (unix ``at``, monotonic ``now``); the models released."""
        at = time.time() if at is None else at
        now = time.monotonic() if now is None else now
        released = []
        for model, runner in list(self.runners().items()):
            lock = self._locks.setdefault(model, threading.Lock())
            if not lock.acquire(blocking=False):
                continue  # a drain runs it
            try:
                if runner.held:
                    self._idle_since[model] = now
                    continue
                since = self._idle_since.setdefault(model, now)
                runner.load.restart()  # the load as it is now, not as the last drain saw it
                runner.load.observe(runner.clock.time())
                reason = release_reason(runner.engine, runner.gate, self.settings, at, now - since)
                if reason is not None and runner.engine.release(reason):
                    released.append(model)
            except Exception:  # a failed look must not end the thread; the next one retries
                log.exception("%s: release check failed", model)
            finally:
                lock.release()
        return released

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="release-check")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.check()

    def stop(self) -> None:
        self._stop.set()
