"""The scheduler state's stored values, read leniently."""

from __future__ import annotations

import pytest

from offpeak.scheduler_state import load_of, paused_of


@pytest.mark.parametrize(
    ("stored", "load", "paused"),
    [
        (0.5, 0.5, True),
        ({"value": 0.25}, 0.25, True),
        ({"load": "high"}, None, False),
        (True, None, True),
        ({"paused": False}, None, False),
        (None, None, False),
    ],
)
def test_scheduler_state_values_are_read_leniently(
    stored: object, load: float | None, paused: bool
) -> None:
    assert load_of(stored) == load
    assert paused_of(stored) is paused
