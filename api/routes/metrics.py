"""``/metrics``: Prometheus' text format (no key: scrapers are configured by the operator, and
the series carry no tenant's data)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from api.deps import SettingsDep
from api.services import fleet_metrics as metrics_service

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus' text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
def metrics(settings: SettingsDep) -> Response:
    return Response(metrics_service.exposition(settings), media_type=CONTENT_TYPE_LATEST)
