"""Webhook endpoints per tenant: create (the secret is shown once), list, retrieve, update,
delete, rotate the secret, send a test event, and read the delivery log. Delivery itself runs in
the workers (``workers.webhook_delivery``), from the outbox written with each batch's final
status."""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from api.errors import BadRequest, NotFound
from api.schemas.webhooks import CreateWebhookEndpoint, UpdateWebhookEndpoint
from offpeak import webhook_protocol, webhook_target
from offpeak.ids import new_id, now
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent
from storage.repositories import webhooks as webhooks_repo

#: How long the old secret keeps signing after a rotation that keeps it (OpenAI: 24 hours).
KEEP_OLD_SECRET_SECONDS = 24 * 3600
#: Endpoints one tenant may have.
MAX_ENDPOINTS = 20


def _check_url(settings: Settings, url: str) -> None:
    """Refuse a URL this server will not call (scheme, credentials, a private address; the host
    is resolved, and every address it has is checked). Raises ``BadRequest``."""
    try:
        webhook_target.check_target(
            url,
            allow_http=settings.webhook_allow_http,
            allow_private=settings.webhook_allow_private_targets,
        )
    except webhook_target.TargetRefused as refused:
        raise BadRequest(f"Invalid url: {refused}", param="url", code="invalid_url") from None


def create(
    session: Session, settings: Settings, tenant_id: str, request: CreateWebhookEndpoint
) -> WebhookEndpoint:
    """A new endpoint with a fresh ``whsec_`` secret. Raises ``BadRequest`` (URL refused, too
    many endpoints)."""
    _check_url(settings, request.url)
    existing = webhooks_repo.page_endpoints(session, tenant_id, after=None, limit=MAX_ENDPOINTS)
    if len(existing) >= MAX_ENDPOINTS:
        raise BadRequest(f"A tenant may have at most {MAX_ENDPOINTS} webhook endpoints.")
    created = now()
    return webhooks_repo.add_endpoint(
        session,
        WebhookEndpoint(
            id=new_id("we_"),
            tenant_id=tenant_id,
            name=request.name or request.url,
            url=request.url,
            event_types=sorted(set(request.event_types)),
            secret=webhook_protocol.new_secret(),
            created_at=created,
            updated_at=created,
        ),
    )


def get(session: Session, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    """Raises ``NotFound`` for an unknown or another tenant's endpoint."""
    endpoint = webhooks_repo.get_endpoint(session, tenant_id, endpoint_id)
    if endpoint is None:
        raise NotFound(f"No webhook endpoint found with id '{endpoint_id}'.", param="id")
    return endpoint


def page(
    session: Session, tenant_id: str, *, after: str | None, limit: int
) -> tuple[list[WebhookEndpoint], bool]:
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be between 1 and 100.", param="limit")
    rows = list(webhooks_repo.page_endpoints(session, tenant_id, after=after, limit=limit))
    return rows[:limit], len(rows) > limit


def update(
    session: Session,
    settings: Settings,
    tenant_id: str,
    endpoint_id: str,
    request: UpdateWebhookEndpoint,
) -> WebhookEndpoint:
    """Change the URL, the event types or the name; ``updated_at`` moves only on a change."""
    endpoint = get(session, tenant_id, endpoint_id)
    changes: dict[str, object] = {}
    if request.url is not None and request.url != endpoint.url:
        _check_url(settings, request.url)
        changes["url"] = request.url
    if request.event_types is not None:
        types = sorted(set(request.event_types))
        if types != list(endpoint.event_types):
            changes["event_types"] = types
    if request.name is not None and request.name != endpoint.name:
        changes["name"] = request.name
    for name, value in changes.items():
        setattr(endpoint, name, value)
    if changes:
        endpoint.updated_at = now()
        session.flush()
    return endpoint


def delete(session: Session, tenant_id: str, endpoint_id: str) -> None:
    """Delete the endpoint; deliveries still owed to it are dropped with it."""
    webhooks_repo.delete_endpoint(session, get(session, tenant_id, endpoint_id))


def rotate_secret(
    session: Session, tenant_id: str, endpoint_id: str, *, keep_old: bool
) -> WebhookEndpoint:
    """A new secret signs from now on; with ``keep_old`` the previous one signs too for 24 h
    (each delivery then carries two ``v1,`` signatures, and a receiver with either verifies)."""
    endpoint = get(session, tenant_id, endpoint_id)
    stamp = now()
    endpoint.previous_secret = endpoint.secret if keep_old else None
    endpoint.previous_secret_until = stamp + KEEP_OLD_SECRET_SECONDS if keep_old else None
    endpoint.secret = webhook_protocol.new_secret()
    endpoint.updated_at = stamp
    session.flush()
    return endpoint


#: ``data.id`` of a test event: no batch has it.
TEST_OBJECT_ID = "batch_test"


def send_test(settings: Settings, tenant_id: str, endpoint_id: str, event_type: str) -> int:
    """Sign and send one sample event of ``event_type`` (``data.id`` ``batch_test``) to the
    endpoint now and return the receiver's status code. The endpoint is read, and the attempt
    logged (one attempt, never retried), in transactions of their own: no database connection
    is held while the receiver answers.

    Raises ``NotFound`` (no such endpoint of the tenant's) and ``BadRequest`` (code
    ``webhook_unreachable``) when no answer came: the URL was refused, the connection failed or
    the attempt's deadline passed.
    """
    with session_scope(settings.resolved_database_url) as session:
        endpoint = get(session, tenant_id, endpoint_id)
        url, at = endpoint.url, time.time()
        signing = webhooks_repo.signing_secrets(endpoint, at)
    event_id, created = new_id("evt_"), now()
    body = webhook_protocol.event_body(event_id, event_type, created, TEST_OBJECT_ID)
    headers = webhook_protocol.signed_headers(event_id, body, signing, time.time())
    result = webhook_target.send(
        url,
        body,
        headers,
        timeout=settings.webhook_timeout_seconds,
        allow_http=settings.webhook_allow_http,
        allow_private=settings.webhook_allow_private_targets,
    )
    with session_scope(settings.resolved_database_url) as log:
        (delivery_id,) = webhooks_repo.add_event(
            log,
            tenant_id=tenant_id,
            event_id=event_id,
            event_type=event_type,
            object_id=TEST_OBJECT_ID,
            body=body,
            created_at=created,
            dedupe_key=None,
            endpoint_ids=[endpoint_id],
            at=at,
            give_up_at=at,
        )
        webhooks_repo.record_attempt(
            log,
            delivery_id,
            attempt=1,
            at=time.time(),
            status_code=result.status_code,
            latency_seconds=result.latency_seconds,
            error=result.error,
            delivered=result.delivered,
            next_attempt_at=None,
        )
    if result.status_code is None:
        raise BadRequest(
            f"The endpoint did not answer: {result.error}",
            param="url",
            code="webhook_unreachable",
        )
    return result.status_code


def deliveries(
    session: Session, tenant_id: str, endpoint_id: str, *, after: str | None, limit: int
) -> tuple[list[tuple[WebhookDelivery, WebhookEvent, list[WebhookAttempt]]], bool]:
    """A page of the endpoint's delivery log, newest first, each with its attempts."""
    get(session, tenant_id, endpoint_id)
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be between 1 and 100.", param="limit")
    found = list(webhooks_repo.page_deliveries(session, endpoint_id, after=after, limit=limit))
    rows = found[:limit]
    attempts = webhooks_repo.attempts_of(session, [d.id for d, _ in rows])
    return [(d, e, attempts[d.id]) for d, e in rows], len(found) > limit
