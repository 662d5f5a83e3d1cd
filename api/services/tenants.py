"""The operator's view of tenants (``offpeak tenants``, ``/v1/admin/tenants``): each tenant's
weight, quota and rate-limit overrides, the limits in force and its use of them, its queue
positions and engine share (``api.services.tenant_views``); and setting the overrides.

A tenant's overrides are its ``tenants`` columns (``None``: the setting's default,
``offpeak.tenant_limits``); a new figure applies to the next create, upload or validation at
once, and to its keys' rate limit within ``keys.KEY_CACHE_SECONDS`` on every API process.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from api.errors import BadRequest, NotFound
from api.services import keys, tenant_views
from api.services import quotas as quotas_service
from offpeak import tenant_limits
from offpeak.settings import Settings
from storage.models import Tenant
from storage.repositories import quotas as quotas_repo
from storage.repositories import tenants as tenants_repo

#: What ``set_overrides`` may change: the weight and every limit.
SETTABLE = ("weight", *tenant_limits.LIMIT_NAMES)


def _view(
    tenant: Tenant,
    settings: Settings,
    use: quotas_repo.TenantUse,
    views: dict[str, Any],
    rates: dict[str, float | None],
) -> dict[str, Any]:
    shown = quotas_service.shown_models(settings, use)
    mine = {model: rate for model, rate in rates.items() if model in shown}
    return {
        "object": "tenant",
        "id": tenant.id,
        "name": tenant.name,
        "created_at": tenant.created_at,
        "weight": tenant.weight if tenant.weight is not None else 1.0,
        "overrides": {name: getattr(tenant, name) for name in tenant_limits.LIMIT_NAMES},
        **quotas_service.figures(tenant, settings, use, mine),
        **views,
    }


def list_tenants(session: Session, settings: Settings) -> list[dict[str, Any]]:
    """Every tenant's view, by name."""
    tenants = tenants_repo.all_tenants(session)
    ids = [tenant.id for tenant in tenants]
    use = quotas_repo.use_of(session, ids)
    views = tenant_views.figures(session, settings, ids)
    models = set().union(*(quotas_service.shown_models(settings, u) for u in use.values()))
    rates = quotas_service.model_rates(session, settings, models)
    return [_view(tenant, settings, use[tenant.id], views[tenant.id], rates) for tenant in tenants]


def _one(session: Session, settings: Settings, tenant: Tenant) -> dict[str, Any]:
    use = quotas_repo.use_of(session, [tenant.id])[tenant.id]
    rates = quotas_service.model_rates(
        session, settings, quotas_service.shown_models(settings, use)
    )
    return _view(
        tenant,
        settings,
        use,
        tenant_views.figures(session, settings, [tenant.id])[tenant.id],
        rates,
    )


def _find(session: Session, name_or_id: str) -> Tenant:
    tenant = tenants_repo.find(session, name_or_id)
    if tenant is None:
        raise NotFound(f"No tenant named or with id '{name_or_id}'.", param="tenant")
    return tenant


def show(session: Session, settings: Settings, name_or_id: str) -> dict[str, Any]:
    """One tenant's view. Raises ``NotFound``."""
    return _one(session, settings, _find(session, name_or_id))


def set_overrides(
    session: Session, settings: Settings, name_or_id: str, changes: dict[str, Any]
) -> dict[str, Any]:
    """Set the named overrides (``SETTABLE``; a limit of ``None``: back to the default) and
    return the tenant's view. Raises ``NotFound`` and ``BadRequest`` (an unknown name, a
    weight that is not > 0, a limit that is not an integer >= -1; ``tenant_limits.UNLIMITED``,
    -1: no limit for this tenant whatever the default)."""
    tenant = _find(session, name_or_id)
    for name, value in changes.items():
        if name not in SETTABLE:
            raise BadRequest(f"Unknown setting {name!r}; settable: {', '.join(SETTABLE)}.")
        if name == "weight":
            if value is None:
                value = 1.0  # the default weight
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise BadRequest("weight must be a number > 0.", param="weight")
            tenant.weight = float(value)
        elif value is None or (type(value) is int and value >= tenant_limits.UNLIMITED):
            setattr(tenant, name, value)
        else:
            raise BadRequest(
                f"{name} must be an integer >= 0, -1 (unlimited) or null (the default).",
                param=name,
            )
    session.flush()
    keys.forget_cached()  # this process's keys see a new rate limit at once
    return _one(session, settings, tenant)
