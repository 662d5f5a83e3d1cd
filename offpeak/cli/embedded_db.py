"""The embedded SQLite database's folder, as the commands that open it see it.

A relative ``OFFPEAK_DATA_DIR`` (the default, ``.offpeak``) is resolved against the directory a
command starts in, so from another folder the database is not there: ``migrate`` must not make a
new, empty one quietly, and other commands say where they looked rather than suggesting it.
"""

from __future__ import annotations

import os
from pathlib import Path

from offpeak.settings import Settings


def configured(settings: Settings) -> bool:
    """Whether the operator chose where the data lives (``OFFPEAK_DATA_DIR`` or
    ``OFFPEAK_DATABASE_URL``, in the environment or ``.env``), rather than the default folder."""
    return bool({"data_dir", "database_url"} & settings.model_fields_set)


def sqlite_path(settings: Settings) -> Path | None:
    url = settings.resolved_database_url
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


def where(settings: Settings) -> str:
    """How the data folder was chosen, for messages."""
    if configured(settings):
        return f"OFFPEAK_DATA_DIR={os.environ.get('OFFPEAK_DATA_DIR', str(settings.data_dir))!r}"
    return f"OFFPEAK_DATA_DIR is not set: the default .offpeak folder of {Path.cwd()}"


def new_database_refusal(settings: Settings, create: bool) -> str | None:
    """Why ``migrate`` will not make a new embedded database here, or None when it may: it may
    upgrade any database that exists, use any server database, and create an SQLite file when
    the data folder was configured or ``create`` (``--create``) asks for it."""
    path = sqlite_path(settings)
    if create or path is None or path.exists() or configured(settings):
        return None
    return (
        f"no Offpeak database at {path} ({where(settings)}). Run from the folder you started "
        "Offpeak in, or set OFFPEAK_DATA_DIR to that folder's absolute path; to make a new, "
        "empty database here: offpeak migrate --create"
    )


def open_failure(settings: Settings) -> str:
    """One line for SQLite's ``unable to open database file``: the folder it looked in, and
    how it was chosen."""
    path = sqlite_path(settings)
    folder = path.parent if path else None
    missing = f"the folder {folder} does not exist" if folder and not folder.is_dir() else None
    return (
        f"cannot open the embedded database: {missing or settings.resolved_database_url} "
        f"({where(settings)}); run from the folder you started Offpeak in, or set "
        "OFFPEAK_DATA_DIR to its absolute path (`offpeak migrate --create` would make a new, "
        "empty database instead)"
    )
