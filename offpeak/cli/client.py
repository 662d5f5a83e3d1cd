"""Client-side helpers for the CLI, written against the official ``openai`` SDK only, exactly as
a user's own code would talk to Offpeak."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from openai import APIError, OpenAI
from openai.types import Batch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from offpeak.statuses import BatchStatus

#: Seconds between two reads of ``/healthz`` while waiting (each may warn once).
HEALTH_EVERY_SECONDS = 10.0


def first_url(path: Path) -> str:
    """The ``url`` of the file's first request line (the batch's endpoint); chat completions
    when it has none or is not a JSON object (validation then says what is wrong with it)."""
    with path.open("rb") as handle:
        for raw in handle:
            raw = raw.strip().removeprefix(b"\xef\xbb\xbf")
            if raw:
                try:
                    url = orjson.loads(raw).get("url")
                except (orjson.JSONDecodeError, AttributeError):
                    url = None
                return url if isinstance(url, str) and url else "/v1/chat/completions"
    return "/v1/chat/completions"


def first_model(path: Path) -> str | None:
    """The ``body.model`` of the file's first request line, or None if it has none."""
    with path.open("rb") as handle:
        for raw in handle:
            raw = raw.strip().removeprefix(b"\xef\xbb\xbf")
            if raw:
                try:
                    model = orjson.loads(raw).get("body", {}).get("model")
                except (orjson.JSONDecodeError, AttributeError):
                    return None
                return model if isinstance(model, str) else None
    return None


def health(client: OpenAI) -> dict[str, Any] | None:
    """The server's ``/healthz`` answer (next to the ``/v1`` base URL), through the SDK's own
    HTTP client; None when it does not answer it (an older server, a proxy, a network fault):
    a health read is advice and must never fail the caller."""
    base = client.base_url
    root = base.path.rstrip("/").removesuffix("/v1")
    url = str(base.copy_with(path=f"{root}/healthz", query=None))
    try:
        answer = client.get(url, cast_to=object, options={"max_retries": 0, "timeout": 5.0})
    except (APIError, OSError):
        return None
    return answer if isinstance(answer, dict) else None


def liveness_warnings(answer: dict[str, Any], model: str | None) -> dict[str, str]:
    """What a ``/healthz`` answer means for a batch of ``model``: ``{"engine": message}`` when no
    live engine worker serves it, ``{"control": message}`` when no control worker is alive."""
    out: dict[str, str] = {}
    if answer.get("database") != "ok":
        return out  # nothing is known about the workers
    for row in answer.get("models") or []:
        if model is not None and row.get("model") == model and not row.get("engine_workers"):
            message = row.get("message") or f"no engine worker serving {model}"
            out["engine"] = f"{message}; the batch waits until one runs (`offpeak worker`)"
    roles = [str(w.get("role", "")).split(",") for w in answer.get("workers") or []]
    if not any("control" in r for r in roles):
        out["control"] = (
            "no control worker is alive; the batch is not validated or finalized until one "
            "runs (`offpeak worker --role control`)"
        )
    return out


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


def wait_with_progress(
    client: OpenAI,
    batch_id: str,
    console: Console,
    poll: float = 1.0,
    *,
    model: str | None = None,
    warn: Callable[[str], None] | None = None,
) -> Batch:
    """Poll until the batch ends, with a progress bar of finished request lines, output
    tokens/s since the first poll and the time left at the current pace (ETA).

    With ``warn``, reads ``/healthz`` every ``HEALTH_EVERY_SECONDS`` while the batch runs and
    calls ``warn`` (once per kind) when no live engine worker serves the batch's model (the
    server's, else ``model``) or no control worker is alive. It never fails the wait."""
    warned: set[str] = set()
    next_health = 0.0
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(batch_id, total=None, detail="")
        started = time.monotonic()
        first_tokens: int | None = None
        while True:
            batch = client.batches.retrieve(batch_id)
            counts = batch.request_counts
            done = (counts.completed + counts.failed) if counts else 0
            tokens = batch.usage.output_tokens if batch.usage else 0
            # Tokens since the first poll: a batch already half done when we attach would
            # otherwise show an inflated rate.
            first_tokens = tokens if first_tokens is None else first_tokens
            rate = (tokens - first_tokens) / max(time.monotonic() - started, 1e-9)
            progress.update(
                task,
                total=(counts.total or None) if counts else None,
                completed=done,
                detail=f"{batch.status} · {tokens} output tokens · {rate:.0f} tok/s",
            )
            if batch.status in BatchStatus.FINAL:
                return _billed(client, batch, poll)
            if warn is not None and time.monotonic() >= next_health:
                next_health = time.monotonic() + HEALTH_EVERY_SECONDS
                answer = health(client)
                batch_model = getattr(batch, "model", None) or model
                for kind, message in liveness_warnings(answer or {}, batch_model).items():
                    if kind not in warned:
                        warned.add(kind)
                        warn(message)
            time.sleep(poll)


def _billed(client: OpenAI, batch: Batch, poll: float, tries: int = 10) -> Batch:
    """The ended batch once its bill is written (Offpeak bills right after the final status
    commits), so the summary shows the price billed rather than the estimate; gives up after
    ``tries`` polls (another server, or billing left to the sweep)."""
    extra = batch.model_extra or {}
    for _ in range(tries):
        if "billed_at" not in extra or extra["billed_at"] is not None:
            break
        time.sleep(min(poll, 0.5))
        batch = client.batches.retrieve(batch.id)
        extra = batch.model_extra or {}
    return batch


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
    rows.extend(_money_rows(batch))
    for error in (batch.errors.data if batch.errors and batch.errors.data else [])[:10]:
        rows.append(("error", f"line {error.line}: {error.code}: {error.message}"))
    for key, value in rows:
        table.add_row(key, str(value) if value is not None else "-")
    console.print(table)


def _usd(amount: float | None) -> str | None:
    if amount is None:
        return None
    return f"${amount:.2f}" if abs(amount) >= 1 else f"${amount:.6g}"


def _money_rows(batch: Batch) -> list[tuple[str, Any]]:
    """Offpeak's extra Batch fields (the SDK keeps them): GPU-seconds, cost, price, saving."""
    extra = batch.model_extra or {}
    if extra.get("gpu_seconds") is None:
        return []
    final = "billed" if extra.get("billed_at") else "estimate so far"
    per_million = extra.get("cost_per_million_tokens")
    return [
        ("GPU-seconds", f"{extra['gpu_seconds']:.3f}"),
        (
            "cost",
            f"{_usd(extra.get('cost'))} ({_usd(per_million) or '-'} per 1M tokens)",
        ),
        ("price", f"{_usd(extra.get('price'))} ({final})"),
        (
            "saving",
            f"{_usd(extra.get('saving'))} vs {_usd(extra.get('realtime_price'))} real-time",
        ),
    ]


def usage(
    client: OpenAI, start: int | None, end: int | None, group_by: str | None
) -> dict[str, Any]:
    """``GET /v1/usage`` through the SDK's own HTTP client (same base URL, key and retries)."""
    wanted: dict[str, object] = {"start": start, "end": end, "group_by": group_by}
    params = {k: v for k, v in wanted.items() if v}
    report = client.get("/usage", cast_to=object, options={"params": params})
    assert isinstance(report, dict)
    return report


def print_usage(report: dict[str, Any], console: Console) -> None:
    """The usage report as a table, one row per group and a total."""
    group = report.get("group_by")
    table = Table(title=f"usage ({report.get('currency', 'usd').upper()})")
    columns = ["batches", "requests", "input tokens", "output tokens", "GPU-s", "cost", "price"]
    for name in ([group] if group else []) + [*columns, "saving"]:
        table.add_column(name, justify="left" if name == group else "right")

    def cells(row: dict[str, Any]) -> list[str]:
        return [
            f"{row['batches']:,}",
            f"{row['requests']:,}",
            f"{row['input_tokens']:,}",
            f"{row['output_tokens']:,}",
            f"{row['gpu_seconds']:.2f}",
            _usd(row["cost"]) or "-",
            _usd(row["price"]) or "-",
            _usd(row["saving"]) or "-",
        ]

    for row in report["data"]:
        label = [str(row.get(group) or "-")] if group else []
        table.add_row(*label, *cells(row))
    table.add_row(*(["total"] if group else []), *cells(report["total"]), style="bold")
    console.print(table)


class NoOutputError(Exception):
    """The batch has neither an output nor an error file (yet): ``status`` says why."""

    def __init__(self, batch_id: str, status: str) -> None:
        super().__init__(f"batch {batch_id} is {status}: it has no output or error file yet")
        self.status = status


def download(client: OpenAI, batch_id: str, output: Path) -> list[Path]:
    """Write the output file to ``output`` and the error file to ``<stem>.errors.jsonl``;
    returns the paths written. Raises ``NoOutputError`` when the batch has neither file."""
    batch = client.batches.retrieve(batch_id)
    if not batch.output_file_id and not batch.error_file_id:
        raise NoOutputError(batch_id, batch.status)
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
