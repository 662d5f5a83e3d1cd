"""``workers.runner.claim_ahead``: up to ``depth`` claims at a time on threads of their own;
``take`` returns the oldest only once done (or waits for it), with the limit it asked for, and
re-raises its failure. The runner's use of it runs against the real database in
tests/integration/test_scheduler.py."""

from __future__ import annotations

import threading
import time

import pytest

from storage.repositories.requests import ClaimedRequest
from workers.runner.claim_ahead import ClaimAhead


def test_take_returns_a_claim_only_once_it_is_done() -> None:
    gate = threading.Event()
    row = ClaimedRequest(1, "batch_x", "r1", "{}", 1)

    def claim() -> list[ClaimedRequest]:
        assert gate.wait(30)
        return [row]

    ahead = ClaimAhead()
    assert ahead.take(wait=False) is None and not ahead.busy
    ahead.start(claim, 64)
    assert ahead.busy and ahead.take(wait=False) is None  # in flight: nothing yet
    with pytest.raises(AssertionError):
        ahead.start(claim, 64)  # one at a time
    gate.set()
    assert ahead.take(wait=True) == ([row], 64)
    assert not ahead.busy and ahead.take(wait=True) is None


def test_a_failed_claim_is_raised_on_the_taking_thread() -> None:
    def claim() -> list[ClaimedRequest]:
        raise RuntimeError("the claim broke")

    ahead = ClaimAhead()
    ahead.start(claim, 8)
    with pytest.raises(RuntimeError, match="the claim broke"):
        ahead.take(wait=True)
    assert not ahead.busy


def test_two_claims_in_flight_are_taken_in_the_order_they_started() -> None:
    """At ``depth`` 2 (an engine that empties every step) a second claim starts beside the
    first; the younger finishing first is still taken second, and a third must wait."""
    gates = [threading.Event(), threading.Event()]
    rows = [ClaimedRequest(i, "batch_x", f"r{i}", "{}", 1) for i in (1, 2)]

    def claim(i: int) -> list[ClaimedRequest]:
        assert gates[i].wait(30)
        return [rows[i]]

    ahead = ClaimAhead()
    ahead.depth = 2
    ahead.start(lambda: claim(0), 8)
    assert not ahead.busy
    ahead.start(lambda: claim(1), 16)
    assert ahead.busy and ahead.in_flight == 2
    with pytest.raises(AssertionError):
        ahead.start(lambda: claim(0), 4)
    gates[1].set()
    time.sleep(0.05)
    assert ahead.take(wait=False) is None  # the younger is done, the older is not
    gates[0].set()
    assert ahead.take(wait=True) == ([rows[0]], 8)
    assert ahead.take(wait=True) == ([rows[1]], 16)
    assert ahead.in_flight == 0 and ahead.take(wait=True) is None
