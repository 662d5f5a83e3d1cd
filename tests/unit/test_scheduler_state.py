"""``offpeak.scheduler_state``: the one parser of the ``scheduler_state`` keys and values that
the admin switch, the workers, ``/metrics`` and the dashboard share."""

from __future__ import annotations

import pytest

from offpeak import scheduler_state as state
from offpeak.scheduler_state import PauseState, PauseSwitch, StateKey


@pytest.mark.parametrize(
    ("key", "parsed"),
    [
        ("paused", StateKey("pause", "*")),
        ("paused:gpu-a", StateKey("pause", "gpu-a")),
        ("paused:with:colons", StateKey("pause", "with:colons")),
        ("load:gpu-a", StateKey("load", "gpu-a")),
        ("pausedx", None),
        ("other", None),
    ],
)
def test_keys_parse_back_to_their_pool(key: str, parsed: StateKey | None) -> None:
    assert state.parse_key(key) == parsed
    if parsed is not None:
        make = state.pause_key if parsed.kind == "pause" else state.load_key
        assert make(parsed.pool) == key


def test_every_pool_is_one_key() -> None:
    assert {state.pause_key(p) for p in (None, "", "*")} == {state.PAUSE_ALL_KEY}


def test_pause_for_joins_every_pool_and_own_pool() -> None:
    states = {
        "paused": state.pause_value(False, "deploy", 1.0),
        "paused:a": state.pause_value(True, "GPU swap", 2.0),
        "paused:b": {"paused": False},
    }
    assert state.pause_for(states, "a") == PauseState(True, True, "deploy; GPU swap")
    assert state.pause_for(states, "b") == PauseState(True, False, "deploy")
    assert state.pause_for({"paused:b": True}, "b") == PauseState(True, False, None)
    assert state.pause_for({"paused:a": {"paused": True}}, "b") == PauseState()


def test_pauses_and_loads_read_every_pool() -> None:
    states = {
        "paused:a": {"paused": True},
        "load:a": {"load": 0.5},
        "load:b": {"load": None},
        "unrelated": 1,
    }
    assert state.pauses(states) == {"*": False, "a": True}
    assert state.loads(states) == {"a": 0.5, "b": None}


def test_a_switch_reads_from_any_stored_value() -> None:
    assert PauseSwitch.of("a", state.pause_value(True, "why", 3.0), 3.0) == PauseSwitch(
        "a", True, True, "why", 3.0
    )
    assert PauseSwitch.of("*", True, None) == PauseSwitch("*", True, False, None, None)
