"""The remote engine's ``ServerMeter`` reading by reading, on fixed clocks.

Which intervals count decides what a co-served batch is charged: every interval in which one of
our requests was at the server, plus one after (the server bumps its counters after answering),
and nothing else. ``tests/e2e/engines/test_engine_remote.py`` checks the same against a real
server, where the readings' times are the server's and the machine's.
"""

from __future__ import annotations

from workers.engine.remote_meter import ServerMeter, ServerUsage
from workers.vllm_metrics import ServerTokens


class Clock:
    """A meter whose ``busy()`` and readings the test drives: ``read(at, busy, generated)``."""

    def __init__(self) -> None:
        self.busy = False
        self.meter = ServerMeter("http://unused/metrics", 1.0, lambda: self.busy)

    def read(self, at: float, busy: bool, generated: float | None) -> ServerUsage:
        self.busy = busy
        tokens = None if generated is None else ServerTokens(generation=generated)
        self.meter.record(at, tokens)
        return self.meter.usage()


def test_idle_time_is_never_counted() -> None:
    clock = Clock()
    for at in range(6):
        usage = clock.read(at, busy=False, generated=10.0 * at)  # someone else's tokens
    assert usage == ServerUsage()


def test_the_intervals_of_our_work_and_one_after_count() -> None:
    """Work from t=1.5 to t=3.5 with readings every second: [1, 4] holds it and [4, 5] is the
    tail in which the last step's tokens may still land; [0, 1] and [5, 6] are idle."""
    clock = Clock()
    clock.read(0, busy=False, generated=0)
    clock.read(1, busy=False, generated=5)
    clock.meter.mark_busy()  # a request sent at t=1.5
    clock.read(2, busy=True, generated=20)
    clock.read(3, busy=True, generated=40)
    clock.read(4, busy=False, generated=55)  # it finished at t=3.5
    tail = clock.read(5, busy=False, generated=60)
    assert tail == ServerUsage(4.0, ServerTokens(generation=55.0))
    assert clock.read(6, busy=False, generated=70) == tail
    assert clock.read(7, busy=False, generated=80) == tail


def test_a_request_shorter_than_an_interval_still_counts() -> None:
    """Sent and answered between two readings: ``busy()`` is false at both, ``mark_busy`` is
    what makes its interval (and the tail) count."""
    clock = Clock()
    clock.read(0, busy=False, generated=0)
    clock.meter.mark_busy()
    clock.read(1, busy=False, generated=7)
    tail = clock.read(2, busy=False, generated=8)
    assert tail == ServerUsage(2.0, ServerTokens(generation=8.0))
    assert clock.read(3, busy=False, generated=9) == tail


def test_a_failed_read_counts_its_gap_with_the_next_good_one() -> None:
    clock = Clock()
    clock.read(0, busy=False, generated=0)
    clock.meter.mark_busy()
    assert clock.read(1, busy=True, generated=None) == ServerUsage()
    assert clock.meter.failures == 1
    usage = clock.read(3, busy=True, generated=30)
    assert usage == ServerUsage(3.0, ServerTokens(generation=30.0))
    assert clock.meter.failures == 0


def test_late_readings_count_their_real_length() -> None:
    """A reading that comes late (the server or this machine busy) counts the seconds since the
    last one, not the nominal interval: busy seconds are bounded by the readings' own times."""
    clock = Clock()
    clock.read(0, busy=False, generated=0)
    clock.meter.mark_busy()
    clock.read(2.7, busy=True, generated=10)
    clock.read(3.1, busy=False, generated=12)
    usage = clock.read(5.0, busy=False, generated=13)
    assert usage.busy_seconds == 5.0
    assert clock.read(6.0, busy=False, generated=14) == usage


def test_a_restarted_server_counts_from_zero() -> None:
    clock = Clock()
    clock.read(0, busy=False, generated=100)
    clock.meter.mark_busy()
    clock.read(1, busy=True, generated=130)
    usage = clock.read(2, busy=True, generated=12)  # the counters began again at 0
    assert usage.tokens == ServerTokens(generation=42.0)
