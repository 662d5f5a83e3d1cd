"""The API key cache (``api.services.keys``): a key revoked by another process stops working
within ``KEY_CACHE_SECONDS``; revoked through this process, at once; unknown keys are never
cached. The clock is ``time.monotonic`` moved by the test, the database real."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.services import keys
from offpeak.ids import now
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import ApiKey
from storage.repositories import tenants as tenants_repo
from tests.support.database import new_key


def _key_id(settings: Settings, key: str) -> str:
    with session_scope(settings.resolved_database_url) as session:
        row = session.query(ApiKey).filter(ApiKey.key_hash == keys.hash_key(key)).one()
        return row.id


def test_revoked_elsewhere_stops_within_the_bound(
    settings: Settings, http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1_000.0]
    monkeypatch.setattr(keys.time, "monotonic", lambda: clock[0])
    key = new_key(settings)
    sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
    assert sdk.batches.list().data == []  # looked up once, now cached
    # Another process revokes it: the repository directly, this process's cache not told.
    with session_scope(settings.resolved_database_url) as session:
        assert tenants_repo.revoke(session, _key_id(settings, key), now()) is not None
    clock[0] += keys.KEY_CACHE_SECONDS / 2
    assert sdk.batches.list().data == []  # inside the bound: still the cached tenant
    clock[0] += keys.KEY_CACHE_SECONDS
    with pytest.raises(openai.AuthenticationError):
        sdk.batches.list()


def test_revoked_here_stops_at_once(settings: Settings, http: TestClient) -> None:
    key = new_key(settings)
    sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
    assert sdk.files.list().data == []
    with session_scope(settings.resolved_database_url) as session:
        keys.revoke_key(session, _key_id(settings, key))
    with pytest.raises(openai.AuthenticationError):
        sdk.files.list()


def test_unknown_keys_are_not_cached(settings: Settings) -> None:
    key = keys.KEY_PREFIX + "not-yet-made-0123456789"
    with session_scope(settings.resolved_database_url) as session:
        assert keys.tenant_for_key(session, key) is None
        keys.ensure_key(session, "cache-test", key)
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.tenant_for_key(session, key)
        assert tenant is not None and tenant.name == "cache-test"
        cached = keys.tenant_for_key(session, key)
        assert cached is not None and cached.id == tenant.id and cached is not tenant


def test_the_demo_key_is_revoked_at_the_demos_end_and_back_at_its_next_start(
    settings: Settings,
) -> None:
    demo = "sk-offpeak-local-demo-test"
    url = settings.resolved_database_url
    with session_scope(url) as session:
        keys.ensure_key(session, "local", demo)
    with session_scope(url) as session:
        assert keys.tenant_for_key(session, demo) is not None
    with session_scope(url) as session:
        keys.revoke_known_key(session, demo)
    with session_scope(url) as session:
        assert keys.tenant_for_key(session, demo) is None
    with session_scope(url) as session:
        keys.ensure_key(session, "local", demo)  # the next demo's start
    with session_scope(url) as session:
        assert keys.tenant_for_key(session, demo) is not None
