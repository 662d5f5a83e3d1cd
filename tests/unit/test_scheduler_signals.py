"""Load signals and the gate: a real HTTP endpoint serving Prometheus text whose values the tests
change, the off-peak schedule, NVML (absent here, and a stand-in module), the admin switch
through the API and the CLI, and hysteresis."""

from __future__ import annotations

import os
import sys
import time
import types
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from offpeak.scheduler_state import PauseState
from offpeak.settings import SchedulerSettings
from tests.support.scheduler import MetricsEndpoint, metrics_endpoint
from workers.scheduler.gate import Gate
from workers.scheduler.signals import (
    BackgroundMonitor,
    LoadMonitor,
    LoadReading,
    NvmlSignal,
    PrometheusSignal,
    ScheduleSignal,
    SignalError,
    build_signals,
    parse_window,
)
from workers.vllm_metrics import parse_metrics

WEIGHTS = SchedulerSettings().prometheus.weights


@pytest.fixture()
def endpoint() -> MetricsEndpoint:
    with metrics_endpoint() as e:
        yield e  # type: ignore[misc]


def test_prometheus_signal_reads_the_weighted_vllm_metrics(endpoint: MetricsEndpoint) -> None:
    signal = PrometheusSignal(endpoint.url, WEIGHTS)
    endpoint.set(running=20, waiting=0, kv=0.1)
    # 20 running x 0.01 + 0 waiting + the fuller engine's KV cache 0.1 x 1.0
    assert signal.read(0) == pytest.approx(0.3)
    endpoint.set(running=30, waiting=4, kv=0.5)
    assert signal.read(0) == pytest.approx(0.3 + 0.4 + 0.5)
    assert endpoint.scrapes == 2


def test_parse_metrics_sums_counts_and_takes_the_largest_percentage() -> None:
    text = MetricsEndpoint.text(types.SimpleNamespace(running=6, waiting=2, kv=0.8))  # type: ignore[arg-type]
    values = parse_metrics(text, WEIGHTS)
    assert values == {
        "vllm:num_requests_running": 6,
        "vllm:num_requests_waiting": 2,
        "vllm:kv_cache_usage_perc": 0.8,
    }
    assert parse_metrics(text, ["vllm:prompt_tokens_total"]) == {"vllm:prompt_tokens_total": 12345}


def test_an_unreachable_or_wrong_endpoint_is_a_signal_error(endpoint: MetricsEndpoint) -> None:
    endpoint.status = 503
    with pytest.raises(SignalError, match="503"):
        PrometheusSignal(endpoint.url, WEIGHTS).read(0)
    endpoint.status = 200
    with pytest.raises(SignalError, match="exposes none"):
        PrometheusSignal(endpoint.url, {"vllm:not_a_metric": 1.0}).read(0)
    url = endpoint.url
    endpoint.close()
    with pytest.raises(SignalError, match="cannot scrape"):
        PrometheusSignal(url, WEIGHTS, timeout_seconds=0.5).read(0)


def test_gate_has_hysteresis_on_the_scraped_load(endpoint: MetricsEndpoint) -> None:
    monitor = LoadMonitor([PrometheusSignal(endpoint.url, WEIGHTS)])
    gate = Gate(low_water=0.3, high_water=0.6)
    states = []
    for kv in (0.1, 0.5, 0.65, 0.5, 0.35, 0.29, 0.5, 0.59):
        endpoint.set(kv=kv)
        states.append(gate.update(monitor.read(0)))
    # Open until the load reaches 0.6; closed until it falls to 0.3; open again up to 0.6.
    assert states == [True, True, False, False, False, True, True, True]
    assert gate.changes == 2


def test_unreadable_signals_count_as_busy_unless_ignored(endpoint: MetricsEndpoint) -> None:
    monitor = LoadMonitor([PrometheusSignal(endpoint.url, WEIGHTS, timeout_seconds=0.5)])
    busy, ignore = Gate(0.3, 0.6, "busy"), Gate(0.3, 0.6, "ignore")
    endpoint.status = 500
    reading = monitor.read(0)
    assert "prometheus" in reading.errors
    assert not busy.update(reading) and "unreadable" in busy.reason
    assert ignore.update(reading)
    endpoint.status = 200
    assert busy.update(monitor.read(0))  # readable again and idle: work resumes at once


def test_a_refresh_brings_the_background_reading_at_once() -> None:
    """A drain starts with ``refresh``: its first ``read`` waits for a reading begun after it.
    The thread takes that reading at once rather than after its poll interval (it waited for
    the next poll, up to a second by default, with the engine idle at every drain's start)."""

    class Counting:
        name = "counting"
        reads = 0

        def read(self, at: float) -> float:
            Counting.reads += 1
            return 0.1

    monitor = BackgroundMonitor(LoadMonitor([Counting()]), poll_seconds=30.0, stale_after=60.0)
    assert monitor.read(0).load == 0.1 and Counting.reads == 1  # the thread's first reading
    monitor.refresh()
    started = time.monotonic()
    reading = monitor.read(1)
    assert time.monotonic() - started < 5.0, "waited for the next poll"
    assert reading.load == 0.1 and not reading.errors and Counting.reads == 2


def test_the_largest_signal_wins_and_a_pause_closes_the_gate() -> None:
    class Fixed:
        def __init__(self, name: str, load: float) -> None:
            self.name, self.load = name, load

        def read(self, at: float) -> float:
            return self.load

    pause = PauseState()
    monitor = LoadMonitor([Fixed("a", 0.1), Fixed("b", 0.2)], pause=lambda: pause)
    gate = Gate(0.3, 0.6)
    reading = monitor.read(0)
    assert reading.load == 0.2 and reading.parts == {"a": 0.1, "b": 0.2}
    assert gate.update(reading)
    pause = PauseState(paused=True, reason="maintenance")
    assert not gate.update(monitor.read(0)) and not gate.hard_paused
    assert "maintenance" in gate.reason
    pause = PauseState(paused=True, hard=True)
    gate.update(monitor.read(0))
    assert gate.hard_paused
    pause = PauseState()
    assert gate.update(monitor.read(0))  # resumed, and the load is low


def test_off_peak_windows_in_a_time_zone() -> None:
    berlin = ZoneInfo("Europe/Berlin")

    def at(*args: int) -> float:
        return datetime(*args, tzinfo=berlin).timestamp()

    nightly = ScheduleSignal(["mon-fri 22:00-06:00", "sat-sun 00:00-24:00"], "Europe/Berlin")
    assert nightly.read(at(2026, 6, 3, 23, 30)) == 0.0  # a Wednesday night
    assert nightly.read(at(2026, 6, 4, 5, 59)) == 0.0  # ... until 06:00 Thursday
    assert nightly.read(at(2026, 6, 4, 6, 0)) == 1.0
    assert nightly.read(at(2026, 6, 4, 14, 0)) == 1.0
    assert nightly.read(at(2026, 6, 6, 14, 0)) == 0.0  # Saturday afternoon
    assert nightly.read(at(2026, 6, 8, 5, 0)) == 1.0  # Monday 05:00: Sunday has no night window
    # The same instant is 21:30 UTC, outside a 22:00 UTC window.
    assert ScheduleSignal(["22:00-06:00"], "UTC").read(at(2026, 6, 3, 23, 30)) == 1.0
    for bad in ("22:00", "25:00-06:00", "xyz 22:00-06:00", "06:00-06:00"):
        with pytest.raises(ValueError):
            parse_window(bad)


def test_nvml_is_gracefully_absent_without_a_gpu() -> None:
    signal = NvmlSignal()
    assert signal.unavailable  # no nvidia-ml-py here, or no driver
    with pytest.raises(SignalError):
        signal.read(0)
    gate = Gate(0.3, 0.6, on_error="ignore")
    assert gate.update(LoadMonitor([signal]).read(0))  # configured to ignore: work goes on


def test_nvml_counts_other_processes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    me = os.getpid()
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=80e9),
        nvmlDeviceGetComputeRunningProcesses=lambda h: [
            types.SimpleNamespace(pid=me, usedGpuMemory=40e9),  # the batch engine itself
            types.SimpleNamespace(pid=1, usedGpuMemory=20e9),  # the real-time server
        ],
        nvmlDeviceGetProcessUtilization=lambda h, since: [
            types.SimpleNamespace(pid=me, smUtil=90, timeStamp=5),
            types.SimpleNamespace(pid=1, smUtil=30, timeStamp=6),
        ],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    signal = NvmlSignal(utilization_weight=1.0, memory_weight=1.0, own_pids=lambda: {me})
    assert signal.unavailable is None
    assert signal.read(0) == pytest.approx(0.30 + 0.25)


def test_build_signals_from_settings() -> None:
    policy = SchedulerSettings.model_validate(
        {
            "load_signals": ["prometheus", "schedule", "idle"],
            "prometheus": {"url": "http://rt:8000/metrics"},
            "schedule": {"windows": ["sat-sun 00:00-24:00"], "timezone": "Asia/Tokyo"},
        }
    )
    signals = build_signals(policy)
    assert [s.name for s in signals] == ["prometheus", "schedule", "idle"]
    with pytest.raises(ValueError):
        SchedulerSettings(low_water=0.7, high_water=0.6)


def test_reading_is_json_safe() -> None:
    reading = LoadReading(at=1.0, load=float("inf"), parts={"x": float("inf")})
    assert reading.as_json()["load"] is None and reading.as_json()["parts"] == {"x": None}
