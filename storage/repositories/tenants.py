"""Tenants and their API keys."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from offpeak.ids import new_id, now
from storage.db import Executor
from storage.models import ApiKey, Tenant


def get_by_name(session: Session, name: str) -> Tenant | None:
    return session.scalar(select(Tenant).where(Tenant.name == name))


def create(session: Session, name: str) -> Tenant:
    tenant = Tenant(id=new_id("tenant_"), name=name, created_at=now())
    session.add(tenant)
    session.flush()
    return tenant


def add_key(
    session: Session, tenant_id: str, key_hash: str, prefix: str, name: str | None
) -> ApiKey:
    key = ApiKey(
        id=new_id("key_"),
        tenant_id=tenant_id,
        key_hash=key_hash,
        prefix=prefix,
        name=name,
        created_at=now(),
    )
    session.add(key)
    session.flush()
    return key


def tenant_for_key_hash(db: Executor, key_hash: str) -> Tenant | None:
    """The tenant owning an unrevoked key with this SHA-256 hex digest: a transient ``Tenant``
    (in no session) built from its columns, so a status poll's connection can look it up."""
    row = db.execute(
        select(
            Tenant.id,
            Tenant.name,
            Tenant.created_at,
            Tenant.requests_per_minute,
            Tenant.batch_creates_per_minute,
        )
        .join(ApiKey, ApiKey.tenant_id == Tenant.id)
        .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
    ).first()
    if row is None:
        return None
    return Tenant(
        id=row.id,
        name=row.name,
        created_at=row.created_at,
        requests_per_minute=row.requests_per_minute,
        batch_creates_per_minute=row.batch_creates_per_minute,
    )


def all_tenants(session: Session) -> list[Tenant]:
    """Every tenant, by name."""
    return list(session.scalars(select(Tenant).order_by(Tenant.name)))


def find(session: Session, name_or_id: str) -> Tenant | None:
    """The tenant named ``name_or_id``, or whose id it is."""
    return session.scalar(
        select(Tenant).where((Tenant.name == name_or_id) | (Tenant.id == name_or_id))
    )


def keys(session: Session, tenant_name: str | None) -> list[tuple[ApiKey, str]]:
    """``(key, tenant name)`` of every key, or of one tenant's, oldest first (revoked too)."""
    query = select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id)
    if tenant_name is not None:
        query = query.where(Tenant.name == tenant_name)
    return [
        (key, name) for key, name in session.execute(query.order_by(ApiKey.created_at, ApiKey.id))
    ]


def revoke(session: Session, key_id: str, at: int) -> ApiKey | None:
    """Mark a key revoked at ``at`` (unix seconds) unless it already is; ``None`` if unknown."""
    key = session.get(ApiKey, key_id)
    if key is not None and key.revoked_at is None:
        key.revoked_at = at
        session.flush()
    return key


def set_revoked(session: Session, key_hash: str, at: int | None) -> bool:
    """Set the ``revoked_at`` of the key with ``key_hash`` (``None``: in force again); whether
    such a key exists."""
    key = session.scalar(select(ApiKey).where(ApiKey.key_hash == key_hash))
    if key is not None:
        key.revoked_at = at
        session.flush()
    return key is not None


def key_exists(session: Session, key_hash: str) -> bool:
    return session.scalar(select(ApiKey.id).where(ApiKey.key_hash == key_hash)) is not None
