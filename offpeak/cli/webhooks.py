"""``offpeak webhooks …``: the calling tenant's webhook endpoints, through the official ``openai``
SDK's ``client.webhooks`` (``/v1/webhook_endpoints``; the same ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY`` as the other client commands), and the delivery log
(``GET /v1/webhook_endpoints/{id}/deliveries``, Offpeak's own). API errors exit 1 with one line
(``offpeak.cli.main``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import typer
from rich.console import Console

from offpeak.webhook_protocol import EVENT_TYPES

webhooks_app = typer.Typer(help="Webhook endpoints (signed batch events).", no_args_is_help=True)
console = Console(soft_wrap=True)


def _client():  # type: ignore[no-untyped-def]
    from offpeak import cli

    return cli._client()


def _when(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.fromtimestamp(stamp, tz=UTC).strftime("%Y-%m-%d %H:%M:%S")


def _show_secret(secret: str) -> None:
    console.print(f"signing secret: [bold]{secret}[/bold]")
    console.print("(shown once: store it now; verify with client.webhooks.unwrap(..., secret=…))")


@webhooks_app.command("create")
def create_command(
    url: Annotated[str, typer.Argument(help="The HTTPS URL that receives deliveries.")],
    event: Annotated[
        list[str] | None,
        typer.Option(
            "--event",
            "-e",
            help=f"An event type (repeatable; default all): {', '.join(EVENT_TYPES)}.",
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="A name (default: the URL).")] = None,
) -> None:
    """Create an endpoint and print its signing secret, the only time it is shown."""
    endpoint = _client().webhooks.create(
        url=url,
        event_types=event or list(EVENT_TYPES),
        name=name or url,  # type: ignore[arg-type]
    )
    console.print(f"webhook endpoint [bold]{endpoint.id}[/bold] → {endpoint.url}")
    console.print(f"events: {', '.join(endpoint.event_types)}")
    _show_secret(endpoint.signing_secret)


@webhooks_app.command("list")
def list_command() -> None:
    """This key's endpoints, newest first (secrets masked)."""
    endpoints = list(_client().webhooks.list(limit=100))
    if not endpoints:
        console.print("no webhook endpoints")
        return
    for e in endpoints:  # one line each: ids and URLs stay whole for copying
        console.print(
            f"{e.id}  {e.url}  [{', '.join(e.event_types)}]  {e.signing_secret_hint or ''}  "
            f"created {_when(e.created_at)}",
            overflow="ignore",
            crop=False,
        )


@webhooks_app.command("delete")
def delete_command(endpoint_id: str) -> None:
    """Delete an endpoint; deliveries still owed to it are dropped."""
    _client().webhooks.delete(endpoint_id)
    console.print(f"webhook endpoint {endpoint_id} deleted")


@webhooks_app.command("rotate")
def rotate_command(
    endpoint_id: str,
    keep_old: Annotated[
        bool, typer.Option("--keep-old", help="The old secret signs too for 24 hours.")
    ] = False,
) -> None:
    """Give the endpoint a new signing secret and print it (shown once)."""
    endpoint = _client().webhooks.rotate_secret(
        endpoint_id, keep_old_secret_active_for_24_hours=keep_old
    )
    if keep_old:
        console.print("the old secret keeps signing for 24 hours")
    _show_secret(endpoint.signing_secret)


@webhooks_app.command("test")
def test_command(
    endpoint_id: str,
    event: Annotated[str, typer.Option("--event", "-e", help="The event type to send.")] = (
        "batch.completed"
    ),
) -> None:
    """Send a signed sample event now (``data.id`` ``batch_test``) and print the answer."""
    result = _client().webhooks.test(endpoint_id, event_type=event)  # type: ignore[arg-type]
    console.print(
        f"{result.event_type} → {endpoint_id}: the endpoint answered {result.status_code}"
    )
    if not 200 <= result.status_code < 300:
        raise typer.Exit(1)


@webhooks_app.command("deliveries")
def deliveries_command(
    endpoint_id: str,
    limit: Annotated[int, typer.Option(min=1, max=100, help="Deliveries to show.")] = 20,
) -> None:
    """The delivery log: each event, its status and every attempt (status code, latency)."""
    page: dict[str, Any] = _client().get(
        f"/webhook_endpoints/{endpoint_id}/deliveries",
        cast_to=dict,
        options={"params": {"limit": limit}},
    )
    if not page["data"]:
        console.print("no deliveries")
        return
    for d in page["data"]:
        attempts = " ".join(
            f"{a['status_code'] or 'none'}/{a['latency_ms']:.0f}ms" for a in d["attempts"]
        )
        retry = f"  next try {_when(d['next_attempt_at'])}" if d["status"] == "pending" else ""
        console.print(
            f"{d['event_id']}  {d['event_type']}  {d['data_id']}  {d['status']}  "
            f"attempts: {attempts or '-'}{retry}",
            overflow="ignore",
            crop=False,
        )
