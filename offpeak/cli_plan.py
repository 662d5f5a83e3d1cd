"""`offpeak plan …`, `offpeak simulate policies` and `offpeak calibrate` (filled in by issue 5)."""

import typer

plan_app = typer.Typer(help="Capacity planning from the seed's cost models.", no_args_is_help=True)
simulate_app = typer.Typer(help="Simulations of batching policies.", no_args_is_help=True)
