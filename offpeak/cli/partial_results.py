"""A batch's results as they end, appended to a local file: ``offpeak watch --results FILE``
and ``offpeak download --partial``, through ``GET /v1/batches/{id}/results`` (an Offpeak
extension). Each line is written as the batch's output or error file holds it; a run that
stops (Ctrl-C, a lost connection) resumes after the last line in the file."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
from openai import OpenAI

from offpeak.statuses import BatchStatus

#: Lines asked for per page (the server's most).
PAGE_LINES = 1000
#: Bytes read back from a file's end to find its last line (lines can be long: embeddings).
_TAIL_STEP = 64 * 1024


def last_line_id(path: Path) -> str | None:
    """The ``id`` of the last complete line of ``path`` (``None`` for a missing or empty file).
    A last line cut short (a write interrupted) is dropped from the file, so appending
    resumes on a line boundary."""
    if not path.exists():
        return None
    with path.open("rb+") as handle:
        size = handle.seek(0, os.SEEK_END)
        tail, start = b"", size
        while start > 0:
            start = max(0, start - _TAIL_STEP)
            handle.seek(start)
            tail = handle.read(size - start)
            if tail.count(b"\n") >= 2 or start == 0:
                break
        if not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n")
            handle.truncate(start + cut + 1 if cut >= 0 else 0)
            tail = tail[: cut + 1] if cut >= 0 else b""
        lines = tail.rstrip(b"\n").split(b"\n")
        return str(orjson.loads(lines[-1])["id"]) if lines and lines[-1] else None


def count_lines(path: Path) -> int:
    """Complete lines in ``path``, read a block at a time."""
    if not path.exists():
        return 0
    count = 0
    with path.open("rb") as handle:
        while block := handle.read(1 << 20):
            count += block.count(b"\n")
    return count


def results_page(client: OpenAI, batch_id: str, after: str | None) -> dict[str, Any]:
    """One page of the batch's ended lines after the line ``after``."""
    params: dict[str, Any] = {"limit": PAGE_LINES} | ({"after": after} if after else {})
    page = client.get(f"/batches/{batch_id}/results", cast_to=object, options={"params": params})
    assert isinstance(page, dict)
    return page


def append_ready(client: OpenAI, batch_id: str, path: Path) -> int:
    """Append to ``path`` every line of the batch readable now after the last one it holds;
    returns how many were appended."""
    after = last_line_id(path)
    added = 0
    with path.open("ab") as out:
        while True:
            page = results_page(client, batch_id, after)
            if page["data"]:
                out.write(b"".join(orjson.dumps(line) + b"\n" for line in page["data"]))
                out.flush()
                added += len(page["data"])
                after = page["last_id"]
            if not page["has_more"]:
                return added


def complete(client: OpenAI, batch_id: str, path: Path) -> bool:
    """Whether ``path`` holds every line of the batch: it has ended and the file has as many
    lines as its ``request_counts.total``."""
    batch = client.batches.retrieve(batch_id)
    total = batch.request_counts.total if batch.request_counts else 0
    return batch.status in BatchStatus.FINAL and count_lines(path) >= total
