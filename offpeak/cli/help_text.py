"""``--help`` texts that the terminal wraps, not the source file.

Typer (0.29, rich markup) keeps the single line breaks of a docstring's later paragraphs, so a
help text came out cut at the source's 100 columns inside a wider or narrower terminal. Each
command's help is set from its docstring with the lines of a paragraph joined; a line that
starts a list item (``- ``) keeps its break.
"""

from __future__ import annotations

import inspect

import typer


def unwrap(doc: str) -> str:
    """``doc`` with each paragraph's lines joined by spaces (list items kept one per line)."""
    paragraphs = []
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        lines: list[str] = []
        for raw in paragraph.splitlines():
            text = raw.strip()
            if lines and not text.startswith("- "):
                lines[-1] += " " + text
            else:
                lines.append(text)
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def unwrap_all(app: typer.Typer) -> None:
    """Set the help of every command of ``app`` and of its sub-apps, from their docstrings,
    where no ``help=`` was given."""
    for command in app.registered_commands:
        doc = command.help or (command.callback.__doc__ if command.callback else None)
        if doc:
            command.help = unwrap(doc)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            unwrap_all(group.typer_instance)
