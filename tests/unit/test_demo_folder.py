"""``offpeak demo`` keeps its data in a folder of its own, so its tenant, published key and
batches never land in the quick start's ``./.offpeak`` database; a data folder or database the
operator chose is used as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from offpeak.cli.demo import demo_settings
from offpeak.settings import Settings


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("OFFPEAK_DATA_DIR", "OFFPEAK_DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_demo_has_its_own_folder_beside_the_quick_starts(here: Path) -> None:
    quick_start = Settings()
    demo = demo_settings(quick_start)
    assert quick_start.data_dir == here / ".offpeak"
    assert demo.data_dir == here / ".offpeak-demo"
    assert demo.resolved_database_url == f"sqlite:///{here / '.offpeak-demo' / 'offpeak.db'}"
    assert demo.resolved_blob_url != quick_start.resolved_blob_url
    assert demo.broker_folder != quick_start.broker_folder


def test_a_configured_data_folder_is_the_demos_too(
    here: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFPEAK_DATA_DIR", str(here / "chosen"))
    assert demo_settings(Settings()).data_dir == here / "chosen"
