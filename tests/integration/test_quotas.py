"""Per-tenant quotas (enqueued tokens at validation, batches in progress at create, stored
bytes at upload), their accounting when two requests race, their release as batches end, and
a batch created with an input file its tenant does not have, on real PostgreSQL."""

from __future__ import annotations

import io
import secrets
import threading
from typing import Any

import openai
import orjson
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.errors import QuotaExceeded
from api.schemas.batches import CreateBatch
from api.services import batches as batches_service
from api.services import files as files_service
from api.services import keys
from api.services import tenants as tenants_service
from offpeak import enqueued
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import ModelConfig, Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import quotas as quotas_repo
from tests.support.batches import chat_line, line, submit, wait_for_end
from workers.validation import run_validation

#: A model only these tests name, so no live engine worker runs their batches.
MODEL = "validation-model"
LINES = [line(f"r{i}", body_max_tokens=100) for i in range(3)]
#: Enqueued tokens of a batch of ``LINES``.
BATCH_TOKENS = sum(
    enqueued.line_tokens(
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100},
        len(raw),
        2048,
    )
    for raw in LINES
)


@pytest.fixture()
def model_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"models": {MODEL: ModelConfig(engine="instant")}})


def new_tenant(settings: Settings, **overrides: Any) -> tuple[str, str]:
    """A new tenant with ``overrides`` set: its (id, name)."""
    name = f"q-{secrets.token_hex(4)}"
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.ensure_tenant(session, name)
        if overrides:
            tenants_service.set_overrides(session, settings, name, overrides)
        return tenant.id, name


def upload(settings: Settings, tenant_id: str, data: bytes = b"\n".join(LINES)) -> str:
    with session_scope(settings.resolved_database_url) as session:
        return files_service.upload(
            session,
            get_blob_store(settings.resolved_blob_url),
            settings,
            tenant_id=tenant_id,
            stream=io.BytesIO(data),
            filename="in.jsonl",
            purpose="batch",
            expires_after_seconds=None,
        ).id


def create(settings: Settings, tenant_id: str, file_id: str) -> str:
    with session_scope(settings.resolved_database_url) as session:
        batch = batches_service.create(
            session,
            settings,
            tenant_id,
            CreateBatch(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        )
        session.info.pop("after_commit", None)  # these tests run the validation themselves
        return batch.id


def validated(settings: Settings, batch_id: str) -> tuple[str, list[dict[str, Any]] | None]:
    run_validation(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    with session_scope(settings.resolved_database_url) as session:
        batch = batches_repo.get_any(session, batch_id)
        assert batch is not None
        return batch.status, batch.errors


def test_a_batch_past_the_enqueued_token_quota_fails_validation(model_settings: Settings) -> None:
    limit = BATCH_TOKENS + BATCH_TOKENS // 2
    tenant_id, name = new_tenant(model_settings, max_enqueued_tokens=limit)
    first = create(model_settings, tenant_id, upload(model_settings, tenant_id))
    assert validated(model_settings, first) == ("in_progress", None)
    with session_scope(model_settings.resolved_database_url) as session:
        assert quotas_repo.enqueued_tokens(session, tenant_id, MODEL) == BATCH_TOKENS

    second = create(model_settings, tenant_id, upload(model_settings, tenant_id))
    status, errors = validated(model_settings, second)
    assert status == "failed"
    assert errors == [
        {
            "code": "token_limit_exceeded",
            # The tenant's name, as its users and operator know it, not its internal id.
            "message": f"Enqueued token limit reached for {MODEL} in organization {name}. "
            f"Limit: {limit:,} enqueued tokens. Please try again once some in_progress batches "
            "have been completed.",
            "param": None,
            "line": None,
        }
    ]


def test_the_quota_is_given_back_as_lines_finish_and_on_cancel(model_settings: Settings) -> None:
    tenant_id, _name = new_tenant(model_settings, max_enqueued_tokens=BATCH_TOKENS)
    first = create(model_settings, tenant_id, upload(model_settings, tenant_id))
    assert validated(model_settings, first)[0] == "in_progress"
    with session_scope(model_settings.resolved_database_url) as session:
        batch = batches_repo.get_any(session, first)
        assert batch is not None
        batch.completed, batch.failed = 1, 1  # as the runner's result writes count them
    with session_scope(model_settings.resolved_database_url) as session:
        held = quotas_repo.enqueued_tokens(session, tenant_id, MODEL)
    assert held == -(-BATCH_TOKENS // 3)  # one line of three left

    blocked = create(model_settings, tenant_id, upload(model_settings, tenant_id))
    assert validated(model_settings, blocked)[1][0]["code"] == "token_limit_exceeded"  # type: ignore[index]
    with session_scope(model_settings.resolved_database_url) as session:
        batches_service.cancel(session, model_settings, tenant_id, first)
        session.info.pop("after_commit", None)
    third = create(model_settings, tenant_id, upload(model_settings, tenant_id))
    assert validated(model_settings, third) == ("in_progress", None)


def test_two_validations_at_once_cannot_both_pass_a_quota_for_one(model_settings: Settings) -> None:
    tenant_id, _name = new_tenant(model_settings, max_enqueued_tokens=BATCH_TOKENS)
    ids = [create(model_settings, tenant_id, upload(model_settings, tenant_id)) for _ in range(2)]
    start = threading.Barrier(2)
    outcomes: dict[str, tuple[str, Any]] = {}

    def run(batch_id: str) -> None:
        start.wait()
        outcomes[batch_id] = validated(model_settings, batch_id)

    threads = [threading.Thread(target=run, args=(batch_id,)) for batch_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    statuses = sorted(status for status, _errors in outcomes.values())
    assert statuses == ["failed", "in_progress"]
    failed = next(errors for status, errors in outcomes.values() if status == "failed")
    assert failed[0]["code"] == "token_limit_exceeded"


def test_two_creates_at_once_cannot_both_pass_a_batch_quota_for_one(settings: Settings) -> None:
    tenant_id, _name = new_tenant(settings, max_batches_in_progress=1)
    files = [upload(settings, tenant_id) for _ in range(2)]
    start = threading.Barrier(2)
    results: list[object] = []

    def run(file_id: str) -> None:
        start.wait()
        try:
            results.append(create(settings, tenant_id, file_id))
        except QuotaExceeded as exc:
            results.append(exc)

    threads = [threading.Thread(target=run, args=(file_id,)) for file_id in files]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(results) == 2 and len(refused) == 1
    assert refused[0].code == "batch_limit_exceeded"
    with session_scope(settings.resolved_database_url) as session:
        assert quotas_repo.batches_in_progress(session, tenant_id) == 1


def sdk_of(http: TestClient, settings: Settings, tenant_name: str) -> OpenAI:
    with session_scope(settings.resolved_database_url) as session:
        key = keys.create_key(session, tenant_name)
    # Retries on: the quota's 429 must tell the SDK not to retry (x-should-retry: false).
    return OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=2)


def test_a_create_past_the_batches_in_progress_quota_is_429(
    http: TestClient, settings: Settings
) -> None:
    tenant_id, name = new_tenant(settings, max_batches_in_progress=1)
    sdk = sdk_of(http, settings, name)
    file = sdk.files.create(file=("in.jsonl", b"\n".join(LINES)), purpose="batch")
    sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.RateLimitError) as info:
        sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert info.value.response.headers["x-should-retry"] == "false"
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "batch_limit_exceeded"
    assert "the limit is 1" in error["message"]
    assert len(sdk.batches.list().data) == 1


def test_an_upload_past_the_storage_quota_is_refused_naming_the_limit(
    http: TestClient, settings: Settings
) -> None:
    tenant_id, name = new_tenant(settings, max_file_bytes=100)
    sdk = sdk_of(http, settings, name)
    kept = sdk.files.create(file=("a.jsonl", b"x" * 60), purpose="batch")
    with pytest.raises(openai.RateLimitError) as info:
        sdk.files.create(file=("b.jsonl", b"y" * 60), purpose="batch")
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "storage_limit_exceeded"
    assert "the limit is 100 bytes" in error["message"] and error["param"] == "file"
    assert [f.id for f in sdk.files.list().data] == [kept.id]
    sdk.files.delete(kept.id)
    sdk.files.create(file=("b.jsonl", b"y" * 60), purpose="batch")  # room again


def test_limits_show_a_tenant_its_use(http: TestClient, settings: Settings) -> None:
    tenant_id, name = new_tenant(settings, max_file_bytes=1000, max_batches_in_progress=4)
    sdk = sdk_of(http, settings, name)
    sdk.files.create(file=("a.jsonl", b"x" * 60), purpose="batch")
    limits = sdk.get("/limits", cast_to=object)
    assert limits == {
        # The suite's limits are off (``LIMITS_OFF``): no model has a limit.
        "enqueued_tokens": {
            "limit_per_model": None,
            "limit_by_model": dict.fromkeys(settings.models),
            "by_model": {},
        },
        "batches_in_progress": {"limit": 4, "used": 0},
        "stored_bytes": {"limit": 1000, "used": 60},
        "requests_per_minute": {"limit": None},
        "batch_creates_per_minute": {"limit": None},
    }


def test_an_unknown_input_file_makes_a_batch_that_fails_naming_it(
    http: TestClient, settings: Settings
) -> None:
    tenant_id, name = new_tenant(settings)
    other_id, _other = new_tenant(settings)
    others_file = upload(settings, other_id)
    sdk = sdk_of(http, settings, name)
    for file_id in ("file-nothing-here", others_file):
        batch = sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.status == "validating" and batch.input_file_id == file_id
        run_validation(settings, get_blob_store(settings.resolved_blob_url), batch.id)
        failed = sdk.batches.retrieve(batch.id)
        assert failed.status == "failed" and failed.errors and failed.errors.data
        assert [e.model_dump() for e in failed.errors.data] == [
            {
                "code": "invalid_request",
                "line": None,
                "message": f"Cannot find file {file_id}, or organization {tenant_id} does not "
                "have access to it.",
                "param": "file_id",
            }
        ]


def test_an_unknown_input_file_with_an_idempotency_key_creates_one_batch(
    http: TestClient, settings: Settings
) -> None:
    _tenant_id, name = new_tenant(settings)
    sdk = sdk_of(http, settings, name)
    body = {"input_file_id": "file-gone", "endpoint": "/v1/chat/completions"}
    first = sdk.batches.with_raw_response.create(
        **body, completion_window="24h", extra_headers={"Idempotency-Key": "k-unknown-file"}
    )
    again = sdk.batches.with_raw_response.create(
        **body, completion_window="24h", extra_headers={"Idempotency-Key": "k-unknown-file"}
    )
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.parse().id == first.parse().id
    assert [b.id for b in sdk.batches.list().data] == [first.parse().id]


def test_a_completed_batch_gives_its_tokens_back(
    instant_sdk: OpenAI, instant_stack: ServiceProcesses, instant_settings: Settings
) -> None:
    lines = [chat_line(f"c{i}", "Hello there", max_tokens=8) for i in range(4)]
    tokens = sum(
        enqueued.line_tokens("/v1/chat/completions", orjson.loads(raw)["body"], len(raw), 2048)
        for raw in lines
    )
    with session_scope(instant_settings.resolved_database_url) as session:
        tenant = keys.tenant_for_key(session, instant_sdk.api_key)
        assert tenant is not None
        tenants_service.set_overrides(
            session, instant_settings, tenant.id, {"max_enqueued_tokens": tokens}
        )
    for _ in range(2):  # the second fits only once the first has given its tokens back
        batch = wait_for_end(instant_sdk, submit(instant_sdk, lines).id, instant_stack)
        assert batch.status == "completed" and batch.request_counts.completed == 4
        limits = instant_sdk.get("/limits", cast_to=object)
        assert limits["enqueued_tokens"]["limit_per_model"] == tokens  # type: ignore[index]
        assert limits["enqueued_tokens"]["by_model"] == {}  # type: ignore[index]
    more = [*lines, chat_line("c4", "Hello there", max_tokens=8)]
    over = wait_for_end(instant_sdk, submit(instant_sdk, more).id, instant_stack)
    assert over.status == "failed" and over.errors and over.errors.data
    assert over.errors.data[0].code == "token_limit_exceeded"
