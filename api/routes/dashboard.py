"""``/dashboard``: a page that shows the caller's batches, throughput and load, refreshing
itself from ``/v1/dashboard``. The page and its scripts carry no data and need no key; the data
endpoint takes the tenant's key like every ``/v1`` call, or the admin key (every tenant's
figures)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse

from api.deps import SessionDep, SettingsDep, TenantOrOperator
from api.errors import BadRequest, NotFound, error_responses
from api.services import dashboard as dashboard_service

router = APIRouter(tags=["dashboard"])
STATIC = Path(__file__).resolve().parents[1] / "static"
#: Files the page loads; Chart.js is vendored from its npm package (see api/static/README.md).
ASSETS = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "chart.umd.min.js": "text/javascript",
}


#: The page runs only its own scripts and styles, talks only to this API, and cannot be framed.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


@router.get("/dashboard", include_in_schema=False)
def page() -> FileResponse:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers=SECURITY_HEADERS)


@router.get("/dashboard/static/{name}", include_in_schema=False)
def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise NotFound(f"No such file: {name}")
    return FileResponse(STATIC / name, media_type=ASSETS[name], headers=SECURITY_HEADERS)


@router.get("/v1/dashboard", responses=error_responses(400, 401))
def dashboard_data(
    session: SessionDep,
    settings: SettingsDep,
    tenant: TenantOrOperator,
    hours: Annotated[float, Query(json_schema_extra={"exclusiveMinimum": 0})] = 3.0,
) -> dict[str, Any]:
    """The page's data: latest batches with figures, per-model throughput, chart series, the
    tenant's queue, share and limits; with the admin key, every tenant's figures."""
    if not 0 < hours <= settings.load_history_hours:
        raise BadRequest(f"hours must be in (0, {settings.load_history_hours:g}].", param="hours")
    if tenant is None:
        return dashboard_service.operator_data(session, settings)
    return dashboard_service.data(session, settings, tenant.id, hours=hours)
