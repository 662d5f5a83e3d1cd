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
