"""``offpeak tenants list|show|set``: the operator's view of every tenant's weight, quotas and
rate limit with its use of them, and setting a tenant's overrides. Works on the database, like
``offpeak keys``; ``/v1/admin/tenants`` is the same over HTTP (``api.services.tenants``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from offpeak.cli import exit_codes
from offpeak.cli.client import format_count, percent
from offpeak.cli.tables import print_whole
from offpeak.settings import get_settings

tenants_app = typer.Typer(help="Tenants: weights, quotas, rate limits.", no_args_is_help=True)
console = Console(soft_wrap=True)
errors = Console(stderr=True, soft_wrap=True)

#: What ``--<name> default`` sets: the setting's default (the column's NULL).
DEFAULT = "default"


def _of(used: int | None, limit: int | None) -> str:
    shown = format_count(used) if used is not None else "-"
    return f"{shown} / {'∞' if limit is None else format_count(limit)}"


def _run(action: Any) -> Any:
    """``action(session, settings)`` in one transaction; an ``ApiError`` exits 1 with its
    message."""
    from api.errors import ApiError
    from storage.db import session_scope

    settings = get_settings()
    try:
        with session_scope(settings.resolved_database_url) as session:
            return action(session, settings)
    except ApiError as exc:
        errors.print(exc.message)
        raise typer.Exit(exit_codes.ERROR) from None


@tenants_app.command("list")
def list_command() -> None:
    """Every tenant: weight, queued lines and the lines of other tenants ahead of them (summed
    over models), its share of the engine-seconds of the last hour against its entitled share,
    enqueued tokens (the most any model holds, of the per-model limit), batches in progress,
    stored bytes and requests per minute (∞: no limit)."""
    from api.services import tenants

    table = Table(title="tenants", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    columns = ("name", "id", "weight", "queued", "ahead", "share", "entitled", "enqueued tok",
               "batches", "stored B", "req/min")  # fmt: skip
    for name in columns:
        table.add_column(name, no_wrap=True)
    for view in _run(tenants.list_tenants):
        tokens = view["enqueued_tokens"]
        share = view["share"]
        table.add_row(
            view["name"],
            view["id"],
            f"{view['weight']:g}",
            format_count(sum(q["queued_lines"] for q in view["queue"])),
            format_count(sum(q["lines_ahead"] for q in view["queue"])),
            percent(share["engine_share"]),
            percent(share["entitled_share"]),
            _of(max(tokens["by_model"].values(), default=0), tokens["limit_per_model"]),
            _of(view["batches_in_progress"]["used"], view["batches_in_progress"]["limit"]),
            _of(view["stored_bytes"]["used"], view["stored_bytes"]["limit"]),
            _of(None, view["requests_per_minute"]["limit"]),
        )
    print_whole(console, table)


def print_tenant(view: dict[str, Any]) -> None:
    """One tenant: each limit's own override, the limit in force and the use."""
    console.print(f"tenant [bold]{view['name']}[/bold] ({view['id']}), weight {view['weight']:g}")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    for name in ("limit", "override", "in force", "used"):
        table.add_column(name, no_wrap=True)
    overrides = view["overrides"]
    tokens = view["enqueued_tokens"]
    rows = [
        ("max_enqueued_tokens", tokens["limit_per_model"], None),
        ("max_batches_in_progress", view["batches_in_progress"]["limit"],
         view["batches_in_progress"]["used"]),
        ("max_file_bytes", view["stored_bytes"]["limit"], view["stored_bytes"]["used"]),
        ("requests_per_minute", view["requests_per_minute"]["limit"], None),
    ]  # fmt: skip
    for name, limit, used in rows:
        own = overrides.get(name)
        table.add_row(
            name,
            DEFAULT if own is None else f"{own:,}",
            "none" if limit is None else f"{limit:,}",
            "-" if used is None else f"{used:,}",
        )
    for model, held in sorted(tokens["by_model"].items()):
        table.add_row(f"  enqueued tokens, {model}", "", "", f"{held:,}")
    for q in view.get("queue", []):
        table.add_row(f"  queued lines, {q['model']}", "", "",
                      f"{q['queued_lines']:,} ({q['lines_ahead']:,} ahead)")  # fmt: skip
    print_whole(console, table)
    share = view.get("share")
    if share:
        console.print(
            f"engine share, last hour: {percent(share['engine_share'])}, "
            f"entitled {percent(share['entitled_share'])}"
        )


@tenants_app.command("show")
def show_command(tenant: Annotated[str, typer.Argument(help="The tenant's name or id.")]) -> None:
    """One tenant's overrides, the limits in force and its use of them."""
    from api.services import tenants

    print_tenant(_run(lambda session, settings: tenants.show(session, settings, tenant)))


def _limit(value: str | None) -> tuple[bool, int | None]:
    """``(given, value)`` of a ``--<limit>`` option: a number, or ``default``."""
    if value is None:
        return False, None
    if value == DEFAULT:
        return True, None
    try:
        number = int(float(value))
    except ValueError:
        raise typer.BadParameter(f"{value!r} is neither a number nor {DEFAULT!r}") from None
    return True, number


LimitOption = Annotated[
    str | None,
    typer.Option(help="An integer >= 0 (0 refuses everything), or 'default' for the setting's."),
]


@tenants_app.command("set")
def set_command(
    tenant: Annotated[str, typer.Argument(help="The tenant's name or id.")],
    weight: Annotated[
        float | None, typer.Option(help="Share of the engines against other tenants (> 0).")
    ] = None,
    max_enqueued_tokens: LimitOption = None,
    max_batches_in_progress: LimitOption = None,
    max_file_bytes: LimitOption = None,
    requests_per_minute: LimitOption = None,
) -> None:
    """Set a tenant's weight and limit overrides; options left out are left alone. New figures
    apply to the next create, upload or validation, and to the tenant's keys' rate limit
    within 5 s on every API process."""
    from api.services import tenants

    changes: dict[str, Any] = {} if weight is None else {"weight": weight}
    for name, raw in (
        ("max_enqueued_tokens", max_enqueued_tokens),
        ("max_batches_in_progress", max_batches_in_progress),
        ("max_file_bytes", max_file_bytes),
        ("requests_per_minute", requests_per_minute),
    ):
        given, value = _limit(raw)
        if given:
            changes[name] = value
    if not changes:
        raise typer.BadParameter("nothing to set: give --weight or a limit")
    print_tenant(
        _run(lambda session, settings: tenants.set_overrides(session, settings, tenant, changes))
    )
