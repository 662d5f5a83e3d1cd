"""Watching a batch until it ends: ``submit --wait``, ``retry --wait`` and ``offpeak watch``.

One progress bar and one set of exit codes for all three (``exit_codes.FOR_STATUS``). Ctrl-C
stops the watching, not the batch: it prints the command that watches it again and exits 130,
as a shell reports an interrupted command.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import typer
from openai import OpenAI
from openai.types import Batch
from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task, TextColumn
from rich.text import Text

from offpeak.cli import client as client_tools
from offpeak.cli import exit_codes, partial_results
from offpeak.statuses import BatchStatus

#: Seconds between two reads of ``/healthz`` while waiting (each may warn once).
HEALTH_EVERY_SECONDS = 10.0


class _EtaColumn(ProgressColumn):
    """Time left to the server's ``estimated_completion_at`` (the scheduler's estimate from
    the engine's measured pace), rather than rich's guess from the bar's speed, which is
    wrong while a chunk decodes and no line has finished yet."""

    def render(self, task: Task) -> Text:
        eta = task.fields.get("eta")
        if eta is None:
            return Text("ETA -:--:--", style="progress.remaining")
        left = max(int(eta - time.time()), 0)
        return Text(
            f"ETA {left // 3600}:{left // 60 % 60:02d}:{left % 60:02d}", "progress.remaining"
        )


def progress_position(batch: Batch, at: float) -> float:
    """Where the bar stands, in request lines: the finished lines, moved on while lines run by
    the share of the time between ``in_progress_at`` and the server's ``estimated_completion_at``
    that has passed (never past the last unfinished line, so only a finished batch shows 100%).
    The API shows a line's tokens once it finishes (results are written every second); until
    then the ETA is what it knows about running lines."""
    counts = batch.request_counts
    total = counts.total if counts else 0
    done = (counts.completed + counts.failed) if counts else 0
    if batch.status in BatchStatus.FINAL or not total or done >= total:
        return float(done)
    eta = (batch.model_extra or {}).get("estimated_completion_at")
    began = batch.in_progress_at
    if eta is None or began is None or eta <= began:
        return float(done)
    share = min(max((at - began) / (eta - began), 0.0), 1.0)
    return min(max(float(done), share * total), total - 0.5)


@dataclass
class BarState:
    """What the bar shows across polls: its position never goes back (a later ETA would move
    the time share back), and the last ETA stays while the server gives none (between two
    estimates, before any line is done) instead of blanking to ``-:--:--``."""

    position: float = 0.0
    eta: float | None = None

    def update(self, batch: Batch, at: float) -> tuple[float, float | None]:
        """The position (request lines) and ETA (unix seconds, or None) to show for ``batch``
        polled at ``at``; no ETA once it ended."""
        self.position = max(self.position, progress_position(batch, at))
        if batch.status in BatchStatus.FINAL:
            self.eta = None
            return self.position, None
        eta = (batch.model_extra or {}).get("estimated_completion_at")
        if eta is not None:
            self.eta = eta
        return self.position, self.eta


def wait_with_progress(
    client: OpenAI,
    batch_id: str,
    console: Console,
    poll: float = 1.0,
    *,
    model: str | None = None,
    warn: Callable[[str], None] | None = None,
    on_poll: Callable[[Batch], None] | None = None,
) -> Batch:
    """Poll until the batch ends, with a progress bar of request lines (``BarState``: finished
    lines, moving with the server's ETA while lines run, never back), the finished count, output
    tokens/s since the first poll and the time left to ``estimated_completion_at``.

    With ``warn``, reads ``/healthz`` every ``HEALTH_EVERY_SECONDS`` while the batch runs and
    calls ``warn`` (once per kind) when no live engine worker serves the batch's model (the
    server's, else ``model``) or no control worker is alive. It never fails the wait.
    ``on_poll``: called with the batch after each poll (``offpeak watch --results``)."""
    warned: set[str] = set()
    next_health = 0.0
    bar = BarState()
    # 80 columns: the batch id is printed above; elapsed time is left out.
    columns = (
        BarColumn(bar_width=20),
        TextColumn("{task.fields[finished]}"),
        TextColumn("{task.fields[detail]}"),
        _EtaColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(batch_id, total=None, detail="", finished="", eta=None)
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
            position, eta = bar.update(batch, time.time())
            total = counts.total if counts else None
            progress.update(
                task,
                total=total or None,
                completed=position,
                finished=f"{done:,}/{total:,}" if total is not None else f"{done:,}/?",
                detail=f"{batch.status} · {tokens:,} out tok · {rate:,.0f} tok/s",
                eta=eta,
            )
            if on_poll is not None:
                on_poll(batch)
            if batch.status in BatchStatus.FINAL:
                return _billed(client, batch, poll)
            late = (batch.model_extra or {}).get("completion_warning")
            if warn is not None and late and "late" not in warned:
                warned.add("late")
                warn(str(late.get("message", late)))
            if warn is not None and time.monotonic() >= next_health:
                next_health = time.monotonic() + HEALTH_EVERY_SECONDS
                answer = client_tools.health(client)
                batch_model = getattr(batch, "model", None) or model
                for kind, message in client_tools.liveness_warnings(
                    answer or {}, batch_model
                ).items():
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


def _append_rest(client: OpenAI, batch_id: str, path: Path, poll: float = 0.5) -> None:
    """After the batch ended: append its lines until the file holds them all (the last may
    show a moment after the status, while older writes of other batches commit)."""
    while True:
        partial_results.append_ready(client, batch_id, path)
        if partial_results.complete(client, batch_id, path):
            return
        time.sleep(poll)


def resume_hint(batch_id: str) -> str:
    """What Ctrl-C prints: the batch runs on, and the command that watches it again."""
    return (
        f"stopped watching; batch {batch_id} runs on. Watch it again: offpeak watch {batch_id}"
        f"  (stop it: offpeak cancel {batch_id})"
    )


def failed_lines_hint(batch: Batch) -> str | None:
    """For a batch with failed lines and an error file: how many, and the command that downloads
    that file; None otherwise."""
    counts = batch.request_counts
    if not batch.error_file_id or not counts or not counts.failed:
        return None
    return (
        f"{counts.failed:,} of {counts.total:,} lines failed: "
        f"offpeak download {batch.id} -o output.jsonl writes their errors to "
        "output.errors.jsonl"
    )


def wait_and_exit(
    client: OpenAI,
    batch_id: str,
    model: str | None,
    console: Console,
    results: Path | None = None,
) -> None:
    """Show progress until the batch ends, print its summary, and exit with its outcome
    (``exit_codes.FOR_STATUS``: 0 completed, 3 failed, 4 expired, 5 cancelled), saying on
    stderr why when it is not 0 and where the failed lines' errors are. Ctrl-C exits 130 with
    the command that watches the batch again. With ``results``, appends the batch's lines to
    that file as they end (``offpeak.cli.partial_results``), every line once it has ended."""
    # Warnings go to stderr (inside the progress display on a terminal), never failing.
    stderr = Console(stderr=True, soft_wrap=True)
    try:
        batch = wait_with_progress(
            client,
            batch_id,
            console,
            model=model,
            warn=lambda message: stderr.print(Text.assemble(("warning: ", "yellow"), message)),
            on_poll=None
            if results is None
            else lambda _batch: partial_results.append_ready(client, batch_id, results),
        )
        if results is not None:
            _append_rest(client, batch_id, results)
    except KeyboardInterrupt:
        stderr.print(resume_hint(batch_id))
        raise typer.Exit(exit_codes.INTERRUPTED) from None
    client_tools.print_summary(batch, console)
    hint = failed_lines_hint(batch)
    if hint:
        stderr.print(hint)
    code = exit_codes.FOR_STATUS.get(batch.status, exit_codes.ERROR)
    if code != exit_codes.OK:
        stderr.print(f"batch {batch.id} ended {batch.status} (exit {code})")
        raise typer.Exit(code)
