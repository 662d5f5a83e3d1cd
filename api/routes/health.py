"""``/healthz`` (liveness: 200 while the process runs, with what is alive behind it) and
``/readyz`` (readiness: 200 when the database answers with the code's schema, else 503).

Neither needs a key: probes and load balancers call them. ``/healthz`` says more to a key
(``offpeak submit --wait`` reads it with the tenant's to warn about a model no engine worker
serves) and names hosts only to an operator; neither ever shows a tenant's data.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.datastructures import Headers

from api import key_gate
from api.deps import SettingsDep
from api.errors import RETRY_AFTER_SECONDS
from api.schemas.common import ErrorResponse
from api.schemas.health import Health, HealthStatus, Ready
from api.services import health as health_service
from api.services import keys
from offpeak.settings import Settings
from offpeak.wire import error_object
from storage.db import read

router = APIRouter(tags=["health"])


def _viewer(request: Request, settings: Settings) -> health_service.Viewer:
    headers = Headers(scope=request.scope)
    if key_gate.is_operator(headers, settings):
        return "operator"
    key = key_gate.presented_key(headers)
    if key is None:
        return "anonymous"
    try:
        tenant = keys.cached_tenant(key) or read(
            settings.resolved_database_url, keys.tenant_for_key, key
        )
    except SQLAlchemyError:
        return "anonymous"  # the key cannot be checked while the database is down
    return "tenant" if tenant is not None else "anonymous"


@router.get("/healthz", response_model=Health | HealthStatus)
def healthz(request: Request, settings: SettingsDep) -> Health | HealthStatus:
    """Liveness: always 200 while the API process runs (a database outage is reported in the
    body, not by failing: restarting the API would not fix it). Without a key, only the status;
    with a tenant's key, the live control and engine workers (without their hosts) and the
    configured models that have no live engine worker; with the admin key or the metrics token,
    the workers' ids and hosts too."""
    return health_service.for_viewer(health_service.health(settings), _viewer(request, settings))


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
