"""Client-side helpers for the CLI, written against the official ``openai`` SDK only, exactly as
a user's own code would talk to Offpeak."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from rich import box
from rich.console import Console
from rich.table import Table

from offpeak.billing import format_usd
from offpeak.cli.tables import print_whole
from offpeak.statuses import BatchStatus

if TYPE_CHECKING:
    # Every ``offpeak`` process imports this module (``offpeak tenants`` formats with it); the
    # SDK is imported only by the commands that talk to a server.
    from openai import OpenAI
    from openai.types import Batch


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


def has_content(path: Path) -> bool:
    """Whether the file holds anything but whitespace (and a byte-order mark)."""
    with path.open("rb") as handle:
        return any(raw.strip().removeprefix(b"\xef\xbb\xbf").strip() for raw in handle)


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
    from openai import APIError

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
        if model is not None and row.get("model") == model and row.get("message"):
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


def _prefix_cache(usage: Any) -> str:
    """What the prefix cache saved (``usage``'s extension fields), as ``offpeak status`` shows
    it: the hit rate and prompt tokens computed against the least possible."""
    extra = (usage.model_extra or {}) if usage else {}
    if not usage or not usage.input_tokens or "prefix_cache_hit_rate" not in extra:
        return "-"
    text = (
        f"{100 * extra['prefix_cache_hit_rate']:.0f}% of prompt tokens cached; "
        f"{extra['prompt_tokens_computed']:,} computed"
    )
    least = extra.get("min_prompt_tokens")
    if least:
        text += f" ({extra['prompt_tokens_computed'] / least:.2f}x the least possible, {least:,})"
    return text


def eta_rows(batch: Batch, at: float | None = None) -> list[tuple[str, str]]:
    """``offpeak status``'s rows for a running batch's ``estimated_completion_at`` (local time
    and time left from ``at``, unix seconds) and its ``completion_warning``, if the server
    gives them (Offpeak extensions); none for an ended batch."""
    extra = batch.model_extra or {}
    eta = extra.get("estimated_completion_at")
    if batch.status in BatchStatus.FINAL:
        return []
    at = time.time() if at is None else at
    rows = []
    if eta is not None:
        left = max(int(eta - at), 0)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(eta))
        rows.append(("eta", f"{when} (in {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d})"))
    warning = extra.get("completion_warning")
    if warning:
        rows.append(("warning", str(warning.get("message", warning))))
    return rows


def print_summary(batch: Batch, console: Console) -> None:
    table = Table(title=f"batch {batch.id}", show_header=False)
    counts, usage = batch.request_counts, batch.usage
    paused_at = (batch.model_extra or {}).get("paused_at")
    status = batch.status
    if paused_at is not None and status not in BatchStatus.FINAL:
        status += " (paused: offpeak resume " + batch.id + ")"
    rows: list[tuple[str, Any]] = [
        ("status", status),
        ("model", getattr(batch, "model", None)),
        ("endpoint", batch.endpoint),
        (
            "requests",
            f"{counts.total:,} total, {counts.completed:,} completed, {counts.failed:,} failed"
            if counts
            else "-",
        ),
        (
            "tokens",
            f"{usage.input_tokens:,} in ({usage.input_tokens_details.cached_tokens:,} cached), "
            f"{usage.output_tokens:,} out"
            if usage
            else "-",
        ),
        ("prefix cache", _prefix_cache(usage)),
        ("output_file_id", batch.output_file_id),
        ("error_file_id", batch.error_file_id),
    ]
    rows.extend(_money_rows(batch))
    estimate = (batch.model_extra or {}).get("estimate")
    if estimate:
        rows.append(
            (
                "estimate",
                f"{estimate['prompt_tokens']:,} prompt tokens, up to "
                f"{estimate['max_completion_tokens']:,} completion tokens: "
                f"{format_usd(estimate['price_low'])} … {format_usd(estimate['price_high'])}",
            )
        )
    rows.extend(eta_rows(batch))
    for error in (batch.errors.data if batch.errors and batch.errors.data else [])[:10]:
        rows.append(("error", describe_error(error.line, error.code, error.message)))
    for key, value in rows:
        table.add_row(key, str(value) if value is not None else "-")
    console.print(table)


def describe_error(line: int | None, code: str | None, message: str | None) -> str:
    """One of a batch's ``errors.data`` for a person: the message first, its line when it has
    one, the code last (``The input file holds no request lines. (empty_file)``)."""
    where = f"line {line:,}: " if line is not None else ""
    said = message or code or "error"
    return f"{where}{said}" + (f" ({code})" if code and message else "")


def _money_rows(batch: Batch) -> list[tuple[str, Any]]:
    """Offpeak's extra Batch fields (the SDK keeps them): GPU-seconds, cost, price, saving."""
    extra = batch.model_extra or {}
    if extra.get("gpu_seconds") is None:
        return []
    final = "billed" if extra.get("billed_at") else "estimate so far"
    per_million = extra.get("cost_per_million_tokens")
    return [
        ("GPU-seconds", f"{extra['gpu_seconds']:.3f}"),
        ("cost", f"{format_usd(extra.get('cost'))} ({format_usd(per_million)} per 1M tokens)"),
        ("price", f"{format_usd(extra.get('price'))} ({final})"),
        (
            "saving",
            f"{format_usd(extra.get('saving'))} vs {format_usd(extra.get('realtime_price'))} "
            "real-time",
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


def limits(client: OpenAI) -> dict[str, Any]:
    """``GET /v1/limits``: the tenant's quotas and rate limit beside its use of them."""
    report = client.get("/limits", cast_to=object)
    assert isinstance(report, dict)
    return report


def queue(client: OpenAI) -> dict[str, Any]:
    """``GET /v1/queue``: the tenant's queue positions per model and its engine share."""
    report = client.get("/queue", cast_to=object)
    assert isinstance(report, dict)
    return report


def percent(fraction: float | None) -> str:
    """A share as a whole percentage (``-``: none)."""
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def print_queue(report: dict[str, Any], console: Console) -> None:
    """The tenant's queued lines per model with the lines of other tenants that will run before
    them, then its share of the engines against its entitled share."""
    table = Table(title="queue", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    table.add_column("model", no_wrap=True, overflow="ellipsis", max_width=30)
    for name in ("queued lines", "lines ahead", "of them urgent"):
        table.add_column(name, justify="right", no_wrap=True)
    for row in report["queue"]:
        table.add_row(row["model"], f"{row['queued_lines']:,}", f"{row['lines_ahead']:,}",
                      f"{row['urgent_lines_ahead']:,}")  # fmt: skip
    if not report["queue"]:
        table.add_row("(nothing queued)", "0", "0", "0")
    console.print(table)
    share = report["share"]
    console.print(
        f"engine share, last {share['window_seconds'] // 60} min: {percent(share['engine_share'])}"
        f" ({share['engine_seconds']:.1f} engine-s, {share['lines_finished']:,} lines);"
        f" entitled {percent(share['entitled_share'])} (weight {share['weight']:g})"
    )


def print_limits(report: dict[str, Any], console: Console) -> None:
    """The tenant's limits as a table: used of limit (``none``: no limit), one row each and
    one per model holding enqueued tokens."""
    table = Table(title="limits", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    table.add_column("", no_wrap=True)
    table.add_column("used", justify="right", no_wrap=True)
    table.add_column("limit", justify="right", no_wrap=True)

    def shown(limit: int | None) -> str:
        return "none" if limit is None else f"{limit:,}"

    tokens = report["enqueued_tokens"]
    limits = tokens.get("limit_by_model", {})
    models = sorted(set(tokens["by_model"]) | set(limits))
    for model in models or ["(any model)"]:
        limit = limits.get(model, tokens["limit_per_model"])
        table.add_row(f"enqueued tokens, {model}", f"{tokens['by_model'].get(model, 0):,}",
                      shown(limit))  # fmt: skip
    for name, label in (("batches_in_progress", "batches in progress"),
                        ("stored_bytes", "stored file bytes")):  # fmt: skip
        table.add_row(label, f"{report[name]['used']:,}", shown(report[name]["limit"]))
    table.add_row("requests per minute, per key", "", shown(report["requests_per_minute"]["limit"]))
    creates = report.get("batch_creates_per_minute", {"limit": None})
    table.add_row("batch creates per minute", "", shown(creates["limit"]))
    console.print(table)


def format_count(n: int) -> str:
    """A token count in at most 6 characters: exact up to 9,999, then 3 significant digits
    with k, M or B (``12.3k``, ``1.23M``); the exact counts are in ``GET /v1/usage``."""
    if abs(n) < 10_000:
        return f"{n:,}"
    shown = float(f"{n:.3g}")  # 99,999,999 → 1e8, so it reads 100M, not 100.0M
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(shown) >= size:
            value = shown / size
            digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
            return f"{value:.{digits}f}{unit}"
    return str(n)


def print_usage(report: dict[str, Any], console: Console) -> None:
    """The usage report as a table that fits 80 columns: one row per group, then a row labelled
    ``total``; token counts compact (``format_count``), amounts by ``format_usd``. The caption
    gives the total's saving and its cost per million tokens
    (``offpeak.billing.cost_per_million_tokens``, the dashboard's rule)."""
    group = report.get("group_by")
    total = report["total"]
    table = Table(
        title=f"usage ({report.get('currency', 'usd').upper()})",
        caption=(
            f"total saving {format_usd(total['saving'])} vs {format_usd(total['realtime_price'])}"
            f" real-time\ncost per 1M tokens {format_usd(total.get('cost_per_million_tokens'))}"
        ),
        box=box.SIMPLE_HEAD,
        show_edge=False,
        padding=(0, 0),
    )
    table.add_column(group or "", no_wrap=True, overflow="ellipsis", max_width=18)
    for name in ("batches", "requests", "in tok", "out tok", "GPU-s", "cost", "price"):
        table.add_column(name, justify="right", no_wrap=True)

    def cells(row: dict[str, Any]) -> list[str]:
        return [
            f"{row['batches']:,}",
            f"{row['requests']:,}",
            format_count(row["input_tokens"]),
            format_count(row["output_tokens"]),
            f"{row['gpu_seconds']:.1f}",
            format_usd(row["cost"]),
            format_usd(row["price"]),
        ]

    for row in report["data"]:
        table.add_row(_group_label(row, group), *cells(row))
    table.add_section()
    table.add_row("total", *cells(total), style="bold")
    console.print(table)


def _group_label(row: dict[str, Any], group: str | None) -> str:
    """A usage row's group: by adapter, the adapter's name, or the model's for its own lines;
    otherwise the group's value."""
    if group == "adapter":
        return str(row.get("adapter") or row.get("model") or "-")
    return str(row.get(group) or "-") if group else ""


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


def print_batches(batches: list[Batch], console: Console) -> None:
    """Batches one per row, newest first, in 80 columns: id, status, model, finished/total
    lines and price (``offpeak status ID`` shows the rest)."""
    table = Table(title="batches", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 0))
    table.add_column("id", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("model", overflow="ellipsis", no_wrap=True, max_width=18)
    table.add_column("lines", justify="right", no_wrap=True)
    table.add_column("price", justify="right", no_wrap=True)
    for batch in batches:
        counts = batch.request_counts
        lines = f"{counts.completed + counts.failed:,}/{counts.total:,}" if counts else "-"
        price = format_usd((batch.model_extra or {}).get("price"))
        model = getattr(batch, "model", None) or "-"
        table.add_row(batch.id, batch.status, model, lines, price)
    print_whole(console, table)


#: ``error.code`` of lines that failed for a reason of the server's, not the request's.
SERVER_ERROR_CODES = frozenset({"server_error", "engine_failure", "internal_error"})


def retryable(error_line: dict[str, Any]) -> bool:
    """Whether an error-file line failed for the server's reason, so running it again may
    succeed: it never ran because the batch expired (``batch_expired``), or the endpoint
    answered 5xx / ``server_error``. 4xx lines (the request's own fault) and lines of a
    cancelled batch (``batch_cancelled``: the user stopped them) are not retried."""
    error = error_line.get("error") or {}
    if error.get("code") == "batch_expired":
        return True
    response = error_line.get("response") or {}
    status = response.get("status_code")
    body_error = (response.get("body") or {}).get("error") or {}
    if isinstance(status, int) and status >= 500:
        return True
    return body_error.get("code") in SERVER_ERROR_CODES or error.get("code") in SERVER_ERROR_CODES


class NothingToRetryError(Exception):
    """The batch has no line that expired or failed for a server reason."""


def retry(client: OpenAI, batch_id: str) -> tuple[Batch, int]:
    """A new batch of ``batch_id``'s lines that expired or failed for a server reason
    (``retryable``): their original lines, byte for byte, from the input file, in the same
    endpoint and completion window, with ``metadata.retry_of`` naming the original. Returns the
    new batch and its number of lines.

    Raises ``NothingToRetryError`` (not ended, or nothing retryable), and the SDK's errors (the
    input file was deleted or expired: 404)."""
    batch = client.batches.retrieve(batch_id)
    if batch.status not in BatchStatus.FINAL:
        raise NothingToRetryError(f"batch {batch_id} is {batch.status}: retry it once it ends")
    wanted = {
        line["custom_id"] for line in read_lines(client, batch.error_file_id) if retryable(line)
    }
    if not wanted:
        raise NothingToRetryError(
            f"batch {batch_id} ({batch.status}) has no line that expired or failed for a server "
            "reason"
        )
    kept = []
    for raw in client.files.content(batch.input_file_id).content.splitlines():
        text = raw.strip().removeprefix(b"\xef\xbb\xbf")
        if not text:
            continue
        try:
            custom_id = orjson.loads(text).get("custom_id")
        except (orjson.JSONDecodeError, AttributeError):
            continue
        if custom_id in wanted:
            kept.append(text)
            wanted.discard(custom_id)  # a custom_id is unique in a batch that ran
    body = b"\n".join(kept) + b"\n"
    file = client.files.create(file=(f"retry-of-{batch_id}.jsonl", body), purpose="batch")
    created = client.batches.create(
        input_file_id=file.id,
        endpoint=batch.endpoint,  # type: ignore[arg-type]
        completion_window=batch.completion_window,  # type: ignore[arg-type]
        metadata={"retry_of": batch_id},
    )
    return created, len(kept)
