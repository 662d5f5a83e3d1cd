"""``/healthz`` (liveness: 200 while the process runs, with what is alive behind it) and
``/readyz`` (readiness: 200 when the database answers with the code's schema, else 503).

Neither takes a key: probes and load balancers call them, and ``offpeak submit --wait`` reads
``/healthz`` to warn about a model no engine worker serves. They name workers and models, never
a tenant's data.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.deps import SettingsDep
from api.errors import RETRY_AFTER_SECONDS
from api.schemas.common import ErrorResponse
from api.schemas.health import Health, Ready
from api.services import health as health_service
from offpeak.wire import error_object

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
def healthz(settings: SettingsDep) -> Health:
    """Liveness: always 200 while the API process runs (a database outage is reported in the
    body, not by failing: restarting the API would not fix it). Lists the live control and
    engine workers and the configured models that have no live engine worker."""
    return health_service.health(settings)


@router.get(
    "/readyz",
    response_model=Ready,
    responses={503: {"model": ErrorResponse, "description": "Not ready: see error.code."}},
)
def readyz(settings: SettingsDep) -> Ready | JSONResponse:
    """Readiness: 200 when the database answers and its schema is migrated to the code's head;
    503 (``database_unavailable`` or ``schema_out_of_date``) otherwise. A model with no live
    engine worker keeps the API ready: batches are accepted and wait for a worker."""
    try:
        return health_service.readiness(settings)
    except health_service.NotReady as exc:
        body = error_object(exc.message, type="server_error", code=exc.code)
        return JSONResponse(
            body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
        )
