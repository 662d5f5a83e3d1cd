"""The admin commands that act on the database directly (``offpeak tenants``, ``offpeak models
adapters``): each runs in one transaction, and a refusal exits 1 with its message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from offpeak.cli import exit_codes
from offpeak.settings import Settings, get_settings

_errors = Console(stderr=True, soft_wrap=True)


def in_transaction(action: Callable[[Any, Settings], Any]) -> Any:
    """``action(session, settings)`` in one transaction, committed when it returns; its
    result. An ``api.errors.ApiError`` (a refusal: unknown name, a conflict) is printed to
    stderr and exits 1 (``exit_codes.ERROR``)."""
    from api.errors import ApiError
    from storage.db import session_scope

    settings = get_settings()
    try:
        with session_scope(settings.resolved_database_url) as session:
            return action(session, settings)
    except ApiError as exc:
        _errors.print(exc.message)
        raise typer.Exit(exit_codes.ERROR) from None
