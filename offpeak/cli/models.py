"""``offpeak models adapters add|list|remove``: LoRA adapters registered on a running service.
Works on the database, like ``offpeak tenants``; ``/v1/admin/adapters`` is the same over HTTP
(``api.services.adapters``). Every API replica and engine worker reads the same table, so an
adapter added here is served without a restart."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from offpeak.cli.tables import print_whole
from offpeak.cli.transaction import in_transaction

models_app = typer.Typer(help="Served models and their LoRA adapters.", no_args_is_help=True)
adapters_app = typer.Typer(help="LoRA adapters of the served models.", no_args_is_help=True)
models_app.add_typer(adapters_app, name="adapters")
console = Console(soft_wrap=True)


@adapters_app.command("list")
def list_command() -> None:
    """Every adapter: its name (the ``model`` lines give), base model, path and where it comes
    from (``config``: ``lora_modules``; ``registered``: added here or over the admin API)."""
    from api.services import adapters

    table = Table(title="LoRA adapters", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1))
    for name in ("name", "base model", "path", "source"):
        table.add_column(name, no_wrap=True)
    for view in in_transaction(adapters.list_adapters):
        table.add_row(view.name, view.base_model, view.path, view.source)
    print_whole(console, table)


@adapters_app.command("add")
def add_command(
    name: Annotated[str, typer.Argument(help="The name lines give as their model.")],
    path: Annotated[
        str, typer.Argument(help="A PEFT adapter folder on the engine hosts, or blob:<prefix>.")
    ],
    base: Annotated[str, typer.Option("--base", help="The served model it was trained on.")],
) -> None:
    """Register adapter NAME at PATH on the base model (again: re-point it)."""
    from api.services import adapters

    view = in_transaction(
        lambda session, settings: adapters.add(session, settings, name, base, path)
    )
    console.print(f"adapter {view.name} on {view.base_model}: {view.path}")


@adapters_app.command("remove")
def remove_command(name: Annotated[str, typer.Argument(help="The adapter's name.")]) -> None:
    """Forget a registered adapter; its lines not yet run fail with model_not_found."""
    from api.services import adapters

    in_transaction(lambda session, settings: adapters.remove(session, settings, name))
    console.print(f"adapter {name} removed")
