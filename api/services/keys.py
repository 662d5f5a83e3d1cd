"""API keys: each belongs to a tenant and is stored as its SHA-256 only."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy.orm import Session

from offpeak.ids import now
from storage.models import ApiKey, Tenant
from storage.repositories import tenants as tenants_repo

KEY_PREFIX = "sk-offpeak-"


def hash_key(key: str) -> str:
    """SHA-256 hex digest of a key (keys are random, so no salt or slow hash is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def ensure_tenant(session: Session, name: str) -> Tenant:
    return tenants_repo.get_by_name(session, name) or tenants_repo.create(session, name)


def create_key(session: Session, tenant_name: str, key_name: str | None = None) -> str:
    """Make a new key for ``tenant_name`` (created if new). Returns the key in plain text; it is
    shown once and cannot be recovered."""
    tenant = ensure_tenant(session, tenant_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    tenants_repo.add_key(session, tenant.id, hash_key(key), key[: len(KEY_PREFIX) + 4], key_name)
    return key


def ensure_key(session: Session, tenant_name: str, key: str) -> None:
    """Register a known key (the documented local demo key) for ``tenant_name``, once."""
    if tenants_repo.key_exists(session, hash_key(key)):
        return
    tenant = ensure_tenant(session, tenant_name)
    tenants_repo.add_key(session, tenant.id, hash_key(key), key[:15], "local")


def tenant_for_key(session: Session, key: str) -> Tenant | None:
    return tenants_repo.tenant_for_key_hash(session, hash_key(key))


def list_keys(session: Session, tenant_name: str | None = None) -> list[tuple[ApiKey, str]]:
    """``(key, tenant name)`` for every key (or one tenant's), revoked ones included; a key is
    shown by its id and first characters (``prefix``), never in full (only its hash is kept)."""
    return tenants_repo.keys(session, tenant_name)


class UnknownKeyError(LookupError):
    """No key has this id."""


def revoke_key(session: Session, key_id: str) -> ApiKey:
    """Revoke a key by id (``key_…``): from the next request on it gets 401. Idempotent: a key
    revoked already keeps its first ``revoked_at``. Raises ``UnknownKeyError``."""
    key = tenants_repo.revoke(session, key_id, now())
    if key is None:
        raise UnknownKeyError(key_id)
    return key
