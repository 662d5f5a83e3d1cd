"""Client-side helpers for the CLI, written against the official ``openai`` SDK only, exactly as
a user's own code would talk to Offpeak."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson
from openai import OpenAI
from openai.types import Batch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

ENDED = ("completed", "failed", "expired", "cancelled")


def first_url(path: Path) -> str:
    """The ``url`` of the file's first request line (the batch's endpoint)."""
    with path.open("rb") as handle:
        for raw in handle:
            raw = raw.strip().removeprefix(b"\xef\xbb\xbf")
            if raw:
                return str(orjson.loads(raw).get("url") or "/v1/chat/completions")
    return "/v1/chat/completions"


def submit(
    client: OpenAI,
    path: Path,
    endpoint: str | None,
    window: str,
    metadata: dict[str, str] | None = None,
) -> Batch:
    with path.open("rb") as handle:
        file = client.files.create(file=(path.name, handle), purpose="batch")
    return client.batches.create(
        input_file_id=file.id,
        endpoint=endpoint or first_url(path),  # type: ignore[arg-type]
        completion_window=window,  # type: ignore[arg-type]
        metadata=metadata,
    )


def wait_with_progress(client: OpenAI, batch_id: str, console: Console, poll: float = 1.0) -> Batch:
    """Poll until the batch ends, with a progress bar of finished request lines."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(batch_id, total=None, detail="")
        started = time.monotonic()
        while True:
            batch = client.batches.retrieve(batch_id)
            counts = batch.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            tokens = batch.usage.output_tokens if batch.usage else 0
            rate = tokens / max(time.monotonic() - started, 1e-9)
            progress.update(
                task,
                total=(counts.total or None) if counts else None,
                completed=done,
                detail=f"{batch.status} · {tokens} output tokens · {rate:.0f} tok/s",
            )
            if batch.status in ENDED:
                return batch
            time.sleep(poll)


def print_summary(batch: Batch, console: Console) -> None:
    table = Table(title=f"batch {batch.id}", show_header=False)
    counts, usage = batch.request_counts, batch.usage
    rows: list[tuple[str, Any]] = [
        ("status", batch.status),
        ("model", getattr(batch, "model", None)),
        ("endpoint", batch.endpoint),
        (
            "requests",
            f"{counts.total} total, {counts.completed} completed, {counts.failed} failed"
            if counts
            else "-",
        ),
        (
            "tokens",
            f"{usage.input_tokens} in ({usage.input_tokens_details.cached_tokens} cached), "
            f"{usage.output_tokens} out"
            if usage
            else "-",
        ),
        ("output_file_id", batch.output_file_id),
        ("error_file_id", batch.error_file_id),
    ]
    for error in (batch.errors.data if batch.errors and batch.errors.data else [])[:10]:
        rows.append(("error", f"line {error.line}: {error.code}: {error.message}"))
    for key, value in rows:
        table.add_row(key, str(value) if value is not None else "-")
    console.print(table)


def download(client: OpenAI, batch_id: str, output: Path) -> list[Path]:
    """Write the output file to ``output`` and the error file to ``<stem>.errors.jsonl``."""
    batch = client.batches.retrieve(batch_id)
    written = []
    targets = (
        (batch.output_file_id, output),
        (batch.error_file_id, output.with_name(f"{output.stem}.errors.jsonl")),
    )
    for file_id, path in targets:
        if file_id:
            client.files.content(file_id).write_to_file(path)
            written.append(path)
    return written


def read_lines(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if not file_id:
        return []
    text = client.files.content(file_id).text
    return [orjson.loads(line) for line in text.splitlines() if line.strip()]
