"""A finished request row as its line in the batch's output or error file: what finalize
writes and what ``GET /v1/batches/{id}/results`` shows while the batch runs, byte for byte.

- ``succeeded``: the output file, rendered from its record (``openai_line``).
- ``failed``: the error file, its error rendered the same way.
- ``cancelled`` / ``expired`` (never ran, nothing stored): the error file, an error line whose
  ``id`` is derived from the batch and the ``custom_id`` (``wire.derived_id``), so writing it
  again writes the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import orjson

from offpeak import wire
from offpeak.endpoints import record_line, records
from offpeak.statuses import LineStatus

#: ``(error.code, error.message)`` of a line that never ran, by its status.
NEVER_RAN: dict[str, tuple[str, str]] = {
    LineStatus.CANCELLED: (
        wire.BATCH_CANCELLED,
        "This request was not run because the batch was cancelled.",
    ),
    LineStatus.EXPIRED: (
        wire.BATCH_EXPIRED,
        "This request could not be executed before the completion window expired.",
    ),
}


@dataclass(frozen=True)
class BatchLine:
    """A line of the batch's ``file`` (``output`` or ``error``): its ``id`` (``batch_req_…``)
    and its JSON bytes, no newline."""

    file: Literal["output", "error"]
    id: str
    json: bytes


def batch_line(batch_id: str, custom_id: str, status: str, result: str | None) -> BatchLine | None:
    """The file line of a row of ``batch_id`` in ``status`` with its stored ``result``;
    ``None`` for a row not ended (pending or running) and for a succeeded row with nothing
    stored. Raises ``LineError`` for a record of an endpoint no longer served,
    ``pydantic.ValidationError`` for a damaged record."""
    if status == LineStatus.SUCCEEDED or (status == LineStatus.FAILED and result):
        if not result:
            return None
        file: Literal["output", "error"] = "output" if status == LineStatus.SUCCEEDED else "error"
        record = records.load(result)
        if record is None:  # stored already rendered, before records
            return BatchLine(file, _rendered_id(result), result.encode())
        return BatchLine(file, record.line_id, record_line(custom_id, record))
    if status in NEVER_RAN:
        line_id = never_ran_line_id(batch_id, custom_id)
        code, message = NEVER_RAN[status]
        return BatchLine(
            "error", line_id, wire.never_ran_line(custom_id, code, message, line_id=line_id)
        )
    return None


def never_ran_line_id(batch_id: str, custom_id: str) -> str:
    """The ``id`` of the error line of a request of ``batch_id`` that never ran."""
    return wire.derived_id("batch_req_", batch_id, custom_id)


def _rendered_id(line: str) -> str:
    """The ``id`` of a line stored already rendered; ``""`` when it has none."""
    try:
        parsed = orjson.loads(line)
    except orjson.JSONDecodeError:
        return ""
    return str(parsed.get("id") or "") if isinstance(parsed, dict) else ""
