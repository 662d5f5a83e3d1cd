"""``/v1/admin/scheduler``: pause and resume batch work, and the scheduler's view;
``/v1/admin/tenants``: every tenant's weight, limits and use, and setting its overrides;
``/v1/admin/adapters``: LoRA adapters registered on the running service.

Guarded by the admin key (``OFFPEAK_ADMIN_API_KEY``), not a tenant's: both affect everyone.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api import key_gate
from api.deps import SessionDep, SettingsDep
from api.errors import Unauthorized, error_responses
from api.schemas.adapters import AdapterDeleted, AdapterList, AdapterView, AddAdapter
from api.schemas.admin import (
    PauseRequest,
    PauseSwitch,
    ResumeRequest,
    SchedulerView,
    TenantList,
    TenantUpdate,
    TenantView,
)
from api.services import adapters as adapters_service
from api.services import admin as admin_service
from api.services import tenants as tenants_service

router = APIRouter(prefix="/v1/admin/scheduler", tags=["admin"])
tenants_router = APIRouter(prefix="/v1/admin/tenants", tags=["admin"])
adapters_router = APIRouter(prefix="/v1/admin/adapters", tags=["admin"])


admin_key_scheme = HTTPBearer(
    auto_error=False, scheme_name="AdminKey", description="OFFPEAK_ADMIN_API_KEY."
)


def require_admin(
    request: Request,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(admin_key_scheme)],
) -> None:
    """``Authorization: Bearer <OFFPEAK_ADMIN_API_KEY>``, checked by ``api.key_gate`` before the
    body is read (always 401 while the key is unset); 401 for a request that missed the key gate."""
    if getattr(request.state, "admin", None) is not True:
        raise Unauthorized(key_gate.WRONG_ADMIN_KEY)


AdminDep = Depends(require_admin)


#: Bodies are JSON (422 when not), under the JSON body limit (413).
_WITH_BODY = error_responses(400, 401, 413, 422)


@router.post("/pause", response_model=PauseSwitch, dependencies=[AdminDep], responses=_WITH_BODY)
def pause(body: PauseRequest, session: SessionDep) -> PauseSwitch:
    return admin_service.pause(session, body.pool, hard=body.hard, reason=body.reason)


@router.post("/resume", response_model=PauseSwitch, dependencies=[AdminDep], responses=_WITH_BODY)
def resume(body: ResumeRequest, session: SessionDep) -> PauseSwitch:
    return admin_service.resume(session, body.pool)


@router.get(
    "", response_model=SchedulerView, dependencies=[AdminDep], responses=error_responses(401)
)
def scheduler_view(session: SessionDep) -> SchedulerView:
    return admin_service.view(session)


@tenants_router.get(
    "", response_model=TenantList, dependencies=[AdminDep], responses=error_responses(401)
)
def list_tenants(session: SessionDep, settings: SettingsDep) -> dict[str, object]:
    return {"object": "list", "data": tenants_service.list_tenants(session, settings)}


@tenants_router.get(
    "/{tenant}",
    response_model=TenantView,
    dependencies=[AdminDep],
    responses=error_responses(401, 404),
)
def show_tenant(session: SessionDep, settings: SettingsDep, tenant: str) -> dict[str, object]:
    """``tenant``: the tenant's name or id."""
    return tenants_service.show(session, settings, tenant)


@tenants_router.post(
    "/{tenant}",
    response_model=TenantView,
    dependencies=[AdminDep],
    responses=error_responses(400, 401, 404, 413, 422),
)
def update_tenant(
    body: TenantUpdate, session: SessionDep, settings: SettingsDep, tenant: str
) -> dict[str, object]:
    """Set the overrides the body names (``null``: back to the setting's default)."""
    return tenants_service.set_overrides(
        session, settings, tenant, body.model_dump(exclude_unset=True)
    )


@adapters_router.get(
    "", response_model=AdapterList, dependencies=[AdminDep], responses=error_responses(401)
)
def list_adapters(session: SessionDep, settings: SettingsDep) -> AdapterList:
    """Every LoRA adapter served: the configuration's (``lora_modules``) and registered ones."""
    return AdapterList(data=adapters_service.list_adapters(session, settings))


@adapters_router.post(
    "",
    response_model=AdapterView,
    dependencies=[AdminDep],
    responses=error_responses(400, 401, 409, 413, 422),
)
def add_adapter(body: AddAdapter, session: SessionDep, settings: SettingsDep) -> AdapterView:
    """Register a LoRA adapter on a served base model (again: re-point it); lines may name it
    as their ``model`` at once, on every API replica and engine worker."""
    return adapters_service.add(session, settings, body.name, body.base_model, body.path)


@adapters_router.delete(
    "/{name:path}",
    response_model=AdapterDeleted,
    dependencies=[AdminDep],
    responses=error_responses(401, 404, 409),
)
def remove_adapter(name: str, session: SessionDep, settings: SettingsDep) -> AdapterDeleted:
    """Forget a registered adapter (a configured one is removed from the configuration)."""
    adapters_service.remove(session, settings, name)
    return AdapterDeleted(name=name)
