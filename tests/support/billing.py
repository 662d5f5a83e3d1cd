"""Helpers the accounting, metrics and dashboard tests share: a tenant with its in-process API,
batches on stand-in engines, and finalization (which bills)."""

from __future__ import annotations

from fastapi.testclient import TestClient
from openai import OpenAI

from api.app import create_app
from offpeak.settings import Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from tests.support.batches import line, validate
from tests.support.database import new_key
from tests.support.engines import SlowEngine
from workers.engine.instant import InstantEngine
from workers.finalize import finalize
from workers.runner import Runner


class AcctTenant:
    """A new tenant: its key, the in-process API (``http``) and the OpenAI SDK on it (``sdk``)."""

    def __init__(self, settings: Settings) -> None:
        from api.services.keys import tenant_for_key

        self.key = new_key(settings)
        with session_scope(settings.resolved_database_url) as session:
            tenant = tenant_for_key(session, self.key)
            assert tenant is not None
            self.name, self.id = tenant.name, tenant.id
        self.http = TestClient(create_app(settings))
        self.headers = {"Authorization": f"Bearer {self.key}"}
        self.sdk = OpenAI(
            base_url="http://testserver/v1", api_key=self.key, http_client=self.http, max_retries=0
        )


def make(settings: Settings, tenant: AcctTenant, n: int, model: str, prefix: str = "r") -> str:
    """A validated batch of ``n`` chat lines for ``model`` (2 completion tokens each).

    Once the session's live stack runs, its control worker shares this database, and its sweep
    re-sends validation for every ``validating`` batch: it may validate ours first, against its
    own models, and fail it with ``model_not_found``. Such a batch is made again (the race needs
    a sweep inside the few milliseconds between create and validate)."""
    lines = [line(f"{prefix}{i}", model=model, body_max_tokens=2) for i in range(n)]
    for _ in range(3):
        batch, _ = validate(settings, b"\n".join(lines), tenant_name=tenant.name)
        codes = {e["code"] for e in batch.errors or []}
        if batch.status != "failed" or codes != {"model_not_found"}:
            break
    assert batch.status == "in_progress", batch.errors
    return str(batch.id)


def run(
    settings: Settings, model: str, engine: InstantEngine | None = None, owner: str = "acct"
) -> None:
    """Drain ``model``'s pending lines on a stand-in engine (2 ms per finished request)."""
    Runner(settings, engine or SlowEngine(model, delay=0.002), owner, lambda _b: None).drain()


def end(settings: Settings, batch_id: str) -> None:
    """Finalize (and so bill) a batch whose lines have all finished or stopped."""
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done
