"""The breaker's bound (``offpeak.failure_limit``): when a batch's failed lines stop it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from offpeak.failure_limit import FailureLimit, error_entry, exceeded

LIMIT = FailureLimit(fraction=0.2, after_lines=100)


@pytest.mark.parametrize(
    ("ended", "failed", "tripped"),
    [
        (99, 99, False),  # not judged before after_lines lines have ended
        (100, 20, False),  # exactly at the bound: not past it
        (100, 21, True),
        (1000, 200, False),
        (1000, 201, True),
        (0, 0, False),
    ],
)
def test_the_bound_is_judged_after_enough_lines_and_must_be_passed(
    ended: int, failed: int, tripped: bool
) -> None:
    assert exceeded(ended, failed, LIMIT) is tripped


def test_no_limit_never_trips() -> None:
    assert not exceeded(10_000, 10_000, None)


@pytest.mark.parametrize(
    "fields",
    [
        {"fraction": 0, "after_lines": 1},
        {"fraction": 1, "after_lines": 1},
        {"fraction": 0.5, "after_lines": 0},
        {"fraction": 0.5},
        {"fraction": 0.5, "after_lines": 1, "unknown": True},
    ],
)
def test_a_limit_out_of_range_is_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        FailureLimit.model_validate(fields)


def test_the_errors_entry_says_what_happened_in_openais_shape() -> None:
    entry = error_entry(LIMIT, ran=150, failed=40, cancelled=850)
    assert set(entry) == {"code", "message", "param", "line"}
    assert entry["code"] == "failure_limit_exceeded" and entry["param"] == "failure_limit"
    assert "40 of the 150 lines that ran failed" in entry["message"]
    assert "20% once 100 lines" in entry["message"] and "850 lines not run" in entry["message"]
