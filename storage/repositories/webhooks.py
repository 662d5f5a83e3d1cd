"""Webhook endpoints, the event outbox, deliveries and their attempts (the delivery log)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, cast, delete, exists, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from offpeak.ids import new_id
from storage import sealing
from storage.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


def _insert(session: Session) -> Any:
    """The dialect's ``INSERT`` construct, which has ``on_conflict_do_nothing``."""
    dialect = session.get_bind().dialect.name
    return (postgresql if dialect == "postgresql" else sqlite).insert


# --- Endpoints --------------------------------------------------------------------------------


def add_endpoint(session: Session, endpoint: WebhookEndpoint) -> WebhookEndpoint:
    session.add(endpoint)
    session.flush()
    return endpoint


def get_endpoint(session: Session, tenant_id: str, endpoint_id: str) -> WebhookEndpoint | None:
    """This tenant's endpoint; another tenant's is ``None``."""
    return session.scalar(
        select(WebhookEndpoint).where(
            WebhookEndpoint.id == endpoint_id, WebhookEndpoint.tenant_id == tenant_id
        )
    )


def page_endpoints(
    session: Session, tenant_id: str, *, after: str | None, limit: int
) -> Sequence[WebhookEndpoint]:
    """Up to ``limit + 1`` endpoints, newest first, older than the cursor ``after``."""
    query = select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == tenant_id)
    if after:
        query = query.where(WebhookEndpoint.id < after)
    return session.scalars(query.order_by(WebhookEndpoint.id.desc()).limit(limit + 1)).all()


def delete_endpoint(session: Session, endpoint: WebhookEndpoint) -> None:
    """Delete the endpoint and, by cascade, its deliveries and their attempts."""
    session.delete(endpoint)
    session.flush()


# --- The outbox -------------------------------------------------------------------------------


def add_event(
    session: Session,
    *,
    tenant_id: str,
    event_id: str,
    event_type: str,
    object_id: str,
    body: bytes,
    created_at: int,
    dedupe_key: str | None,
    endpoint_ids: Sequence[str],
    at: float,
    give_up_at: float,
) -> list[str]:
    """Record an event and one pending delivery per endpoint, in the caller's transaction;
    returns the deliveries' ids.

    ``dedupe_key`` is unique: a second event with the same key (finalize run twice) inserts
    nothing and returns ``[]``.
    """
    inserted = session.execute(
        _insert(session)(WebhookEvent)
        .values(
            id=event_id,
            tenant_id=tenant_id,
            type=event_type,
            object_id=object_id,
            dedupe_key=dedupe_key,
            body=body.decode(),
            created_at=created_at,
        )
        .on_conflict_do_nothing()
        .returning(WebhookEvent.id)
    ).first()
    if inserted is None:
        return []
    ids = [new_id("whdel_") for _ in endpoint_ids]
    for delivery_id, endpoint_id in zip(ids, endpoint_ids, strict=True):
        session.add(
            WebhookDelivery(
                id=delivery_id,
                event_id=event_id,
                endpoint_id=endpoint_id,
                status=PENDING,
                attempts=0,
                created_at=at,
                next_attempt_at=at,
                give_up_at=give_up_at,
            )
        )
    session.flush()
    return ids


def subscribed_endpoint_ids(session: Session, tenant_id: str, event_type: str) -> list[str]:
    """The tenant's endpoints that take ``event_type`` (a tenant has a handful: filtered here,
    since JSON containment differs between PostgreSQL and SQLite)."""
    rows = session.execute(
        select(WebhookEndpoint.id, WebhookEndpoint.event_types).where(
            WebhookEndpoint.tenant_id == tenant_id
        )
    )
    return [endpoint_id for endpoint_id, types in rows if event_type in types]


@dataclass(frozen=True)
class DueDelivery:
    """What a worker needs to send one delivery without the database."""

    delivery_id: str
    attempt: int
    event_id: str
    body: bytes
    url: str
    signing_secrets: tuple[str, ...]
    give_up_at: float


def signing_secrets(endpoint: WebhookEndpoint, at: float) -> tuple[str, ...]:
    """The secrets that sign a delivery at ``at``: the current one, and the previous one while
    a rotation's grace period lasts."""
    if endpoint.previous_secret and (endpoint.previous_secret_until or 0) > at:
        return (endpoint.secret, endpoint.previous_secret)
    return (endpoint.secret,)


def claim_due(
    session: Session, *, at: float, limit: int, lease_seconds: float
) -> list[DueDelivery]:
    """Up to ``limit`` pending deliveries due at ``at``, oldest first; each is leased (its
    ``next_attempt_at`` pushed ``lease_seconds`` ahead, its ``attempts`` counted) so no other
    worker sends it meanwhile, and skipped by other claims while this transaction runs
    (``SKIP LOCKED``). The caller commits before sending."""
    rows = session.execute(
        select(WebhookDelivery, WebhookEvent.body, WebhookEndpoint)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= at)
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
        .with_for_update(of=WebhookDelivery, skip_locked=True)
    ).all()
    claimed = []
    for delivery, body, endpoint in rows:
        delivery.attempts += 1
        delivery.next_attempt_at = at + lease_seconds
        claimed.append(
            DueDelivery(
                delivery.id,
                delivery.attempts,
                delivery.event_id,
                body.encode(),
                endpoint.url,
                signing_secrets(endpoint, at),
                delivery.give_up_at,
            )
        )
    session.flush()
    return claimed


def record_attempt(
    session: Session,
    delivery_id: str,
    *,
    attempt: int,
    at: float,
    status_code: int | None,
    latency_seconds: float,
    error: str | None,
    delivered: bool,
    next_attempt_at: float | None,
) -> None:
    """Log one attempt and move the delivery on: ``delivered``; ``pending`` again at
    ``next_attempt_at``; or ``failed`` when ``next_attempt_at`` is ``None`` (retries are over).
    A delivery deleted meanwhile (its endpoint was) is left alone."""
    delivery = session.get(WebhookDelivery, delivery_id, with_for_update=True)
    if delivery is None:
        return
    session.add(
        WebhookAttempt(
            delivery_id=delivery_id,
            attempt=attempt,
            at=at,
            status_code=status_code,
            latency_seconds=latency_seconds,
            error=error,
        )
    )
    delivery.last_status_code = status_code
    delivery.attempts = max(delivery.attempts, attempt)
    if delivered:
        delivery.status, delivery.delivered_at, delivery.next_attempt_at = DELIVERED, at, None
    elif next_attempt_at is None:
        delivery.status, delivery.next_attempt_at = FAILED, None
    else:
        delivery.next_attempt_at = next_attempt_at
    session.flush()


def any_due(session: Session, at: float) -> bool:
    return bool(
        session.scalar(
            select(
                exists().where(
                    WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= at
                )
            )
        )
    )


# --- The delivery log -------------------------------------------------------------------------


def page_deliveries(
    session: Session, endpoint_id: str, *, after: str | None, limit: int
) -> Sequence[tuple[WebhookDelivery, WebhookEvent]]:
    """Up to ``limit + 1`` deliveries of the endpoint with their events, newest first."""
    query = (
        select(WebhookDelivery, WebhookEvent)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.endpoint_id == endpoint_id)
    )
    if after:
        query = query.where(WebhookDelivery.id < after)
    rows = session.execute(query.order_by(WebhookDelivery.id.desc()).limit(limit + 1))
    return [(delivery, event) for delivery, event in rows]


def attempts_of(session: Session, delivery_ids: Sequence[str]) -> dict[str, list[WebhookAttempt]]:
    """``delivery id → its attempts, first first``."""
    found: dict[str, list[WebhookAttempt]] = {d: [] for d in delivery_ids}
    if delivery_ids:
        rows = session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(list(delivery_ids)))
            .order_by(WebhookAttempt.delivery_id, WebhookAttempt.attempt, WebhookAttempt.id)
        )
        for row in rows:
            found[row.delivery_id].append(row)
    return found


def purge_events(session: Session, *, before: int) -> int:
    """Delete events created before ``before`` (unix seconds) that nothing still owes (no
    pending delivery), with their deliveries and attempts. Returns the events deleted."""
    owed = exists().where(
        WebhookDelivery.event_id == WebhookEvent.id, WebhookDelivery.status == PENDING
    )
    result = session.execute(
        delete(WebhookEvent)
        .where(WebhookEvent.created_at < before, ~owed)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def seal_clear_secrets(session: Session) -> int:
    """Seal every webhook secret stored in plain text (stored before keys were set) with the
    first key, leaving sealed ones as they are; returns how many endpoints were rewritten.
    Raises ``storage.sealing.SealingError`` when no key is set."""
    table = WebhookEndpoint.__table__
    raw = [cast(table.c.secret, String), cast(table.c.previous_secret, String)]
    count = 0
    for endpoint_id, secret, previous in session.execute(select(table.c.id, *raw)).all():
        values = {
            column: sealing.reseal(value)
            for column, value in (("secret", secret), ("previous_secret", previous))
            if value is not None and not value.startswith(sealing.PREFIX)
        }
        if values:
            session.execute(update(table).where(table.c.id == endpoint_id).values(values))
            count += 1
    return count


def reseal_secrets(session: Session) -> int:
    """Re-encrypt every stored webhook secret with the first key (``storage.sealing.reseal``),
    plain-text ones included; returns how many endpoints were rewritten. Raises
    ``storage.sealing.SealingError``."""
    table = WebhookEndpoint.__table__
    raw = [cast(table.c.secret, String), cast(table.c.previous_secret, String)]
    count = 0
    for endpoint_id, secret, previous in session.execute(select(table.c.id, *raw)).all():
        values = {"secret": sealing.reseal(secret)}
        if previous is not None:
            values["previous_secret"] = sealing.reseal(previous)
        session.execute(update(table).where(table.c.id == endpoint_id).values(values))
        count += 1
    return count
