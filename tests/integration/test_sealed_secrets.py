"""Webhook signing secrets are stored encrypted: the row holds a Fernet token, the API and the
delivery read the plain secret back, and ``offpeak keys reseal`` moves every row to a new key."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cryptography.fernet import Fernet
from fastapi.testclient import TestClient
from sqlalchemy import String, cast, select

from api.app import create_app
from offpeak.settings import Settings
from storage import sealing
from storage.db import session_scope
from storage.models import WebhookEndpoint
from storage.repositories import webhooks as webhooks_repo
from tests.support.database import fresh_database, new_key


def _raw(url: str, endpoint_id: str) -> str:
    with session_scope(url) as session:
        column = cast(WebhookEndpoint.__table__.c.secret, String)
        return str(session.scalar(select(column).where(WebhookEndpoint.id == endpoint_id)))


@pytest.fixture()
def own_database(settings: Settings, run_id: str) -> Iterator[Settings]:
    """The session's settings on a database of the test's own: the reseal moves every row of
    its database to a key no other test has, so it must not be the session's."""
    with fresh_database(f"offpeak_{run_id}_reseal") as url:
        yield settings.model_copy(update={"database_url": url})


def test_secrets_are_sealed_at_rest_and_resealed_with_a_new_key(
    own_database: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sealing, "_sealer", None)  # restored afterwards
    settings, api_key = own_database, new_key(own_database)
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    keyed = settings.model_copy(
        update={
            "secret_keys": [old, *settings.secret_keys],
            "webhook_allow_private_targets": True,  # no DNS here: a literal address
            "webhook_allow_http": True,
        }
    )
    with TestClient(create_app(keyed)) as client:
        created = client.post(
            "/v1/webhook_endpoints",
            json={"url": "http://127.0.0.1:9/hooks", "event_types": ["batch.completed"]},
            headers={"Authorization": f"Bearer {api_key}"},
        )
    assert created.status_code == 200, created.text
    endpoint_id, secret = created.json()["id"], created.json()["signing_secret"]
    url = settings.resolved_database_url
    stored = _raw(url, endpoint_id)
    assert stored.startswith("fernet:") and secret not in stored
    with session_scope(url) as session:
        endpoint = session.get(WebhookEndpoint, endpoint_id)
        assert endpoint is not None
        assert webhooks_repo.signing_secrets(endpoint, 0.0) == (secret,)

    sealing.configure([new, old, *settings.secret_keys])
    with session_scope(url) as session:
        assert webhooks_repo.reseal_secrets(session) >= 1
    assert _raw(url, endpoint_id) != stored
    sealing.configure([new])  # the old key dropped after the reseal
    with session_scope(url) as session:
        endpoint = session.get(WebhookEndpoint, endpoint_id)
        assert endpoint is not None and endpoint.secret == secret
