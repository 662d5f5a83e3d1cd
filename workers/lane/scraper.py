"""The batch lane's view of the real-time server: its ``/metrics`` scraped on a thread of its own.

The controller (``workers.lane.controller``) is pure; this is the I/O that feeds it a
``ServerSnapshot`` every control interval without ever stalling the runner's loop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from offpeak.lane_settings import LaneSettings
from workers.vllm_metrics import ServerSnapshot, fetch_text, parse_snapshot

log = logging.getLogger(__name__)


class ServerMetrics(Protocol):
    def read(self) -> ServerSnapshot | None:
        """The latest snapshot, or ``None`` when the server cannot be read."""
        ...


class PrometheusServer:
    """Scrapes a vLLM server's ``/metrics`` (``url``) on a thread of its own every
    ``poll_seconds``, so a slow server never stalls the runner's loop; ``read`` returns the
    latest snapshot, ``None`` when the last scrape failed or is older than ``stale_seconds``."""

    def __init__(self, url: str, poll_seconds: float, timeout_seconds: float, stale_seconds: float):
        self.url, self.poll_seconds = url, poll_seconds
        self.timeout_seconds, self.stale_seconds = timeout_seconds, stale_seconds
        self._latest: ServerSnapshot | None = None
        self._error: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._first = threading.Event()

    def scrape(self) -> ServerSnapshot:
        """One scrape now. Raises ``OSError`` (unreachable) or ``ValueError`` (bad text)."""
        return parse_snapshot(fetch_text(self.url, self.timeout_seconds), time.monotonic())

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._latest, self._error = self.scrape(), None
            except (OSError, ValueError) as exc:
                if self._error is None:
                    log.warning("lane: cannot read %s: %s", self.url, exc)
                self._error = str(exc)
            self._first.set()
            self._stop.wait(max(0.0, self.poll_seconds - (time.monotonic() - started)))

    def read(self) -> ServerSnapshot | None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="lane-metrics", daemon=True)
            self._thread.start()
            self._first.wait(self.timeout_seconds + 1.0)
        latest = self._latest
        if self._error is not None or latest is None:
            return None
        if time.monotonic() - latest.at > self.stale_seconds:
            return None
        return latest

    def close(self) -> None:
        self._stop.set()


def metrics_url(settings: LaneSettings, engine_url: str | None, fallback: str) -> str:
    """Where the lane reads the real-time server: the setting, else the remote engine's server
    (``<url>/metrics``, the URL's ``/v1`` suffix dropped), else the Prometheus signal's URL."""
    if settings.metrics_url:
        return settings.metrics_url
    if engine_url:
        base = engine_url.rstrip("/").removesuffix("/v1")
        return f"{base}/metrics"
    return fallback
