"""The statuses of a batch and of a request line, as stored and as OpenAI's Batch API shows them.

Both are ``StrEnum``s: a member *is* its string (``BatchStatus.IN_PROGRESS == "in_progress"``,
same hash), so it goes into SQL, JSON and pydantic models unchanged and compares equal to a
status read back from the database.

A batch (OpenAI's lifecycle, https://platform.openai.com/docs/guides/batch):
``validating`` → ``in_progress`` → ``finalizing`` → ``completed``, or ``failed`` (the input did
not validate), ``expired`` (its completion window ended first), ``cancelling`` → ``cancelled``.
A request line: ``pending`` → ``running`` (leased by an engine worker) → ``succeeded`` or
``failed``; lines that never ran end ``cancelled`` or ``expired`` with their batch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar


class BatchStatus(StrEnum):
    """A batch's ``status``. ``FINAL``: the statuses after which nothing changes (and after
    which the batch is billed)."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    FINAL: ClassVar[tuple[BatchStatus, ...]]

    @property
    def is_final(self) -> bool:
        return self in BatchStatus.FINAL


BatchStatus.FINAL = (
    BatchStatus.COMPLETED,
    BatchStatus.FAILED,
    BatchStatus.EXPIRED,
    BatchStatus.CANCELLED,
)


class LineStatus(StrEnum):
    """A request line's ``status``. ``UNFINISHED``: not ended yet; ``ENDED``: the statuses a line
    ends in (every one but ``succeeded`` counts as ``failed`` in ``request_counts``)."""

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    UNFINISHED: ClassVar[tuple[LineStatus, ...]]
    ENDED: ClassVar[tuple[LineStatus, ...]]


LineStatus.UNFINISHED = (LineStatus.PENDING, LineStatus.RUNNING)
LineStatus.ENDED = (
    LineStatus.SUCCEEDED,
    LineStatus.FAILED,
    LineStatus.CANCELLED,
    LineStatus.EXPIRED,
)
