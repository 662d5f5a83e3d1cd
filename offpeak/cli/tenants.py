"""``offpeak tenants list|show|set``: the operator's view of every tenant's weight, quotas and
rate limit with its use of them, and setting a tenant's overrides. Works on the database, like
``offpeak keys``; ``/v1/admin/tenants`` is the same over HTTP (``api.services.tenants``)."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from offpeak.cli.client import format_count, percent
from offpeak.cli.tables import print_whole
from offpeak.cli.transaction import in_transaction
from offpeak.tenant_limits import UNLIMITED, UNLIMITED_WORD

tenants_app = typer.Typer(help="Tenants: weights, quotas, rate limits.", no_args_is_help=True)
console = Console(soft_wrap=True)

#: What ``--<name> default`` sets: the setting's default (the column's NULL).
DEFAULT = "default"


def _of(used: int | None, limit: int | None) -> str:
    shown = format_count(used) if used is not None else "-"
    return f"{shown} / {'∞' if limit is None else format_count(limit)}"


@tenants_app.command("list")
def list_command() -> None:
    """Every tenant: weight, queued lines and the lines of other tenants ahead of them (summed
    over models), its share of the engine-seconds of the last hour against its entitled share,
    enqueued tokens (the most any model holds, of the per-model limit), batches in progress,
    stored bytes, requests per minute and batch creates per minute (∞: no limit).

    One table, ids included; in a terminal too narrow for it, two (the queue and the share,
    then the limits), without ids, so that no cell is cut (``tenants show NAME`` has the id)."""
    from api.services import tenants

    rows = [_row(view) for view in in_transaction(tenants.list_tenants)]
    whole = _table("tenants", ALL_COLUMNS, rows)
    if not console.is_terminal or _width(whole) <= console.width:
        print_whole(console, whole)
        return
    for title, columns in NARROW_TABLES:
        console.print(_table(title, columns, rows, fold_names=True))
    console.print("ids: offpeak tenants show NAME")


#: Columns of ``tenants list``, then the two tables it prints instead in a narrow terminal.
ALL_COLUMNS = ("name", "id", "weight", "queued", "ahead", "share", "entitled", "enqueued tok",
               "batches", "stored B", "req/min", "creates/min")  # fmt: skip
NARROW_TABLES = (
    ("tenants: queue and share", ("name", "weight", "queued", "ahead", "share", "entitled")),
    (
        "tenants: use / limit",
        ("name", "enqueued tok", "batches", "stored B", "req/min", "creates/min"),
    ),
)


def _tokens_limit(tokens: dict[str, Any]) -> int | None:
    """The enqueued-token limit a one-cell summary shows: the shared figure, else the smallest
    of the models' (derived per model), else none."""
    if tokens["limit_per_model"] is not None:
        return int(tokens["limit_per_model"])
    limits = [limit for limit in tokens.get("limit_by_model", {}).values() if limit is not None]
    return min(limits, default=None)


def _row(view: dict[str, Any]) -> dict[str, str]:
    tokens = view["enqueued_tokens"]
    share = view["share"]
    return {
        "name": view["name"],
        "id": view["id"],
        "weight": f"{view['weight']:g}",
        "queued": format_count(sum(q["queued_lines"] for q in view["queue"])),
        "ahead": format_count(sum(q["lines_ahead"] for q in view["queue"])),
        "share": percent(share["engine_share"]),
        "entitled": percent(share["entitled_share"]),
        "enqueued tok": _of(max(tokens["by_model"].values(), default=0), _tokens_limit(tokens)),
        "batches": _of(view["batches_in_progress"]["used"], view["batches_in_progress"]["limit"]),
        "stored B": _of(view["stored_bytes"]["used"], view["stored_bytes"]["limit"]),
        "req/min": _of(None, view["requests_per_minute"]["limit"]),
        "creates/min": _of(None, view["batch_creates_per_minute"]["limit"]),
    }


def _table(
    title: str, columns: tuple[str, ...], rows: list[dict[str, str]], fold_names: bool = False
) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    for name in columns:
        if name == "name" and fold_names:
            table.add_column(name, overflow="fold")  # a long name on several lines, whole
        else:
            table.add_column(name, no_wrap=True)
    for row in rows:
        table.add_row(*(row[name] for name in columns))
    return table


def _width(table: Table) -> int:
    return console.measure(table, options=console.options.update_width(10_000)).maximum


def print_tenant(view: dict[str, Any]) -> None:
    """One tenant: each limit's own override, the limit in force and the use."""
    console.print(f"tenant [bold]{view['name']}[/bold] ({view['id']}), weight {view['weight']:g}")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    for name in ("limit", "override", "in force", "used"):
        table.add_column(name, no_wrap=True)
    overrides = view["overrides"]
    tokens = view["enqueued_tokens"]
    per_model = tokens.get("limit_by_model", {})
    rows = [
        ("max_enqueued_tokens", tokens["limit_per_model"], None),
        ("max_batches_in_progress", view["batches_in_progress"]["limit"],
         view["batches_in_progress"]["used"]),
        ("max_file_bytes", view["stored_bytes"]["limit"], view["stored_bytes"]["used"]),
        ("requests_per_minute", view["requests_per_minute"]["limit"], None),
        ("batch_creates_per_minute", view["batch_creates_per_minute"]["limit"], None),
    ]  # fmt: skip
    for name, limit, used in rows:
        own = overrides.get(name)
        shown = "none" if limit is None else f"{limit:,}"
        if name == "max_enqueued_tokens" and limit is None and any(per_model.values()):
            shown = "per model"  # derived from each model's measured output
        table.add_row(name, _override(own), shown, "-" if used is None else f"{used:,}")
    for model in sorted(set(tokens["by_model"]) | set(per_model)):
        limit = per_model.get(model, tokens["limit_per_model"])
        held = tokens["by_model"].get(model, 0)
        table.add_row(f"  enqueued tokens, {model}", "", "none" if limit is None else f"{limit:,}",
                      f"{held:,}")  # fmt: skip
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

    print_tenant(in_transaction(lambda session, settings: tenants.show(session, settings, tenant)))


def _override(own: int | None) -> str:
    if own is None:
        return DEFAULT
    return UNLIMITED_WORD if own == UNLIMITED else f"{own:,}"


def _limit(value: str | None) -> tuple[bool, int | None]:
    """``(given, value)`` of a ``--<limit>`` option: a number, ``unlimited`` (stored as
    ``UNLIMITED``) or ``default``."""
    if value is None:
        return False, None
    if value == DEFAULT:
        return True, None
    if value == UNLIMITED_WORD:
        return True, UNLIMITED
    try:
        number = int(float(value))
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is neither a number, {UNLIMITED_WORD!r} nor {DEFAULT!r}"
        ) from None
    if number < 0:
        raise typer.BadParameter(f"{value!r}: a limit is >= 0, or {UNLIMITED_WORD!r} for none")
    return True, number


LimitOption = Annotated[
    str | None,
    typer.Option(
        help="An integer >= 0 (0 refuses everything), 'unlimited' for no limit, or 'default' "
        "for the setting's."
    ),
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
    batch_creates_per_minute: LimitOption = None,
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
        ("batch_creates_per_minute", batch_creates_per_minute),
    ):
        given, value = _limit(raw)
        if given:
            changes[name] = value
    if not changes:
        raise typer.BadParameter("nothing to set: give --weight or a limit")
    print_tenant(
        in_transaction(
            lambda session, settings: tenants.set_overrides(session, settings, tenant, changes)
        )
    )
