"""Retention: ``expires_after`` on upload is enforced, ``output_expires_after``
sets the output and error files' ``expires_at``, input files expire after 30 days by default, and
the retention sweep deletes expired files' bytes and rows and the request rows of batches that
ended long ago, while the batch and its bill stay readable through the ``openai`` SDK."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from sqlalchemy import func, select, text, update

from offpeak.settings import ModelConfig, Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import Batch, File, IdempotencyKey, RequestLine
from tests.support.batches import line
from tests.support.billing import AcctTenant, end, make, run
from workers import retention
from workers.validation import run_validation

MODEL = "retention-model"
DAY = 86_400


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={"models": {MODEL: ModelConfig(engine="instant")}, "request_retention_days": 7.0}
    )


@pytest.fixture()
def tenant(settings: Settings) -> AcctTenant:
    return AcctTenant(settings)


def _blob_bytes(settings: Settings) -> int:
    root = Path(settings.resolved_blob_url)
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _count(settings: Settings, query) -> int:  # type: ignore[no-untyped-def]
    with session_scope(settings.resolved_database_url) as session:
        return int(session.scalar(query) or 0)


def _age_files(settings: Settings, file_ids: list[str]) -> None:
    with session_scope(settings.resolved_database_url) as session:
        session.execute(
            update(File).where(File.id.in_(file_ids)).values(expires_at=int(time.time()) - 1)
        )


def test_an_upload_expires_after_expires_after_and_input_files_after_30_days(
    settings: Settings, tenant: AcctTenant
) -> None:
    default = tenant.sdk.files.create(file=("a.jsonl", line("a")), purpose="batch")
    assert default.expires_at == default.created_at + 30 * DAY  # OpenAI's default for batch input
    short = tenant.sdk.files.create(
        file=("b.jsonl", line("b")),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert short.expires_at == short.created_at + 3600
    _age_files(settings, [short.id])  # an hour on
    with pytest.raises(openai.NotFoundError):
        tenant.sdk.files.retrieve(short.id)
    with pytest.raises(openai.NotFoundError):
        tenant.sdk.files.content(short.id)
    assert [f.id for f in tenant.sdk.files.list()] == [default.id]
    # As for any file it cannot find, the batch is created and its validation fails naming the
    # file (OpenAI's behaviour; tests/integration/test_quotas.py checks the failure).
    late = tenant.sdk.batches.create(
        input_file_id=short.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert late.status == "validating" and late.input_file_id == short.id
    for seconds in (60, 40 * DAY):
        with pytest.raises(openai.BadRequestError):
            tenant.sdk.files.create(
                file=("c.jsonl", line("c")),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": seconds},
            )


def test_output_expires_after_sets_the_output_and_error_files_expiry(
    settings: Settings, tenant: AcctTenant
) -> None:
    upload = tenant.sdk.files.create(
        file=(
            "in.jsonl",
            line("ok", model=MODEL) + b"\n" + line("bad", model=MODEL, body_temperature=5),
        ),
        purpose="batch",
    )
    batch = tenant.sdk.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    # The in-process API sends its validation task to no worker: the test runs it.
    run_validation(settings, get_blob_store(settings.resolved_blob_url), batch.id)
    run(settings, MODEL)
    end(settings, batch.id)
    done = tenant.sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id and done.error_file_id
    for file_id in (done.output_file_id, done.error_file_id):
        file = tenant.sdk.files.retrieve(file_id)
        assert file.expires_at == file.created_at + 7200
    # Without it the files are kept until deleted (OpenAI's default), or output_file_expiry_days.
    plain = make(settings, tenant, 1, MODEL, prefix="p")
    run(settings, MODEL)
    end(settings, plain)
    out = tenant.sdk.files.retrieve(tenant.sdk.batches.retrieve(plain).output_file_id or "")
    assert out.expires_at is None
    for policy in (
        {"anchor": "completed_at", "seconds": 7200},
        {"anchor": "created_at", "seconds": 5},
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            tenant.sdk.batches.create(
                input_file_id=upload.id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                output_expires_after=policy,  # type: ignore[arg-type]
            )
        assert isinstance(refused.value.body, dict)
        assert refused.value.body["param"].startswith("output_expires_after.")


def test_the_retention_sweep_deletes_bytes_and_rows_and_keeps_the_batch_and_its_bill(
    settings: Settings, tenant: AcctTenant
) -> None:
    old = make(settings, tenant, 40, MODEL, prefix="o")
    recent = make(settings, tenant, 5, MODEL, prefix="r")
    run(settings, MODEL)
    end(settings, old)
    end(settings, recent)
    before = tenant.sdk.batches.retrieve(old)
    assert before.status == "completed" and before.model_extra and before.model_extra["billed_at"]
    with session_scope(settings.resolved_database_url) as session:
        batch = session.get(Batch, old)
        assert batch is not None
        files = [batch.input_file_id, batch.output_file_id or ""]
        # Eight days on: the batch ended longer ago than request_retention_days (7).
        session.execute(
            update(Batch).where(Batch.id == old).values(completed_at=int(time.time()) - 8 * DAY)
        )
        session.add(
            IdempotencyKey(
                tenant_id=tenant.id,
                key="expired-key",
                fingerprint="0" * 64,
                state="done",
                created_at=0,
                locked_until=0,
                expires_at=time.time() - 1,
            )
        )
    _age_files(settings, files)
    rows = _count(settings, select(func.count()).select_from(RequestLine))
    file_rows = _count(settings, select(func.count()).select_from(File))
    blob_bytes = _blob_bytes(settings)

    swept = retention.sweep(settings)

    assert swept.files >= 2 and swept.file_bytes > 0 and swept.idempotency_keys >= 1
    assert swept.batches_pruned >= 1 and swept.request_rows >= 40
    assert _count(settings, select(func.count()).where(RequestLine.batch_id == old)) == 0
    assert _count(settings, select(func.count()).where(RequestLine.batch_id == recent)) == 5
    assert _count(settings, select(func.count()).select_from(RequestLine)) <= rows - 40
    assert _count(settings, select(func.count()).select_from(File)) <= file_rows - 2
    assert _blob_bytes(settings) <= blob_bytes - swept.file_bytes
    for file_id in files:
        with pytest.raises(openai.NotFoundError):
            tenant.sdk.files.retrieve(file_id)
    after = tenant.sdk.batches.retrieve(old)
    assert after.request_counts == before.request_counts and after.usage == before.usage
    assert after.model_extra == {**before.model_extra}  # cost, price, billed_at: the bill stays
    report = tenant.http.get("/v1/usage?group_by=model", headers=tenant.headers).json()
    assert report["total"]["requests"] == 45
    assert retention.sweep(settings).request_rows == 0  # nothing left to do


def test_sweep_if_due_runs_once_per_interval(settings: Settings) -> None:
    settings = settings.model_copy(update={"retention_sweep_seconds": 3600.0})
    retention._last_sweep.pop(settings.resolved_database_url, None)
    assert retention.sweep_if_due(settings) is not None
    assert retention.sweep_if_due(settings) is None


def test_requests_leave_room_for_hot_updates_on_postgres(settings: Settings) -> None:
    with session_scope(settings.resolved_database_url) as session:
        options = session.scalar(text("SELECT reloptions FROM pg_class WHERE relname = 'requests'"))
    assert "fillfactor=75" in (options or [])
