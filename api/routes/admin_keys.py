"""``/v1/admin/keys``: create, list and revoke API keys with the admin key, so an operator
manages keys without database access (``offpeak keys … --admin-url``)."""

from __future__ import annotations

from fastapi import APIRouter, Query

from api.deps import SessionDep
from api.errors import NotFound, error_responses
from api.routes.admin import AdminDep
from api.schemas.admin_keys import AdminKey, AdminKeyList, CreateKey
from api.services import keys as keys_service
from storage.models import ApiKey, Tenant

router = APIRouter(prefix="/v1/admin/keys", tags=["admin"], dependencies=[AdminDep])


def _shown(key: ApiKey, tenant: str, plain: str | None = None) -> AdminKey:
    return AdminKey(
        id=key.id,
        tenant=tenant,
        name=key.name,
        prefix=key.prefix,
        created_at=key.created_at,
        revoked_at=key.revoked_at,
        key=plain,
    )


@router.post("", response_model=AdminKey, responses=error_responses(400, 401, 413, 422))
def create_key(body: CreateKey, session: SessionDep) -> AdminKey:
    """A new key for ``tenant`` (created if new); ``key`` is shown in this answer only."""
    key, plain = keys_service.issue_key(session, body.tenant, body.name)
    return _shown(key, body.tenant, plain)


@router.get("", response_model=AdminKeyList, responses=error_responses(400, 401))
def list_keys(
    session: SessionDep, tenant: str | None = Query(default=None, max_length=200)
) -> AdminKeyList:
    """Every key (or one tenant's), revoked ones included, oldest first."""
    rows = keys_service.list_keys(session, tenant)
    return AdminKeyList(data=[_shown(key, name) for key, name in rows])


@router.post("/{key_id}/revoke", response_model=AdminKey, responses=error_responses(401, 404))
def revoke_key(key_id: str, session: SessionDep) -> AdminKey:
    """Revoke a key by id: 401 from every API process within 5 s. Revoking again changes
    nothing. 404 for an unknown id."""
    try:
        key = keys_service.revoke_key(session, key_id)
    except keys_service.UnknownKeyError:
        raise NotFound(f"No API key with id {key_id!r}.", param="key_id") from None
    tenant = session.get(Tenant, key.tenant_id)
    return _shown(key, tenant.name if tenant else "")
