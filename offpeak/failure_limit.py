"""A batch's breaker (``failure_limit``, an Offpeak extension of batch create): once at least
``after_lines`` of its lines have ended and more than ``fraction`` of those failed, the batch
stops. Its lines not run yet are cancelled and it ends ``failed``, with an ``errors.data``
entry (``error_entry``) in OpenAI's shape; only the lines that ran are billed.

The rule (``exceeded``) is checked where lines end: in the runner's write-back transaction,
against the batch's counters that the same transaction advanced
(``storage.repositories.batches.TRIP_FAILURE_LIMITS``, the same rule in SQL), and once: it moves
the batch out of ``in_progress``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

#: ``errors.data[].code`` of a batch its breaker stopped.
FAILURE_LIMIT_EXCEEDED = "failure_limit_exceeded"


class FailureLimit(BaseModel):
    """``{"fraction": 0.2, "after_lines": 100}``: stop once more than ``fraction`` (0–1) of
    the ended lines failed, judged from ``after_lines`` ended lines on."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fraction: float = Field(
        gt=0, lt=1, description="Failed share of ended lines, above which the batch stops."
    )
    after_lines: int = Field(ge=1, description="Ended lines before the share is judged.")


def exceeded(ended: int, failed: int, limit: FailureLimit | None) -> bool:
    """Whether ``failed`` of ``ended`` lines trip ``limit``: at least ``after_lines`` ended and
    ``failed > fraction × ended``."""
    if limit is None or ended < limit.after_lines:
        return False
    return failed > limit.fraction * ended


def error_entry(limit: FailureLimit, ran: int, failed: int, cancelled: int) -> dict[str, Any]:
    """The batch's ``errors.data`` entry once its breaker stopped it: ``failed`` of the ``ran``
    lines that ran failed; ``cancelled`` lines were not run."""
    return {
        "code": FAILURE_LIMIT_EXCEEDED,
        "message": (
            f"The batch stopped: {failed:,} of the {ran:,} lines that ran failed, more than its "
            f"failure_limit allows ({limit.fraction:.0%} once {limit.after_lines:,} lines "
            f"have ended). {cancelled:,} lines not run were cancelled (error code "
            "batch_cancelled in the error file); only the lines that ran are billed."
        ),
        "param": "failure_limit",
        "line": None,
    }
