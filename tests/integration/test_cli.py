"""The operator commands that need no running service."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from typer.testing import CliRunner

from api.app import create_app
from offpeak.cli import app
from offpeak.settings import Settings, get_settings


def test_keys_create_makes_a_working_key(
    settings: Settings, base_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in base_env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["keys", "create", "--tenant", "cli-tenant"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    key = result.output.strip()
    assert key.startswith("sk-offpeak-")
    with TestClient(create_app(settings)) as http:
        sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
        assert sdk.files.list().data == []
        from storage.db import session_scope
        from storage.models import ApiKey

        with session_scope(settings.resolved_database_url) as session:
            stored = [k.key_hash for k in session.query(ApiKey).all()]
        assert key not in stored  # only the hash is kept


def test_download_of_a_batch_without_output_says_so_and_exits_6(
    sdk: OpenAI, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    from offpeak import cli

    file = sdk.files.create(file=("in.jsonl", b'{"custom_id": "a"}\n'), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    monkeypatch.setattr(cli, "_client", lambda: sdk)
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, ["download", batch.id, "-o", str(out)])
    assert result.exit_code == 6  # offpeak.cli.exit_codes.NOTHING_TO_DO
    assert f"batch {batch.id} is validating" in result.output and "no output" in result.output
    assert not out.exists()
