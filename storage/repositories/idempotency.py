"""Idempotency keys: reserve, complete, release (``api.services.idempotency`` holds the rules)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from storage.models import IdempotencyKey

IN_FLIGHT, DONE = "in_flight", "done"


def _insert(session: Session) -> Any:
    dialect = session.get_bind().dialect.name
    return (postgresql if dialect == "postgresql" else sqlite).insert


def reserve(
    session: Session,
    *,
    tenant_id: str,
    key: str,
    fingerprint: str,
    at: float,
    locked_until: float,
    expires_at: float,
) -> IdempotencyKey | None:
    """Reserve ``key`` for a first request: ``None`` when this call reserved it (a new key, an
    expired one, or one whose first request died in flight: its ``locked_until`` passed),
    otherwise the row that holds it, as it is (the caller decides: replay, 409 or 422).

    Two racing callers insert one row between them (``ON CONFLICT DO NOTHING``; the loser reads
    the winner's row once it commits). The caller commits at once, so the reservation is seen by
    every other request while the first one runs.
    """
    session.execute(
        delete(IdempotencyKey).where(
            IdempotencyKey.tenant_id == tenant_id,
            IdempotencyKey.key == key,
            IdempotencyKey.expires_at <= at,
        )
    )
    values = {
        "tenant_id": tenant_id,
        "key": key,
        "fingerprint": fingerprint,
        "state": IN_FLIGHT,
        "created_at": at,
        "locked_until": locked_until,
        "expires_at": expires_at,
    }
    inserted = session.execute(
        _insert(session)(IdempotencyKey)
        .values(**values)
        .on_conflict_do_nothing()
        .returning(IdempotencyKey.key)
    ).first()
    if inserted is not None:
        return None
    row = session.scalar(
        select(IdempotencyKey)
        .where(IdempotencyKey.tenant_id == tenant_id, IdempotencyKey.key == key)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    if row is None:  # deleted between the insert and the read: try once more
        return reserve(
            session,
            tenant_id=tenant_id,
            key=key,
            fingerprint=fingerprint,
            at=at,
            locked_until=locked_until,
            expires_at=expires_at,
        )
    if row.state == IN_FLIGHT and row.locked_until <= at:
        for name, value in values.items():
            setattr(row, name, value)
        session.flush()
        return None
    return row


def complete(session: Session, *, tenant_id: str, key: str, status_code: int, body: str) -> None:
    """Record the answer of the first request, in that request's own transaction (so it
    commits exactly when the object it created does)."""
    row = session.get(IdempotencyKey, (tenant_id, key), with_for_update=True)
    if row is not None:
        row.state, row.status_code, row.response_body = DONE, status_code, body
        session.flush()


def release(session: Session, *, tenant_id: str, key: str, fingerprint: str) -> None:
    """Drop an in-flight reservation whose request failed, so the client may try again."""
    session.execute(
        delete(IdempotencyKey).where(
            IdempotencyKey.tenant_id == tenant_id,
            IdempotencyKey.key == key,
            IdempotencyKey.fingerprint == fingerprint,
            IdempotencyKey.state == IN_FLIGHT,
        )
    )
