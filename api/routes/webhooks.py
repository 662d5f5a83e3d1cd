"""``/v1/webhook_endpoints``: OpenAI's webhook endpoint API (the ``openai`` SDK's
``client.webhooks.create / retrieve / update / list / delete / rotate_secret / test``), plus
``GET /v1/webhook_endpoints/{id}/deliveries``, the delivery log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.schemas.webhooks import (
    CreateWebhookEndpoint,
    DeletedWebhookEndpoint,
    RotateSecret,
    TestWebhook,
    UpdateWebhookEndpoint,
    WebhookDeliveryList,
    WebhookDeliveryObject,
    WebhookEndpointList,
    WebhookEndpointObject,
    WebhookEndpointWithSecret,
    WebhookTestResult,
)
from api.services import webhooks as webhooks_service

router = APIRouter(prefix="/v1/webhook_endpoints", tags=["webhooks"])
Limit = Annotated[int, Query(json_schema_extra={"minimum": 1, "maximum": 100})]


@router.post("", response_model=WebhookEndpointWithSecret, responses=error_responses(400, 401, 422))
def create_endpoint(
    body: CreateWebhookEndpoint, session: SessionDep, settings: SettingsDep, tenant: CurrentTenant
) -> WebhookEndpointWithSecret:
    """The answer carries ``signing_secret``: the only time it is shown."""
    endpoint = webhooks_service.create(session, settings, tenant.id, body)
    return WebhookEndpointWithSecret.with_secret(endpoint)


@router.get("", response_model=WebhookEndpointList, responses=error_responses(400, 401))
def list_endpoints(
    session: SessionDep, tenant: CurrentTenant, after: str | None = None, limit: Limit = 20
) -> WebhookEndpointList:
    rows, has_more = webhooks_service.page(session, tenant.id, after=after, limit=limit)
    data = [WebhookEndpointObject.of(e) for e in rows]
    return WebhookEndpointList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


@router.get(
    "/{endpoint_id}", response_model=WebhookEndpointObject, responses=error_responses(400, 401, 404)
)
def retrieve_endpoint(
    session: SessionDep, tenant: CurrentTenant, endpoint_id: str
) -> WebhookEndpointObject:
    return WebhookEndpointObject.of(webhooks_service.get(session, tenant.id, endpoint_id))


@router.post(
    "/{endpoint_id}",
    response_model=WebhookEndpointObject,
    responses=error_responses(400, 401, 404, 422),
)
def update_endpoint(
    body: UpdateWebhookEndpoint,
    session: SessionDep,
    settings: SettingsDep,
    tenant: CurrentTenant,
    endpoint_id: str,
) -> WebhookEndpointObject:
    endpoint = webhooks_service.update(session, settings, tenant.id, endpoint_id, body)
    return WebhookEndpointObject.of(endpoint)


@router.delete(
    "/{endpoint_id}",
    response_model=DeletedWebhookEndpoint,
    responses=error_responses(400, 401, 404),
)
def delete_endpoint(
    session: SessionDep, tenant: CurrentTenant, endpoint_id: str
) -> DeletedWebhookEndpoint:
    webhooks_service.delete(session, tenant.id, endpoint_id)
    return DeletedWebhookEndpoint(id=endpoint_id)


@router.post(
    "/{endpoint_id}/rotate_secret",
    response_model=WebhookEndpointWithSecret,
    responses=error_responses(400, 401, 404, 422),
)
def rotate_secret(
    session: SessionDep,
    tenant: CurrentTenant,
    endpoint_id: str,
    body: RotateSecret | None = None,
) -> WebhookEndpointWithSecret:
    keep = body.keep_old_secret_active_for_24_hours if body else False
    endpoint = webhooks_service.rotate_secret(session, tenant.id, endpoint_id, keep_old=keep)
    return WebhookEndpointWithSecret.with_secret(endpoint)


@router.post(
    "/{endpoint_id}/test",
    response_model=WebhookTestResult,
    responses=error_responses(400, 401, 404, 422),
)
def test_endpoint(
    body: TestWebhook,
    settings: SettingsDep,
    tenant: CurrentTenant,
    endpoint_id: str,
) -> WebhookTestResult:
    """Sends a signed sample event now and answers the receiver's status code (no database
    session is held while the receiver answers)."""
    code = webhooks_service.send_test(settings, tenant.id, endpoint_id, body.event_type)
    return WebhookTestResult(
        webhook_endpoint_id=endpoint_id, event_type=body.event_type, status_code=code
    )


@router.get(
    "/{endpoint_id}/deliveries",
    response_model=WebhookDeliveryList,
    responses=error_responses(400, 401, 404),
)
def list_deliveries(
    session: SessionDep,
    tenant: CurrentTenant,
    endpoint_id: str,
    after: str | None = None,
    limit: Limit = 20,
) -> WebhookDeliveryList:
    """The delivery log, newest first: each event owed to the endpoint, its status and every
    attempt (attempt number, status code, latency)."""
    rows, has_more = webhooks_service.deliveries(
        session, tenant.id, endpoint_id, after=after, limit=limit
    )
    data = [WebhookDeliveryObject.of(d, e, a) for d, e, a in rows]
    return WebhookDeliveryList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )
