"""Printing tables whose cells a reader copies (ids, names): whole, never cut to fit."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_whole(console: Console, table: Table) -> None:
    """Print ``table`` on ``console``: fitted to the window on a terminal, at its natural width
    otherwise (a pipe, a file, CI), so no id or name is cut short with an ellipsis."""
    if console.is_terminal:
        console.print(table)
        return
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    Console(file=console.file, width=max(console.width, natural)).print(table)
