"""Sealed by default: the embedded default makes its own sealing key on first start (a 0600 file
in the data folder) and stores webhook signing secrets sealed with it; a server database
without ``OFFPEAK_SECRET_KEYS`` refuses to start, saying so; ``offpeak migrate`` seals secrets
an older install stored in clear, and they still sign deliveries that verify."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import String, cast, select, text

from api.app import create_app
from offpeak import webhook_protocol
from offpeak.settings import Settings
from storage import sealing
from storage.db import session_scope
from storage.models import WebhookEndpoint
from storage.repositories import webhooks as webhooks_repo
from tests.support.database import new_key

OFFPEAK = str(Path(sys.executable).with_name("offpeak"))


@pytest.fixture(autouse=True)
def own_sealer(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's keys as they were, after each test (the app factory configures them)."""
    monkeypatch.setattr(sealing, "_sealer", None)


def _embedded_env(data: Path) -> dict[str, str]:
    """A default install's environment: no OFFPEAK_ setting but the data folder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFPEAK_")}
    return {**env, "OFFPEAK_DATA_DIR": str(data)}


def _offpeak(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [OFFPEAK, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _raw_secret(url: str, endpoint_id: str) -> str:
    with session_scope(url) as session:
        column = cast(WebhookEndpoint.__table__.c.secret, String)
        return str(session.scalar(select(column).where(WebhookEndpoint.id == endpoint_id)))


@pytest.fixture()
def embedded(tmp_path: Path) -> Iterator[Settings]:
    """A default embedded install, migrated by ``offpeak migrate`` as the quick start does."""
    data = tmp_path / "data"
    migrated = _offpeak(_embedded_env(data), "migrate")
    assert migrated.returncode == 0, migrated.stderr
    yield Settings(data_dir=data, webhook_allow_private_targets=True, webhook_allow_http=True)


def _create_endpoint(settings: Settings) -> tuple[str, str]:
    key = new_key(settings)
    with TestClient(create_app(settings)) as client:
        created = client.post(
            "/v1/webhook_endpoints",
            json={"url": "http://127.0.0.1:9/hooks", "event_types": ["batch.completed"]},
            headers={"Authorization": f"Bearer {key}"},
        )
    assert created.status_code == 200, created.text
    return created.json()["id"], created.json()["signing_secret"]


def test_a_default_embedded_install_stores_webhook_secrets_sealed(embedded: Settings) -> None:
    key_file = embedded.data_dir / "secret.key"
    assert key_file.is_file(), "migrate made no sealing key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    endpoint_id, secret = _create_endpoint(embedded)
    stored = _raw_secret(embedded.resolved_database_url, endpoint_id)
    assert stored.startswith("fernet:") and secret not in stored
    # The key is the file's: another process of the install opens it.
    sealing._sealer = None
    sealing.configure([key_file.read_text().strip()])
    assert sealing.unseal(stored) == secret


def test_a_server_database_without_a_key_refuses_to_start(base_env: dict[str, str]) -> None:
    env = {k: v for k, v in {**os.environ, **base_env}.items() if k != "OFFPEAK_SECRET_KEYS"}
    for command in (["serve"], ["migrate"], ["worker", "--role", "control"]):
        try:
            result = _offpeak(env, *command)
        except subprocess.TimeoutExpired:
            pytest.fail(f"offpeak {' '.join(command)} started without a sealing key")
        assert result.returncode == 1, (command, result.stderr[-2000:])
        assert "OFFPEAK_SECRET_KEYS is not set" in result.stderr, result.stderr[-2000:]
        assert "offpeak keys new-secret-key" in result.stderr


def test_migrate_seals_clear_secrets_and_deliveries_still_verify(embedded: Settings) -> None:
    endpoint_id, secret = _create_endpoint(embedded)
    url = embedded.resolved_database_url
    with session_scope(url) as session:  # as an install from before sealing by default left it
        session.execute(
            text("UPDATE webhook_endpoints SET secret = :secret WHERE id = :id"),
            {"secret": secret, "id": endpoint_id},
        )
    assert _raw_secret(url, endpoint_id) == secret

    migrated = _offpeak(_embedded_env(embedded.data_dir), "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "1 webhook endpoint(s) had a signing secret in clear" in migrated.stdout
    stored = _raw_secret(url, endpoint_id)
    assert stored.startswith("fernet:") and secret not in stored

    sealing._sealer = None
    sealing.configure(sealing.keys_for(embedded))
    with session_scope(url) as session:
        endpoint = session.get(WebhookEndpoint, endpoint_id)
        assert endpoint is not None
        secrets = webhooks_repo.signing_secrets(endpoint, time.time())
    assert secrets == (secret,)
    body = webhook_protocol.event_body("evt_x", "batch.completed", int(time.time()), "batch_x")
    headers = webhook_protocol.signed_headers("evt_x", body, secrets, time.time())
    event = OpenAI(api_key="unused").webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "batch.completed"
