"""``offpeak migrate`` in a folder with no database and no configured data folder refuses to
make a new, empty SQLite database unless ``--create`` asks for one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from offpeak import cli
from offpeak.settings import get_settings


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    for name in ("OFFPEAK_DATA_DIR", "OFFPEAK_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def migrate(*args: str) -> tuple[int, str]:
    get_settings.cache_clear()
    result = CliRunner().invoke(cli.app, ["migrate", *args])
    return result.exit_code, result.output


def test_migrate_in_another_folder_creates_nothing(elsewhere: Path) -> None:
    code, output = migrate()
    assert code == 1
    assert "offpeak migrate --create" in output and "OFFPEAK_DATA_DIR" in output
    assert not (elsewhere / ".offpeak").exists()


def test_migrate_create_makes_the_database_then_plain_migrate_upgrades_it(elsewhere: Path) -> None:
    code, output = migrate("--create")
    assert code == 0, output
    assert (elsewhere / ".offpeak" / "offpeak.db").is_file()
    code, output = migrate()
    assert code == 0, output


def test_a_configured_data_folder_may_be_created(
    elsewhere: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFPEAK_DATA_DIR", str(elsewhere / "data"))
    code, output = migrate()
    assert code == 0, output
    assert (elsewhere / "data" / "offpeak.db").is_file()


def test_a_command_that_cannot_open_the_database_says_where_it_looked(elsewhere: Path) -> None:
    from offpeak.cli import embedded_db

    message = embedded_db.open_failure(get_settings())
    assert f"the folder {elsewhere / '.offpeak'} does not exist" in message
    assert "new, empty database" in message
