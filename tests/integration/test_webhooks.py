"""Signed webhooks: every batch event reaches a real receiver on 127.0.0.1,
verifies with the official ``openai`` SDK's ``client.webhooks.unwrap``, survives a receiver that
answers 500 for a while, is written once per final status, and targets on private addresses are
refused unless allowed. Endpoints are managed through the SDK's ``client.webhooks``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
import pytest
from openai import OpenAI
from sqlalchemy import func, select, update

from offpeak import webhook_protocol, webhook_target
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import ModelConfig, Settings
from storage import task_messages
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import Batch, TaskMessage, WebhookDelivery, WebhookEvent
from storage.repositories import webhooks as webhooks_repo
from tests.support.batches import line, validate, wait_for_end
from tests.support.billing import AcctTenant, end, make, run
from tests.support.servers import free_port
from workers import webhook_delivery
from workers.finalize import finalize

MODEL = "webhook-model"
SMOL = "SmolLM2-135M-Instruct"
ALL = list(webhook_protocol.EVENT_TYPES)


class Receiver:
    """A real HTTP receiver on 127.0.0.1: records every request (headers, body) and answers the
    status codes of ``script`` in turn, then 200."""

    def __init__(self, script: list[int] | None = None) -> None:
        self.script = list(script or [])
        self.requests: list[tuple[dict[str, str], bytes, int]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                status = receiver.script.pop(0) if receiver.script else 200
                receiver.requests.append((dict(self.headers.items()), body, status))
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "models": {MODEL: ModelConfig(engine="instant")},
            "webhook_allow_private_targets": True,
            "webhook_allow_http": True,
            "webhook_retry_base_seconds": 0.05,
            "webhook_retry_max_seconds": 0.4,
        }
    )


@pytest.fixture()
def tenant(settings: Settings) -> AcctTenant:
    return AcctTenant(settings)


def _unwrap(sdk: OpenAI, headers: dict[str, str], body: bytes, secret: str):  # type: ignore[no-untyped-def]
    return sdk.webhooks.unwrap(body, headers, secret=secret)


def _deliver_until(settings: Settings, done, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "deliveries did not finish"
        webhook_delivery.deliver_due(settings)
        time.sleep(0.02)


def _expire(settings: Settings, batch_id: str) -> None:
    with session_scope(settings.resolved_database_url) as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(expires_at=1))


def _events_of(settings: Settings, batch_id: str) -> int:
    with session_scope(settings.resolved_database_url) as session:
        return int(
            session.scalar(select(func.count()).where(WebhookEvent.object_id == batch_id)) or 0
        )


def test_every_batch_event_arrives_signed_and_verifies_with_the_sdk(
    settings: Settings, tenant: AcctTenant, receiver: Receiver
) -> None:
    endpoint = tenant.sdk.webhooks.create(name="all", url=receiver.url, event_types=ALL)
    assert endpoint.signing_secret.startswith("whsec_")
    blobs = get_blob_store(settings.resolved_blob_url)

    completed = make(settings, tenant, 3, MODEL, prefix="c")
    run(settings, MODEL)
    end(settings, completed)
    failed, _ = validate(settings, b"this is not json", tenant_name=tenant.name)
    assert failed.status == "failed"
    cancelled = make(settings, tenant, 2, MODEL, prefix="x")
    tenant.sdk.batches.cancel(cancelled)
    end(settings, cancelled)
    expired = make(settings, tenant, 2, MODEL, prefix="e")
    _expire(settings, expired)
    end(settings, expired)
    # A finalize run again (a retried task, the sweep) writes no second event.
    for batch_id in (completed, cancelled, expired):
        assert finalize(settings, blobs, batch_id).done
    expected = {
        completed: "batch.completed",
        failed.id: "batch.failed",
        cancelled: "batch.cancelled",
        expired: "batch.expired",
    }
    assert {b: _events_of(settings, b) for b in expected} == dict.fromkeys(expected, 1)
    # The delivery task was queued once its transaction committed.
    with session_scope(settings.resolved_database_url) as session:
        assert session.get(TaskMessage, "webhooks") is not None

    _deliver_until(settings, lambda: len(receiver.requests) >= 4)
    webhook_delivery.deliver_due(settings)
    assert len(receiver.requests) == 4  # each event once
    seen = {}
    for headers, body, _status in receiver.requests:
        event = _unwrap(tenant.sdk, headers, body, endpoint.signing_secret)
        assert event.object == "event" and headers["webhook-id"] == event.id
        assert abs(event.created_at - time.time()) < 120
        seen[event.data.id] = event.type
        with pytest.raises(openai.InvalidWebhookSignatureError):
            _unwrap(tenant.sdk, headers, body + b" ", endpoint.signing_secret)
    assert seen == expected
    # The tenant reads the delivery log: one attempt each, answered 200, with its latency.
    log = tenant.http.get(
        f"/v1/webhook_endpoints/{endpoint.id}/deliveries", headers=tenant.headers
    ).json()
    assert {d["data_id"]: d["event_type"] for d in log["data"]} == expected
    for delivery in log["data"]:
        assert delivery["status"] == "delivered"
        ((attempt,),) = [delivery["attempts"]]
        assert attempt["attempt"] == 1 and attempt["status_code"] == 200
        assert attempt["latency_ms"] > 0


def test_a_receiver_answering_500_is_retried_with_backoff_until_it_succeeds(
    settings: Settings, tenant: AcctTenant
) -> None:
    receiver = Receiver(script=[500, 500, 503])
    try:
        endpoint = tenant.sdk.webhooks.create(
            name="flaky", url=receiver.url, event_types=["batch.completed"]
        )
        batch_id = make(settings, tenant, 1, MODEL, prefix="f")
        run(settings, MODEL)
        end(settings, batch_id)
        _deliver_until(settings, lambda: any(s == 200 for *_, s in receiver.requests))
    finally:
        receiver.close()
    assert [s for *_, s in receiver.requests] == [500, 500, 503, 200]
    ids = {headers["webhook-id"] for headers, _, _ in receiver.requests}
    assert len(ids) == 1  # the same event every time: a receiver can drop duplicates
    headers, body, _ = receiver.requests[-1]
    assert _unwrap(tenant.sdk, headers, body, endpoint.signing_secret).data.id == batch_id
    log = tenant.http.get(
        f"/v1/webhook_endpoints/{endpoint.id}/deliveries", headers=tenant.headers
    ).json()
    (delivery,) = log["data"]
    assert delivery["status"] == "delivered"
    attempts = delivery["attempts"]
    assert [(a["attempt"], a["status_code"]) for a in attempts] == [
        (1, 500),
        (2, 500),
        (3, 503),
        (4, 200),
    ]
    # Exponential backoff: each wait at least the schedule's (0.05, 0.1, 0.2 s).
    gaps = [b["at"] - a["at"] for a, b in zip(attempts, attempts[1:], strict=False)]
    for gap, least in zip(gaps, [0.05, 0.1, 0.2], strict=True):
        assert gap >= least


def test_retries_end_when_the_retry_window_has_passed(
    settings: Settings, tenant: AcctTenant
) -> None:
    settings = settings.model_copy(update={"webhook_retry_hours": 1.5 / 3600})
    receiver = Receiver(script=[500] * 1000)
    try:
        endpoint = tenant.sdk.webhooks.create(
            name="down", url=receiver.url, event_types=["batch.completed"]
        )
        batch_id = make(settings, tenant, 1, MODEL, prefix="d")
        run(settings, MODEL)
        end(settings, batch_id)

        def gave_up() -> bool:
            with session_scope(settings.resolved_database_url) as session:
                status = session.scalar(
                    select(WebhookDelivery.status).where(WebhookDelivery.endpoint_id == endpoint.id)
                )
            return status == "failed"

        _deliver_until(settings, gave_up)
    finally:
        receiver.close()
    assert 2 <= len(receiver.requests) < 10


def test_a_worker_that_died_mid_delivery_leaves_it_due_again(
    settings: Settings, tenant: AcctTenant, receiver: Receiver
) -> None:
    """At least once: a claimed delivery whose attempt was never logged (the worker died after
    the claim) is claimed again once its lease has run out."""
    tenant.sdk.webhooks.create(name="lease", url=receiver.url, event_types=["batch.completed"])
    batch_id = make(settings, tenant, 1, MODEL, prefix="l")
    run(settings, MODEL)
    end(settings, batch_id)
    at = time.time()
    url = settings.resolved_database_url
    with session_scope(url) as session:
        first = [d for d in webhooks_repo.claim_due(session, at=at, limit=100, lease_seconds=40)]
    mine = [d for d in first if d.url == receiver.url]
    assert len(mine) == 1
    with session_scope(url) as session:  # within the lease: nobody takes it
        again = webhooks_repo.claim_due(session, at=at + 39, limit=100, lease_seconds=40)
        assert mine[0].delivery_id not in {d.delivery_id for d in again}
    with session_scope(url) as session:
        later = webhooks_repo.claim_due(session, at=at + 41, limit=100, lease_seconds=0)
    (retaken,) = [d for d in later if d.delivery_id == mine[0].delivery_id]
    assert retaken.attempt == 2


def test_the_secret_is_shown_once_and_rotation_can_keep_the_old_one(
    settings: Settings, tenant: AcctTenant, receiver: Receiver
) -> None:
    created = tenant.sdk.webhooks.create(name="rot", url=receiver.url, event_types=ALL)
    secret = created.signing_secret
    listed = tenant.sdk.webhooks.list()
    shown = [tenant.sdk.webhooks.retrieve(created.id), *listed.data]
    for endpoint in shown:
        assert "signing_secret" not in endpoint.to_dict()
        assert secret not in endpoint.to_json()
    assert shown[0].signing_secret_hint == f"whsec_…{secret[-4:]}"
    assert [e.id for e in listed.data] == [created.id]

    result = tenant.sdk.webhooks.test(created.id, event_type="batch.completed")
    assert (result.status_code, result.success, result.event_type) == (200, True, "batch.completed")
    headers, body, _ = receiver.requests[-1]
    assert _unwrap(tenant.sdk, headers, body, secret).type == "batch.completed"

    rotated = tenant.sdk.webhooks.rotate_secret(created.id)
    assert rotated.signing_secret != secret
    tenant.sdk.webhooks.test(created.id, event_type="batch.failed")
    headers, body, _ = receiver.requests[-1]
    assert _unwrap(tenant.sdk, headers, body, rotated.signing_secret).type == "batch.failed"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        _unwrap(tenant.sdk, headers, body, secret)

    kept = tenant.sdk.webhooks.rotate_secret(created.id, keep_old_secret_active_for_24_hours=True)
    tenant.sdk.webhooks.test(created.id, event_type="batch.expired")
    headers, body, _ = receiver.requests[-1]
    for either in (kept.signing_secret, rotated.signing_secret):
        assert _unwrap(tenant.sdk, headers, body, either).type == "batch.expired"

    updated = tenant.sdk.webhooks.update(created.id, event_types=["batch.failed"], name="renamed")
    assert (updated.event_types, updated.name) == (["batch.failed"], "renamed")
    deleted = tenant.sdk.webhooks.delete(created.id)
    assert deleted.deleted and deleted.id == created.id
    with pytest.raises(openai.NotFoundError):
        tenant.sdk.webhooks.retrieve(created.id)


def test_an_endpoint_subscribed_to_other_events_gets_nothing(
    settings: Settings, tenant: AcctTenant, receiver: Receiver
) -> None:
    tenant.sdk.webhooks.create(name="f", url=receiver.url, event_types=["batch.failed"])
    batch_id = make(settings, tenant, 1, MODEL, prefix="n")
    run(settings, MODEL)
    end(settings, batch_id)
    webhook_delivery.deliver_due(settings)
    assert receiver.requests == [] and _events_of(settings, batch_id) == 0


def test_private_and_loopback_targets_are_refused_unless_allowed(settings: Settings) -> None:
    strict = settings.model_copy(
        update={"webhook_allow_private_targets": False, "webhook_allow_http": False}
    )
    tenant = AcctTenant(strict)
    for url, why in [
        ("http://example.com/hook", "must start with https://"),
        ("https://127.0.0.1/hook", "not a public address"),
        ("https://[::ffff:10.0.0.1]/hook", "not a public address"),
        ("https://localhost/hook", "non-public address"),
        ("https://user:pw@example.com/hook", "user name or password"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            tenant.sdk.webhooks.create(name="x", url=url, event_types=ALL)
        error = refused.value.body
        assert isinstance(error, dict) and why in error["message"], (url, error)
        assert (error["param"], error["code"]) == ("url", "invalid_url")
    with pytest.raises(openai.BadRequestError):  # an event type OpenAI has, Offpeak does not send
        tenant.sdk.webhooks.create(
            name="x", url="https://example.com", event_types=["video.failed"]
        )

    def resolver(addresses: list[str]):  # type: ignore[no-untyped-def]
        return lambda _host, _port: addresses

    public = resolver(["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"])
    webhook_target.check_target(
        "https://example.com/", allow_http=False, allow_private=False, resolve=public
    )
    for private in ("10.1.2.3", "169.254.169.254", "fd00::1", "::1", "100.64.0.1", "0.0.0.0"):
        with pytest.raises(webhook_target.TargetRefused):
            webhook_target.check_target(
                "https://rebinds.example/",
                allow_http=False,
                allow_private=False,
                resolve=resolver(["93.184.215.14", private]),  # one bad address is enough
            )
    webhook_target.check_target(
        "http://127.0.0.1:1/", allow_http=True, allow_private=True, resolve=resolver(["127.0.0.1"])
    )


def test_a_delivery_to_a_target_that_became_private_fails_and_is_logged(
    settings: Settings, tenant: AcctTenant, receiver: Receiver
) -> None:
    """The target is checked again before every attempt (a name can resolve elsewhere later)."""
    endpoint = tenant.sdk.webhooks.create(name="p", url=receiver.url, event_types=ALL)
    batch_id = make(settings, tenant, 1, MODEL, prefix="p")
    run(settings, MODEL)
    end(settings, batch_id)
    strict = settings.model_copy(update={"webhook_allow_private_targets": False})
    webhook_delivery.deliver_due(strict)
    assert receiver.requests == []
    log = tenant.http.get(
        f"/v1/webhook_endpoints/{endpoint.id}/deliveries", headers=tenant.headers
    ).json()
    (attempt,) = log["data"][0]["attempts"]
    assert attempt["status_code"] is None and "not a public address" in attempt["error"]
    assert log["data"][0]["status"] == "pending"  # retried later, under the window


def test_send_deliver_webhooks_queues_one_message(settings: Settings) -> None:
    task_messages.send_deliver_webhooks(settings)
    task_messages.send_deliver_webhooks(settings)
    with session_scope(settings.resolved_database_url) as session:
        assert session.scalar(select(func.count()).where(TaskMessage.key == "webhooks")) == 1


def test_the_workers_deliver_through_celery_on_the_embedded_stack(tmp_path: Path) -> None:
    """The whole path on real processes (``offpeak up``'s API and workers, SQLite and the
    filesystem broker, the instant engine): the batch's finalize task writes the outbox, the
    ``deliver_webhooks`` task posts it; a receiver answering 500 twice is retried by the sweep
    until it takes the event; the idempotent create runs on SQLite too."""
    receiver = Receiver(script=[500, 500])
    env = {
        "OFFPEAK_DATA_DIR": str(tmp_path / "data"),
        "OFFPEAK_LOCAL_API_KEY": "sk-webhooks-test",
        "OFFPEAK_MODELS": '{"SmolLM2-135M-Instruct": {"engine": "instant"}}',
        "OFFPEAK_WEBHOOK_ALLOW_PRIVATE_TARGETS": "true",
        "OFFPEAK_WEBHOOK_ALLOW_HTTP": "true",
        "OFFPEAK_WEBHOOK_RETRY_BASE_SECONDS": "0.2",
        "OFFPEAK_SWEEP_SECONDS": "1",
    }
    stack = ServiceProcesses(env, free_port(), tmp_path / "logs")
    for key in list(stack.env):  # the embedded defaults: no database or broker of the session
        if key.startswith("OFFPEAK_") and key not in (*env, "OFFPEAK_MODEL_CACHE_DIR"):
            del stack.env[key]
    stack.start()
    try:
        stack.wait_http()
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-webhooks-test")
        endpoint = client.webhooks.create(name="e2e", url=receiver.url, event_types=ALL)
        file = client.files.create(
            file=("in.jsonl", line("a", model=SMOL) + b"\n" + line("b", model=SMOL)),
            purpose="batch",
        )
        key = {"Idempotency-Key": "e2e-create"}
        batch = client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_headers=key,
        )
        again = client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_headers=key,
        )
        assert again.id == batch.id and len(client.batches.list().data) == 1
        assert wait_for_end(client, batch.id, stack, timeout=120).status == "completed"
        deadline = time.monotonic() + 60
        while not any(status == 200 for *_, status in receiver.requests):
            assert time.monotonic() < deadline, stack.tail("control")
            time.sleep(0.2)
    finally:
        stack.stop()
        receiver.close()
    assert [status for *_, status in receiver.requests] == [500, 500, 200]
    headers, body, _ = receiver.requests[-1]
    event = client.webhooks.unwrap(body, headers, secret=endpoint.signing_secret)
    assert (event.type, event.data.id) == ("batch.completed", batch.id)


def test_the_cli_manages_endpoints_and_shows_the_log(
    settings: Settings, tenant: AcctTenant, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from offpeak import cli

    monkeypatch.setattr(cli, "_client", lambda: tenant.sdk)
    runner = CliRunner()
    created = runner.invoke(cli.app, ["webhooks", "create", receiver.url, "-e", "batch.completed"])
    assert created.exit_code == 0, created.output
    secret = next(w for w in created.output.split() if w.startswith("whsec_"))
    (endpoint,) = tenant.sdk.webhooks.list().data
    listed = runner.invoke(cli.app, ["webhooks", "list"])
    assert endpoint.id in listed.output and secret not in listed.output
    assert secret[-4:] in listed.output  # the hint
    tested = runner.invoke(cli.app, ["webhooks", "test", endpoint.id])
    assert tested.exit_code == 0 and "answered 200" in tested.output, tested.output
    headers, body, _ = receiver.requests[-1]
    assert _unwrap(tenant.sdk, headers, body, secret).data.id == "batch_test"
    log = runner.invoke(cli.app, ["webhooks", "deliveries", endpoint.id])
    assert "batch_test" in log.output and "delivered" in log.output and "200/" in log.output
    rotated = runner.invoke(cli.app, ["webhooks", "rotate", endpoint.id])
    new_secret = next(w for w in rotated.output.split() if w.startswith("whsec_"))
    assert new_secret != secret
    deleted = runner.invoke(cli.app, ["webhooks", "delete", endpoint.id])
    assert deleted.exit_code == 0 and tenant.sdk.webhooks.list().data == []


def test_one_final_status_makes_one_outbox_event(settings: Settings, tenant: AcctTenant) -> None:
    """``record_final`` run again for a batch (in another transaction, as a second finalize
    would) adds nothing: the event's dedupe key is unique."""
    tenant.sdk.webhooks.create(name="once", url="http://127.0.0.1:9/", event_types=ALL)
    batch_id = make(settings, tenant, 1, MODEL, prefix="u")
    run(settings, MODEL)
    end(settings, batch_id)
    for _ in range(3):
        with session_scope(settings.resolved_database_url) as session:
            batch = session.get(Batch, batch_id)
            assert batch is not None
            webhook_delivery.record_final(session, settings, batch)
    assert _events_of(settings, batch_id) == 1
    with session_scope(settings.resolved_database_url) as session:
        deliveries = session.scalar(
            select(func.count())
            .select_from(WebhookDelivery)
            .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
            .where(WebhookEvent.object_id == batch_id)
        )
    assert deliveries == 1


def test_a_message_batch_ending_sends_no_openai_event(
    settings: Settings, tenant: AcctTenant
) -> None:
    """OpenAI's events name ``/v1/batches`` objects: a Message Batch (Anthropic's surface) that
    ends writes none, though its tenant subscribes to every event."""
    tenant.sdk.webhooks.create(name="msgs", url="http://127.0.0.1:9/", event_types=ALL)
    batch_id = make(settings, tenant, 1, MODEL, prefix="m")
    run(settings, MODEL)
    end(settings, batch_id)
    with session_scope(settings.resolved_database_url) as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        session.expunge(batch)
    before = _events_of(settings, batch_id)
    assert before == 1  # an OpenAI batch's end made its event
    batch.id, batch.endpoint = f"{batch_id}-as-message-batch", "/v1/messages"
    with session_scope(settings.resolved_database_url) as session:
        webhook_delivery.record_final(session, settings, batch)
    assert _events_of(settings, batch.id) == 0
