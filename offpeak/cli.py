"""The ``offpeak`` command line."""

from __future__ import annotations

import typer

from offpeak.cli_plan import plan_app, simulate_app

app = typer.Typer(help="Offpeak: the OpenAI Batch API on idle GPU time.", no_args_is_help=True)
app.add_typer(plan_app, name="plan")
app.add_typer(simulate_app, name="simulate")
