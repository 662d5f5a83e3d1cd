"""Pausing and resuming a batch (``POST /v1/batches/{id}/pause`` and ``/resume``, Offpeak
extensions): through the official SDK on the instant stack (API, control and engine workers),
and in-process for the operator's key and the webhook events."""

from __future__ import annotations

import time

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types import Batch
from sqlalchemy import select

from api.app import create_app
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import ModelConfig, Settings
from storage.db import session_scope
from storage.models import WebhookEvent
from tests.support.batches import chat_line, check_ran_batch, submit, tenant_client, wait_for_end


def pause(sdk: OpenAI, batch_id: str) -> Batch:
    return sdk.post(f"/batches/{batch_id}/pause", cast_to=Batch)


def resume(sdk: OpenAI, batch_id: str) -> Batch:
    return sdk.post(f"/batches/{batch_id}/resume", cast_to=Batch)


def ended_lines(batch: Batch) -> int:
    counts = batch.request_counts
    return (counts.completed + counts.failed) if counts else 0


def test_a_paused_batch_claims_nothing_and_resumed_completes(
    instant_sdk: OpenAI, instant_stack: ServiceProcesses
) -> None:
    custom_ids = [f"p{i}" for i in range(300)]
    batch = submit(instant_sdk, [chat_line(c, "hi", max_tokens=4) for c in custom_ids])
    paused = pause(instant_sdk, batch.id)
    assert paused.status in ("validating", "in_progress")
    assert paused.model_extra and paused.model_extra["paused_at"] is not None
    # Paused again: the same pause.
    assert pause(instant_sdk, batch.id).model_extra["paused_at"] == paused.model_extra["paused_at"]
    deadline = time.monotonic() + 60
    while instant_sdk.batches.retrieve(batch.id).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    at_pause = ended_lines(instant_sdk.batches.retrieve(batch.id))
    # Several sweeps (2 s each here) and drains: nothing more is claimed.
    time.sleep(6)
    still = instant_sdk.batches.retrieve(batch.id)
    assert still.status == "in_progress" and still.model_extra["paused_at"] is not None
    assert ended_lines(still) == at_pause < len(custom_ids)
    resumed = resume(instant_sdk, batch.id)
    assert resumed.status == "in_progress" and resumed.model_extra["paused_at"] is None
    done = wait_for_end(instant_sdk, batch.id, instant_stack, timeout=120)
    assert done.status == "completed"
    check_ran_batch(instant_sdk, done, custom_ids)
    # An ended batch cannot be paused: a 409 in OpenAI's error shape.
    with pytest.raises(openai.ConflictError) as conflict:
        pause(instant_sdk, batch.id)
    assert conflict.value.body["message"] == "Cannot pause a batch with status 'completed'."  # type: ignore[index]
    assert conflict.value.body["param"] == "batch_id"  # type: ignore[index]


def test_pause_by_another_tenant_is_404_and_by_the_operator_works(settings: Settings) -> None:
    from tests.support.batches import line, validate

    admin_settings = settings.model_copy(
        update={
            "models": {"pause-model": ModelConfig(engine="instant")},
            "admin_api_key": "sk-admin-pause-test",
            "webhook_allow_private_targets": True,
            "webhook_allow_http": True,
        }
    )
    tenant, sdk = tenant_client(admin_settings)
    _, other = tenant_client(admin_settings)
    created = sdk.post(
        "/webhook_endpoints",
        cast_to=object,
        body={"url": "http://127.0.0.1:9/hook", "event_types": ["batch.paused", "batch.resumed"]},
    )
    assert isinstance(created, dict)
    batch, _ = validate(admin_settings, line("a", model="pause-model") + b"\n", tenant_name=tenant)
    with pytest.raises(openai.NotFoundError):
        pause(other, batch.id)
    with pytest.raises(openai.NotFoundError):
        resume(other, batch.id)
    operator = OpenAI(
        base_url="http://testserver/v1",
        api_key="sk-admin-pause-test",
        http_client=TestClient(create_app(admin_settings)),
        max_retries=0,
    )
    assert pause(operator, batch.id).model_extra["paused_at"] is not None
    assert sdk.batches.retrieve(batch.id).model_extra["paused_at"] is not None
    assert resume(sdk, batch.id).model_extra["paused_at"] is None
    with session_scope(settings.resolved_database_url) as session:
        events = session.scalars(
            select(WebhookEvent.type).where(WebhookEvent.object_id == batch.id)
        ).all()
    assert sorted(events) == ["batch.paused", "batch.resumed"]


def test_cli_pauses_and_resumes_one_batch(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from offpeak import cli
    from tests.support.batches import line, validate

    local = settings.model_copy(update={"models": {"pause-model": ModelConfig(engine="instant")}})
    tenant, sdk = tenant_client(local)
    batch, _ = validate(local, line("a", model="pause-model") + b"\n", tenant_name=tenant)
    monkeypatch.setattr(cli, "_client", lambda: sdk)
    result = CliRunner().invoke(cli.app, ["pause", batch.id])
    assert result.exit_code == 0, result.output
    assert f"batch {batch.id} is in_progress, paused" in result.output
    assert sdk.batches.retrieve(batch.id).model_extra["paused_at"] is not None
    shown = CliRunner().invoke(cli.app, ["status", batch.id])
    assert shown.exit_code == 0 and "paused" in shown.output, shown.output
    result = CliRunner().invoke(cli.app, ["resume", batch.id])
    assert result.exit_code == 0, result.output
    assert "not paused" in result.output
    assert sdk.batches.retrieve(batch.id).model_extra["paused_at"] is None
