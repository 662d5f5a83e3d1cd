"""``/metrics``: Prometheus' text format, for the operator's scraper only: the series show
billed dollars, queues and worker ids, so the request must carry the metrics token
(``OFFPEAK_METRICS_TOKEN``, Prometheus' ``authorization: {credentials: …}``) or the admin key."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers

from api import key_gate
from api.deps import SettingsDep
from api.errors import Unauthorized, error_responses
from api.services import fleet_metrics as metrics_service

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {
            "description": "Prometheus' text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
        **error_responses(401),
    },
)
def metrics(request: Request, settings: SettingsDep) -> Response:
    if not key_gate.is_operator(Headers(scope=request.scope), settings):
        raise Unauthorized(
            "/metrics needs 'Authorization: Bearer <OFFPEAK_METRICS_TOKEN>' (or the admin key)."
        )
    return Response(metrics_service.exposition(settings), media_type=CONTENT_TYPE_LATEST)
