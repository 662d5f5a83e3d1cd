"""docs/configuration.md's settings reference is generated from the settings models: these fail
when the page and the models disagree, or when a setting has no description to generate from."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from offpeak import settings_reference
from offpeak.cli import app
from offpeak.settings import Settings

FIX = "run `offpeak config docs` (or `make docs-config`) and commit docs/configuration.md"


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> Iterator[type[BaseModel]]:
    """``model`` and every model its fields nest, each once."""
    if model in seen:
        return
    seen.add(model)
    yield model
    for field in model.model_fields.values():
        for arg in [field.annotation, *typing.get_args(field.annotation)]:
            for inner in [arg, *typing.get_args(arg)]:
                if isinstance(inner, type) and issubclass(inner, BaseModel):
                    yield from _models(inner, seen)


def test_every_setting_has_a_description() -> None:
    models = list(_models(Settings, set()))
    assert len(models) > 8  # the walk reaches the nested models, not only Settings
    bare = [
        f"{model.__name__}.{name}"
        for model in models
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert bare == [], f"fields without Field(description=...): {bare}"


def test_docs_configuration_is_generated_from_the_models() -> None:
    page = settings_reference.DOC_PATH.read_text(encoding="utf-8")
    assert settings_reference.render(page) == page, f"docs/configuration.md is stale: {FIX}"


def test_an_edited_description_shows_as_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    page = settings_reference.DOC_PATH.read_text(encoding="utf-8")
    field = Settings.model_fields["chunk_size"]
    monkeypatch.setattr(field, "description", "Request lines per claim, said differently.")
    fresh = settings_reference.render(page)
    assert fresh != page
    assert "said differently" in fresh


def test_a_setting_in_no_section_fails_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    sections = tuple(
        (title, tuple(n for n in names if n != "chunk_size"))
        for title, names in settings_reference.SECTIONS
    )
    monkeypatch.setattr(settings_reference, "SECTIONS", sections)
    with pytest.raises(settings_reference.SectionsError, match="chunk_size"):
        settings_reference.reference()


def test_nested_settings_are_named_as_the_environment_sets_them() -> None:
    text = settings_reference.reference()
    assert "`OFFPEAK_SCHEDULER__LANE__CONTROL_SECONDS`" in text
    assert "`OFFPEAK_DATABASE_POOL__READ_SIZE`" in text
    assert "`OFFPEAK_LIMITS__REQUESTS_PER_MINUTE`" in text
    # A home-relative default is written the same on every machine.
    assert "`~/.cache/offpeak/models`" in text
    # Every Settings field is on the page once, top-level or under its nested prefix.
    for name in Settings.model_fields:
        assert f"`OFFPEAK_{name.upper()}" in text, name


def test_the_environment_names_are_the_ones_pydantic_settings_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OFFPEAK_SCHEDULER__LANE__CONTROL_SECONDS", "7.5")
    monkeypatch.setenv("OFFPEAK_DATABASE_POOL__READ_SIZE", "3")
    settings = Settings()
    assert settings.scheduler.lane.control_seconds == 7.5
    assert settings.database_pool.read_size == 3


def test_the_command_rewrites_only_the_generated_section(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    prose = "# Configuration\n\nHand-written.\n\n"
    page.write_text(f"{prose}{settings_reference.BEGIN}\nold\n{settings_reference.END}\n\nTail.\n")
    runner = CliRunner()
    stale = runner.invoke(app, ["config", "docs", "--page", str(page), "--check"])
    assert stale.exit_code == 1 and "old" in page.read_text()
    assert runner.invoke(app, ["config", "docs", "--page", str(page)]).exit_code == 0
    text = page.read_text()
    assert text.startswith(prose) and text.endswith(f"{settings_reference.END}\n\nTail.\n")
    assert "`OFFPEAK_CHUNK_SIZE`" in text and "\nold\n" not in text
    fresh = runner.invoke(app, ["config", "docs", "--page", str(page), "--check"])
    assert fresh.exit_code == 0
