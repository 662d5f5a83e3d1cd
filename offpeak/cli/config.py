"""``offpeak config docs``: regenerate the settings reference of ``docs/configuration.md`` from
the settings models (``offpeak.settings_reference``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from offpeak import settings_reference

config_app = typer.Typer(help="Offpeak's settings and their documentation.", no_args_is_help=True)


@config_app.command("docs")
def docs_command(
    page: Annotated[
        Path, typer.Option(help="The page whose generated section is rewritten.")
    ] = settings_reference.DOC_PATH,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 if the page is stale.")
    ] = False,
) -> None:
    """Rewrite the settings reference between the page's markers from each setting's
    ``Field(description=...)``; the prose around it stays."""
    text = page.read_text(encoding="utf-8")
    fresh = settings_reference.render(text)
    if fresh == text:
        typer.echo(f"{page}: up to date")
        return
    if check:
        typer.echo(f"{page}: stale; run `offpeak config docs`", err=True)
        raise typer.Exit(1)
    page.write_text(fresh, encoding="utf-8")
    typer.echo(f"{page}: settings reference rewritten")
