"""``/v1/usage``: what the calling tenant was billed."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentTenant, SessionDep
from api.errors import error_responses
from api.schemas.usage import UsageReport
from api.services import billing as billing_service
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
    ``[start, end)`` (unix seconds), grouped by ``model`` or ``day`` (UTC)."""
    return billing_service.report(session, tenant.id, start=start, end=end, group_by=group_by)
