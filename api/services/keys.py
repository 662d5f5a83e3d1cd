"""API keys: each belongs to a tenant and is stored as its SHA-256 only.

``tenant_for_key`` keeps the tenant of each key it found for ``KEY_CACHE_SECONDS`` in this
process (status polls are most of the API's requests, and each asked the database for its key
first): a key revoked elsewhere (``offpeak keys revoke`` in another process, or another API
worker) stops working within that bound; revoked through this process, at once. Unknown keys
are never cached, so a key created a moment ago works on its first request.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections import OrderedDict

from sqlalchemy.orm import Session

from offpeak.ids import now
from storage.db import Executor
from storage.models import ApiKey, Tenant
from storage.repositories import tenants as tenants_repo

KEY_PREFIX = "sk-offpeak-"
#: Seconds a found key's tenant is reused without asking the database (the revocation bound).
KEY_CACHE_SECONDS = 5.0
#: Keys remembered at most (least recently used go first).
KEY_CACHE_SIZE = 10_000


class _KeyCache:
    """key hash → (a transient copy of its tenant, when looked up; ``time.monotonic``), LRU."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, tuple[Tenant, float]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key_hash: str) -> Tenant | None:
        with self._lock:
            entry = self._entries.get(key_hash)
            if entry is None:
                return None
            if time.monotonic() - entry[1] > KEY_CACHE_SECONDS:
                del self._entries[key_hash]
                return None
            self._entries.move_to_end(key_hash)
        # Shared by the requests of the next KEY_CACHE_SECONDS (building an ORM object per
        # request cost a poll more than the lookup in this dict): callers read its columns only.
        return entry[0]

    def put(self, key_hash: str, tenant: Tenant) -> None:
        # A transient copy, in no session, so no session's expiry or refresh can change it.
        copy = Tenant(
            id=tenant.id,
            name=tenant.name,
            created_at=tenant.created_at,
            requests_per_minute=tenant.requests_per_minute,
            batch_creates_per_minute=tenant.batch_creates_per_minute,
        )
        with self._lock:
            self._entries[key_hash] = (copy, time.monotonic())
            self._entries.move_to_end(key_hash)
            while len(self._entries) > KEY_CACHE_SIZE:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_cache = _KeyCache()


def hash_key(key: str) -> str:
    """SHA-256 hex digest of a key (keys are random, so no salt or slow hash is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def ensure_tenant(session: Session, name: str) -> Tenant:
    return tenants_repo.get_by_name(session, name) or tenants_repo.create(session, name)


def create_key(session: Session, tenant_name: str, key_name: str | None = None) -> str:
    """Make a new key for ``tenant_name`` (created if new). Returns the key in plain text; it is
    shown once and cannot be recovered."""
    return issue_key(session, tenant_name, key_name)[1]


def issue_key(
    session: Session, tenant_name: str, key_name: str | None = None
) -> tuple[ApiKey, str]:
    """``create_key`` with the stored record too: ``(record, key in plain text)``."""
    tenant = ensure_tenant(session, tenant_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    prefix = key[: len(KEY_PREFIX) + 4]
    return tenants_repo.add_key(session, tenant.id, hash_key(key), prefix, key_name), key


def ensure_key(session: Session, tenant_name: str, key: str) -> None:
    """Register a known key (the documented local demo key) for ``tenant_name``, once; a known
    key revoked earlier (``revoke_known_key``, the demo's end) is put back in force."""
    if tenants_repo.set_revoked(session, hash_key(key), None):
        return
    tenant = ensure_tenant(session, tenant_name)
    tenants_repo.add_key(session, tenant.id, hash_key(key), key[:15], "local")


def cached_tenant(key: str) -> Tenant | None:
    """The tenant of ``key`` if this process looked it up in the last ``KEY_CACHE_SECONDS``
    (a transient ``Tenant``), else ``None`` (ask ``tenant_for_key``). No I/O: the API checks
    it on the event loop before crossing to the threadpool for a lookup."""
    return _cache.get(hash_key(key))


def tenant_for_key(db: Executor, key: str) -> Tenant | None:
    """The tenant of an unrevoked ``key``, or ``None``; from this process's cache when it was
    looked up in the last ``KEY_CACHE_SECONDS`` (then a transient ``Tenant``: read its
    columns, do not add it to a session)."""
    cached = cached_tenant(key)
    if cached is not None:
        return cached
    key_hash = hash_key(key)
    tenant = tenants_repo.tenant_for_key_hash(db, key_hash)
    if tenant is not None:
        _cache.put(key_hash, tenant)
    return tenant


def forget_cached() -> None:
    """Forget every key's cached tenant in this process (a tenant's rate limit changed)."""
    _cache.clear()


def list_keys(session: Session, tenant_name: str | None = None) -> list[tuple[ApiKey, str]]:
    """``(key, tenant name)`` for every key (or one tenant's), revoked ones included; a key is
    shown by its id and first characters (``prefix``), never in full (only its hash is kept)."""
    return tenants_repo.keys(session, tenant_name)


class UnknownKeyError(LookupError):
    """No key has this id."""


def revoke_known_key(session: Session, key: str) -> None:
    """Revoke a key given in plain text (the demo's published key, when the demo ends), if it
    was ever registered; this process honours it at once."""
    tenants_repo.set_revoked(session, hash_key(key), now())
    _cache.clear()


def revoke_key(session: Session, key_id: str) -> ApiKey:
    """Revoke a key by id (``key_…``): it gets 401 from this process's next request on, from
    other processes' within ``KEY_CACHE_SECONDS``. Idempotent: a key
    revoked already keeps its first ``revoked_at``. Raises ``UnknownKeyError``."""
    key = tenants_repo.revoke(session, key_id, now())
    if key is None:
        raise UnknownKeyError(key_id)
    _cache.clear()  # this process honours it at once; others within KEY_CACHE_SECONDS
    return key
