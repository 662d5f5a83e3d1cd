"""``/v1/usage``: what the calling tenant was billed; ``/v1/limits``: its quotas and rate limit
beside its use of them; ``/v1/queue``: where its queued lines stand and its share of the
engines."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.schemas.admin import QueueView, TenantLimitsView
from api.schemas.usage import UsageReport
from api.services import billing as billing_service
from api.services import quotas as quotas_service
from api.services import tenant_views
from api.services.billing import GroupBy

router = APIRouter(tags=["usage"])


@router.get("/v1/usage", response_model=UsageReport, responses=error_responses(400, 401))
def get_usage(
    session: SessionDep,
    tenant: CurrentTenant,
    start: int | None = None,
    end: int | None = None,
    group_by: GroupBy | None = None,
) -> UsageReport:
    """Requests, tokens, GPU-seconds, cost and price of the tenant's batches that ended in
    ``[start, end)`` (unix seconds), grouped by ``model``, ``day`` (UTC) or ``adapter`` (per
    model and LoRA adapter; engine seconds and cost shared by tokens)."""
    return billing_service.report(session, tenant.id, start=start, end=end, group_by=group_by)


@router.get("/v1/limits", response_model=TenantLimitsView, responses=error_responses(401))
def get_limits(
    session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> dict[str, object]:
    """The calling tenant's limits in force (``null``: none) and its use of them."""
    return quotas_service.of_tenant(session, settings, tenant.id)


@router.get("/v1/queue", response_model=QueueView, responses=error_responses(401))
def get_queue(
    session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> dict[str, object]:
    """The calling tenant's queued lines per model with the lines of other tenants that will run
    before them, and its share of the engines over the last hour against its entitled share.
    Counts only: no other tenant is named."""
    return {"object": "queue", **tenant_views.figures(session, settings, [tenant.id])[tenant.id]}
