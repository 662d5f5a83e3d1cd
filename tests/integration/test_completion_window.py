"""A batch's completion window is parsed once, at create, into ``batches.window_seconds``; the
deadline guard (the scheduler's backlog, the tenant views) and the bill read those seconds, so a
window string this server no longer parses still counts as what it was."""

from __future__ import annotations

import io

import pytest

from offpeak.settings import ModelConfig, Settings
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import scheduler as scheduler_repo
from storage.repositories import tenant_views as tenant_views_repo
from tests.support import billing as helpers
from tests.support.batches import line
from tests.support.billing import AcctTenant
from workers import billing

MODEL = "window-model"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "models": {MODEL: ModelConfig(engine="instant")},
            "allowed_completion_windows": ["24h", "90m"],
            "flush_seconds": 0.05,
        }
    )


def _stored(settings: Settings, batch_id: str) -> tuple[int, int, int]:
    with session_scope(settings.resolved_database_url) as session:
        row = batches_repo.get_any(session, batch_id)
        assert row is not None
        return row.window_seconds, row.created_at, row.expires_at


def test_create_stores_the_window_in_seconds(settings: Settings) -> None:
    tenant = AcctTenant(settings)
    data = io.BytesIO(line("r0", model=MODEL, body_max_tokens=2))
    file = tenant.sdk.files.create(file=("in.jsonl", data), purpose="batch")
    batch = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="90m"
    )
    seconds, created, expires = _stored(settings, batch.id)
    assert seconds == 90 * 60 == expires - created
    assert batch.completion_window == "90m"  # the wire keeps the string


def test_the_deadline_guard_and_the_bill_read_the_stored_seconds(settings: Settings) -> None:
    tenant = AcctTenant(settings)
    batch_id = helpers.make(settings, tenant, 3, MODEL)
    with session_scope(settings.resolved_database_url) as session:
        row = batches_repo.get_any(session, batch_id)
        assert row is not None
        # A window another server version allowed, which this one cannot parse.
        row.completion_window = "1w"
    with session_scope(settings.resolved_database_url) as session:
        [queued] = [b for b in scheduler_repo.backlog(session, MODEL) if b.batch_id == batch_id]
        assert queued.window_seconds == 86_400
        [seen] = [b for b in tenant_views_repo.queued_batches(session) if b.batch_id == batch_id]
        assert seen.window_seconds == 86_400
    helpers.run(settings, MODEL)
    helpers.end(settings, batch_id)
    billing.bill_unbilled(settings)
    [entry] = [e for e in _ledger(settings) if e.batch_id == batch_id]
    assert entry.window_seconds == 86_400  # parsing "1w" again would have billed a window of 0


def _ledger(settings: Settings):  # type: ignore[no-untyped-def]
    from sqlalchemy import select

    from storage.models import LedgerEntry

    with session_scope(settings.resolved_database_url) as session:
        return list(session.scalars(select(LedgerEntry)))
