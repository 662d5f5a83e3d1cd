"""Client commands on batches beyond submit/status/download: ``list``, ``cancel``, ``retry``,
``estimate`` and ``pause`` / ``resume`` of one batch, and the operator's
``keys new-secret-key`` / ``keys reseal``.

The batch commands go through the official ``openai`` SDK (``offpeak.cli._client``: the same
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``) and exit with ``offpeak.cli.exit_codes``; ``estimate``
needs no server; the ``keys`` commands work on the database (``offpeak.cli.keys`` has the
others).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from offpeak.billing import format_usd
from offpeak.cli import exit_codes
from offpeak.cli.tables import print_whole
from offpeak.settings import get_settings

console = Console(soft_wrap=True)
#: Messages that explain a non-zero exit go to stderr, so stdout stays the command's output.
errors = Console(stderr=True, soft_wrap=True)


def _client():  # type: ignore[no-untyped-def]
    from offpeak import cli

    return cli._client()


def list_command(
    limit: Annotated[int, typer.Option(min=1, max=100, help="Batches to show (1-100).")] = 20,
    after: Annotated[
        str | None, typer.Option(help="Start after this batch id (the last one shown before).")
    ] = None,
) -> None:
    """This key's batches, newest first (``GET /v1/batches``): id, status, model, finished
    lines of all, created (UTC) and price. Prints the next page's ``--after`` when there is one."""
    from offpeak.cli import client as client_tools

    cursor = {"after": after} if after else {}
    page = _client().batches.list(limit=limit, **cursor)
    batches = list(page.data)
    if not batches:
        console.print("no batches" + (f" after {after}" if after else ""))
        return
    client_tools.print_batches(batches, console)
    if page.has_more:
        console.print(f"more: offpeak list --after {batches[-1].id}")


def cancel_command(batch_id: str) -> None:
    """Cancel a batch (``POST /v1/batches/{id}/cancel``): it goes to ``cancelling``, running lines
    stop, and it ends ``cancelled`` with the lines that finished. A batch that already ended
    cannot be cancelled (error 409, exit 1)."""
    batch = _client().batches.cancel(batch_id)
    console.print(f"batch {batch.id} is {batch.status}")


def pause_batch(batch_id: str, paused: bool) -> None:
    """Pause (``paused``) or resume a batch (``POST /v1/batches/{id}/pause`` or ``/resume``,
    Offpeak extensions): a paused batch stays ``in_progress`` and its window keeps running,
    but no new line of it starts. A batch that is ending or ended cannot be (error 409, exit
    1)."""
    from openai.types import Batch

    verb = "pause" if paused else "resume"
    batch = _client().post(f"/batches/{batch_id}/{verb}", cast_to=Batch)
    paused_at = (batch.model_extra or {}).get("paused_at")
    state = "paused" if paused_at is not None else "not paused"
    console.print(f"batch {batch.id} is {batch.status}, {state}")


def retry_command(
    batch_id: str,
    wait: Annotated[bool, typer.Option("--wait", help="Show progress until it ends.")] = False,
) -> None:
    """A new batch of BATCH_ID's lines that expired or failed for a server reason (5xx,
    ``server_error``, never-run lines of an expired batch), from the original input lines, on
    the same endpoint and completion window (``metadata.retry_of`` names the original). Lines
    that failed for their own fault (4xx) are not retried. Exits 6 when there is nothing to
    retry."""
    from offpeak.cli import client as client_tools

    try:
        batch, lines = client_tools.retry(_client(), batch_id)
    except client_tools.NothingToRetryError as exc:
        errors.print(str(exc))
        raise typer.Exit(exit_codes.NOTHING_TO_DO) from None
    console.print(
        f"batch [bold]{batch.id}[/bold] created ({batch.status}): {lines:,} lines of {batch_id}"
    )
    if wait:
        from offpeak import cli

        cli.wait_and_exit(batch.id, None)


def estimate_command(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A JSONL batch file.")],
) -> None:
    """What FILE would cost, without submitting it: its prompt tokens counted with the model's
    own tokenizer (loaded here, from the configured models; no server needed) and the price
    range from the prompts alone to the prompts plus every line's ``max_tokens``."""
    from workers.estimate import estimate_file

    try:
        estimate, unusable = estimate_file(get_settings(), file)
    except ValueError as exc:
        errors.print(f"cannot estimate {file}: {exc}")
        raise typer.Exit(exit_codes.ERROR) from None
    print_estimate(estimate, console, not_requests=len(unusable))
    if unusable:
        errors.print(
            f"warning: {not_request_lines(unusable)} of this model and endpoint "
            "(validation would fail the batch)"
        )


def not_request_lines(numbers: list[int], shown: int = 10) -> str:
    """``line 4 is not a request line`` / ``3 lines are not request lines: 2, 5, 9`` (the first
    ``shown`` numbers, then how many more)."""
    if len(numbers) == 1:
        return f"line {numbers[0]:,} is not a request line"
    listed = ", ".join(f"{n:,}" for n in numbers[:shown])
    more = f" and {len(numbers) - shown:,} more" if len(numbers) > shown else ""
    return f"{len(numbers):,} lines are not request lines: {listed}{more}"


def print_estimate(estimate: dict, console: Console, not_requests: int = 0) -> None:  # type: ignore[type-arg]
    """An ``estimate`` (``workers.estimate.Estimate.as_json``) as a small table; a file's lines
    that are not request lines (not JSON, another model or url) count beside the invalid ones."""
    table = Table(title="estimate", show_header=False)
    left_out = f"{estimate['invalid_requests']:,} invalid"
    if not_requests:
        noun = "not a request line" if not_requests == 1 else "not request lines"
        left_out += f", {not_requests:,} {noun}"
    for key, value in (
        ("model", estimate.get("model")),
        ("requests", f"{estimate['requests']:,} ({left_out})"),
        ("prompt tokens", f"{estimate['prompt_tokens']:,}"),
        ("completion tokens", f"0 … {estimate['max_completion_tokens']:,} (every max_tokens)"),
        ("price", f"{format_usd(estimate['price_low'])} … {format_usd(estimate['price_high'])}"),
    ):
        if value is not None:
            table.add_row(key, str(value))
    print_whole(console, table)


def keys_new_secret_key_command() -> None:
    """Print a new key for OFFPEAK_SECRET_KEYS (Fernet: url-safe base64 of 32 random bytes), which
    encrypts webhook signing secrets at rest. To rotate: put the new key first in the list, keep
    the old one after it, run ``offpeak keys reseal``, then drop the old one."""
    from cryptography.fernet import Fernet

    typer.echo(Fernet.generate_key().decode())


def keys_reseal_command() -> None:
    """Re-encrypt every stored webhook signing secret with the first of OFFPEAK_SECRET_KEYS
    (those stored in plain text too), after a key rotation."""
    from storage import sealing
    from storage.db import session_scope
    from storage.repositories import webhooks as webhooks_repo

    settings = get_settings()
    with session_scope(settings.resolved_database_url) as session:
        try:
            sealing.configure(sealing.keys_for(settings))
            count = webhooks_repo.reseal_secrets(session)
        except sealing.SealingError as exc:
            errors.print(str(exc))
            raise typer.Exit(exit_codes.ERROR) from None
    console.print(f"{count} webhook endpoint(s) resealed with the first key")
