"""``workers.runner.claim_ahead``: one claim at a time on its own thread; ``take`` returns it
only once done (or waits for it), with the limit it asked for, and re-raises its failure. The
runner's use of it runs against the real database in tests/test_scheduler.py."""

from __future__ import annotations

import threading

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
