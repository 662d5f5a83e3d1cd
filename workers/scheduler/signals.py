"""Load signals: how busy the shared GPU is with real-time serving, as one number.

Every signal reads a load on the scale of the water marks (``SchedulerSettings.low_water`` /
``high_water``; 0 is idle); a ``LoadMonitor`` combines the pool's signals (the largest load wins)
with the admin pause switch. Which signals a pool uses is a setting
(``OFFPEAK_SCHEDULER__LOAD_SIGNALS``), so a dedicated batch GPU, a GPU shared with a vLLM
real-time server and a GPU that is only free at night differ only in configuration.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol
from zoneinfo import ZoneInfo

from offpeak.scheduler_state import PauseState
from offpeak.settings import SchedulerSettings
from workers.vllm_metrics import fetch_text, parse_metrics

log = logging.getLogger(__name__)


class SignalError(Exception):
    """A signal could not be read (endpoint down, no GPU, ...)."""


class LoadSignal(Protocol):
    #: Short name, used in logs and in the reading's ``parts``.
    name: str

    def read(self, at: float) -> float:
        """The load at unix time ``at`` (0 = idle). Raises ``SignalError`` when unreadable."""
        ...


@dataclass(frozen=True)
class LoadReading:
    """One reading of a pool's signals.

    ``load`` is the largest of ``parts`` (``signal name → load``); ``errors`` names the signals
    that could not be read and why.
    """

    at: float
    load: float
    parts: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    pause: PauseState = PauseState()

    def as_json(self) -> dict[str, Any]:
        """A JSON-safe form for ``scheduler_state`` (infinite loads become ``None``)."""

        def finite(x: float) -> float | None:
            return round(x, 4) if math.isfinite(x) else None

        return {
            "at": self.at,
            "load": finite(self.load),
            "parts": {k: finite(v) for k, v in self.parts.items()},
            "errors": self.errors,
            "paused": self.pause.paused,
            "hard": self.pause.hard,
            "reason": self.pause.reason,
        }


class IdleSignal:
    """Always idle: a GPU dedicated to batch work (the default)."""

    name = "idle"

    def read(self, at: float) -> float:
        return 0.0


# --- Prometheus -------------------------------------------------------------------------------


class PrometheusSignal:
    """``Σ weight × value`` over metrics scraped from a real-time server's ``/metrics``.

    With vLLM's metrics (``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc``, a fraction 0-1 despite its name) and the default weights, one
    waiting request adds 0.1, one running request 0.01 and a full KV cache 1.0.
    """

    name = "prometheus"

    def __init__(
        self, url: str, weights: Mapping[str, float], timeout_seconds: float = 2.0
    ) -> None:
        if not weights:
            raise ValueError("the Prometheus signal needs at least one weighted metric")
        self.url = url
        self.weights = dict(weights)
        self.timeout_seconds = timeout_seconds
        self._warned: set[str] = set()

    def read(self, at: float) -> float:
        """Raises ``SignalError`` when the endpoint cannot be scraped or exposes none of the
        weighted metrics (a wrong URL); a single missing metric counts as 0, with a warning."""
        try:
            values = parse_metrics(fetch_text(self.url, self.timeout_seconds), self.weights)
        except (OSError, ValueError) as exc:  # URLError and HTTPError are OSErrors
            raise SignalError(f"cannot scrape {self.url}: {exc}") from exc
        if not values:
            raise SignalError(f"{self.url} exposes none of {', '.join(sorted(self.weights))}")
        for missing in set(self.weights) - set(values) - self._warned:
            log.warning("%s does not expose %s; counting it as 0", self.url, missing)
            self._warned.add(missing)
        return sum(weight * values.get(name, 0.0) for name, weight in self.weights.items())


# --- NVML -------------------------------------------------------------------------------------


def _own_pids() -> set[int]:
    """This process and its descendants (vLLM's engine-core and executor processes)."""
    pids = {os.getpid()}
    try:
        import psutil
    except ImportError:
        return pids
    with contextlib.suppress(psutil.Error):
        pids.update(child.pid for child in psutil.Process().children(recursive=True))
    return pids


class NvmlSignal:
    """GPU utilization and memory of *other* processes, from NVML (``nvidia-ml-py``).

    Load = ``utilization_weight × SM utilization + memory_weight × memory used``, both fractions
    of the device, counting only processes that are not this worker or its children: the batch
    engine's own use must not make it yield to itself. Where the driver cannot report
    per-process utilization, the device's total utilization is used (which includes this
    worker's; pair it with ``memory_weight`` or the Prometheus signal then).

    Without ``nvidia-ml-py`` or a GPU the signal is unavailable: every read raises
    ``SignalError`` (``on_signal_error`` decides what that means), and nothing else breaks.
    """

    name = "nvml"

    def __init__(
        self,
        device_index: int = 0,
        utilization_weight: float = 1.0,
        memory_weight: float = 0.0,
        own_pids: Callable[[], set[int]] = _own_pids,
    ) -> None:
        self.device_index = device_index
        self.utilization_weight = utilization_weight
        self.memory_weight = memory_weight
        self._own_pids = own_pids
        self._last_seen = 0
        self._nvml: Any = None
        self.unavailable: str | None = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._nvml = pynvml
        except ImportError:
            self.unavailable = "nvidia-ml-py is not installed"
        except Exception as exc:  # pynvml.NVMLError: no driver, no such device
            self.unavailable = f"NVML unavailable: {exc}"
        if self.unavailable:
            log.warning("NVML load signal: %s", self.unavailable)

    def read(self, at: float) -> float:
        if self._nvml is None:
            raise SignalError(self.unavailable or "NVML unavailable")
        nvml, handle = self._nvml, self._handle
        own = self._own_pids()
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            used = sum(p.usedGpuMemory or 0 for p in processes if p.pid not in own)
            memory_fraction = used / memory.total if memory.total else 0.0
            utilization = self._utilization(own)
        except Exception as exc:  # pynvml.NVMLError
            raise SignalError(f"NVML read failed: {exc}") from exc
        return self.utilization_weight * utilization + self.memory_weight * memory_fraction

    def _utilization(self, own: set[int]) -> float:
        nvml, handle = self._nvml, self._handle
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, self._last_seen)
        except Exception:  # not supported on this GPU/driver: the device's total
            return float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0
        per_pid: dict[int, float] = {}
        for sample in samples:
            self._last_seen = max(self._last_seen, int(sample.timeStamp))
            if sample.pid not in own:
                per_pid[sample.pid] = max(per_pid.get(sample.pid, 0.0), float(sample.smUtil))
        return min(1.0, sum(per_pid.values()) / 100.0)


# --- Time of day ------------------------------------------------------------------------------

_DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WINDOW_RE = re.compile(
    r"^\s*(?:(?P<days>[a-z]{3}(?:-[a-z]{3})?(?:,[a-z]{3}(?:-[a-z]{3})?)*)\s+)?"
    r"(?P<start>\d{1,2}:\d{2})\s*-\s*(?P<end>\d{1,2}:\d{2})\s*$"
)


@dataclass(frozen=True)
class Window:
    """An off-peak window: minutes after local midnight, on some weekdays (0 = Monday)."""

    start: int
    end: int
    days: frozenset[int]

    def contains(self, weekday: int, minute: int) -> bool:
        if self.start < self.end:
            return weekday in self.days and self.start <= minute < self.end
        # Past midnight: the part after midnight belongs to the day the window started on.
        return (weekday in self.days and minute >= self.start) or (
            (weekday - 1) % 7 in self.days and minute < self.end
        )


def _minutes(text: str) -> int:
    hours, minutes = (int(part) for part in text.split(":"))
    if not (0 <= hours <= 24 and 0 <= minutes < 60) or (hours == 24 and minutes):
        raise ValueError(f"not a time of day: {text!r}")
    return hours * 60 + minutes


def _days(text: str | None) -> frozenset[int]:
    if not text:
        return frozenset(range(7))
    days: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        if first not in _DAYS or (last and last not in _DAYS):
            raise ValueError(f"unknown day in {part!r}; use {', '.join(_DAYS)}")
        a, b = _DAYS.index(first), _DAYS.index(last or first)
        days.update((a + i) % 7 for i in range((b - a) % 7 + 1))
    return frozenset(days)


def parse_window(text: str) -> Window:
    """``"22:00-06:00"``, ``"mon-fri 22:00-06:00"`` or ``"sat,sun 00:00-24:00"`` as a ``Window``.

    Raises ``ValueError`` for anything else, or for a window that starts where it ends.
    """
    match = _WINDOW_RE.match(text.lower())
    if not match:
        raise ValueError(f"not an off-peak window: {text!r} (e.g. 'mon-fri 22:00-06:00')")
    start, end = _minutes(match["start"]), _minutes(match["end"])
    if start == end:
        raise ValueError(f"empty window: {text!r}")
    return Window(start=start, end=end, days=_days(match["days"]))


class ScheduleSignal:
    """Off-peak windows in a time zone: load 0 inside a window, ``busy_load`` outside."""

    name = "schedule"

    def __init__(self, windows: Iterable[str], timezone: str = "UTC", busy_load: float = 1.0):
        self.windows = [parse_window(w) for w in windows]
        if not self.windows:
            raise ValueError("the schedule signal needs at least one window")
        self.zone = ZoneInfo(timezone)
        self.busy_load = busy_load

    def inside(self, at: float) -> bool:
        """Whether unix time ``at`` falls in a window (wall-clock time in the zone)."""
        local = datetime.fromtimestamp(at, self.zone)
        minute = local.hour * 60 + local.minute
        return any(w.contains(local.weekday(), minute) for w in self.windows)

    def read(self, at: float) -> float:
        return 0.0 if self.inside(at) else self.busy_load


# --- Combined ---------------------------------------------------------------------------------


class LoadMonitor:
    """A pool's signals and the admin switch, read together."""

    def __init__(
        self,
        signals: Iterable[LoadSignal],
        pause: Callable[[], PauseState] | None = None,
    ) -> None:
        self.signals = list(signals) or [IdleSignal()]
        self._pause = pause
        self._last_pause = PauseState()
        self._pause_failing = False

    def read(self, at: float) -> LoadReading:
        """Read every signal; unreadable ones go to ``errors`` (and count as load 0 there). An
        unreadable pause switch keeps its last state."""
        parts: dict[str, float] = {}
        errors: dict[str, str] = {}
        for signal in self.signals:
            try:
                parts[signal.name] = float(signal.read(at))
            except SignalError as exc:
                errors[signal.name] = str(exc)
        pause = self._last_pause
        if self._pause is not None:
            try:
                pause = self._last_pause = self._pause()
                self._pause_failing = False
            except Exception as exc:
                # The database is unreachable: keep the switch as last read. Yielding for an
                # outage would abort work the engine can finish while the database comes back.
                # Said once per outage, not once per reading.
                level = logging.DEBUG if self._pause_failing else logging.WARNING
                log.log(level, "cannot read the pause switch, keeping the last state: %s", exc)
                self._pause_failing = True
        return LoadReading(
            at=at, load=max(parts.values(), default=0.0), parts=parts, errors=errors, pause=pause
        )


class BackgroundMonitor:
    """A ``LoadMonitor`` read by a thread of its own, every ``poll_seconds``, so a slow signal
    (a metrics endpoint taking its whole ``timeout_seconds``, a slow database for the pause
    switch) never stalls the engine loop: ``read`` returns the latest reading at once.

    A reading older than ``stale_after`` seconds (the thread is stuck) is returned with an
    error under ``monitor``, so the gate treats it as unreadable (``on_signal_error``). The
    thread starts on the first ``read``, which waits for its first reading (up to
    ``stale_after``), and ends after ``idle_after`` seconds without a ``read``, so a runner
    that is not running costs nothing; the next ``read`` starts it again.
    """

    def __init__(
        self,
        monitor: LoadMonitor,
        poll_seconds: float,
        stale_after: float,
        idle_after: float = 5.0,
    ) -> None:
        self.monitor = monitor
        self.poll_seconds = poll_seconds
        self.stale_after = stale_after
        self.idle_after = max(idle_after, 3 * poll_seconds)
        self._latest: tuple[float, LoadReading] | None = None
        self._last_read = time.monotonic()
        self._lock = threading.Lock()
        self._new_reading = threading.Condition()
        #: ``read`` waits for a reading started after this (``refresh``).
        self._wanted_after = -math.inf
        #: Set by ``refresh``: the thread takes its next reading now rather than after its
        #: ``poll_seconds`` pause.
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        """Make the next ``read`` wait (up to ``stale_after``) for a reading begun after now:
        a new drain acts on the load as it is, not as the thread last saw it. The thread takes
        that reading at once rather than at its next poll, so a drain never starts late."""
        self._wanted_after = time.monotonic()
        self._wake.set()

    def _run(self, first: threading.Event) -> None:
        while time.monotonic() - self._last_read < self.idle_after:
            # Cleared before the reading: a ``refresh`` during it brings the next one at once.
            self._wake.clear()
            started = time.monotonic()
            try:
                reading = self.monitor.read(time.time())
            except Exception as exc:  # a bug in a signal must not end the readings
                log.exception("load monitor failed")
                reading = LoadReading(at=time.time(), load=0.0, errors={"monitor": repr(exc)})
            with self._new_reading:
                self._latest = (started, reading)
                self._new_reading.notify_all()
            first.set()
            self._wake.wait(max(0.0, self.poll_seconds - (time.monotonic() - started)))

    def _ensure_running(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            first = threading.Event()
            self._thread = threading.Thread(
                target=self._run, args=(first,), name="load-monitor", daemon=True
            )
            self._thread.start()
        # A new thread: the reading left by an earlier one is stale, wait for a fresh one.
        first.wait(self.stale_after)

    def read(self, at: float) -> LoadReading:
        """The latest reading, stamped ``at``; blocks only until the thread's first reading."""
        self._last_read = time.monotonic()
        self._ensure_running()
        wanted = self._wanted_after
        if self._latest is None or self._latest[0] < wanted:
            with self._new_reading:
                self._new_reading.wait_for(
                    lambda: self._latest is not None and self._latest[0] >= wanted,
                    timeout=self.stale_after,
                )
        latest = self._latest
        if latest is None:
            return LoadReading(at=at, load=0.0, errors={"monitor": "no load reading yet"})
        taken, reading = latest
        age = time.monotonic() - taken
        errors = dict(reading.errors)
        if age > self.stale_after:
            errors["monitor"] = f"last load reading is {age:.0f} s old"
        return LoadReading(
            at=at, load=reading.load, parts=reading.parts, errors=errors, pause=reading.pause
        )


def build_signals(settings: SchedulerSettings) -> list[LoadSignal]:
    """The signals ``settings.load_signals`` names, configured from the same settings.

    Raises ``ValueError`` for a bad schedule window or time zone, or Prometheus weights.
    """
    signals: list[LoadSignal] = []
    for name in dict.fromkeys(settings.load_signals):
        if name == "idle":
            signals.append(IdleSignal())
        elif name == "prometheus":
            p = settings.prometheus
            signals.append(PrometheusSignal(p.url, p.weights, p.timeout_seconds))
        elif name == "nvml":
            n = settings.nvml
            signals.append(NvmlSignal(n.device_index, n.utilization_weight, n.memory_weight))
        elif name == "schedule":
            s = settings.schedule
            busy = max(1.0, settings.high_water)
            signals.append(ScheduleSignal(s.windows, s.timezone, busy_load=busy))
    return signals
