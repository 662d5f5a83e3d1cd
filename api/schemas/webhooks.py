"""Wire types of ``/v1/webhook_endpoints``: OpenAI's webhook endpoint objects (the shapes of the
``openai`` SDK's ``client.webhooks``: ``WebhookEndpoint``, ``WebhookEndpointWithSecret``,
``DeletedWebhookEndpoint``, ``WebhookEndpointTestResult``) and Offpeak's delivery log."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from offpeak import webhook_protocol
from storage.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, WebhookEvent

EventType = Literal[
    "batch.completed",
    "batch.failed",
    "batch.expired",
    "batch.cancelled",
    "batch.paused",
    "batch.resumed",
]
assert set(EventType.__args__) == set(webhook_protocol.EVENT_TYPES)  # type: ignore[attr-defined]


class CreateWebhookEndpoint(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str = Field(max_length=2048, description="The HTTPS URL that receives deliveries.")
    event_types: list[EventType] = Field(min_length=1)
    #: OpenAI requires a name; here it defaults to the URL.
    name: str | None = Field(default=None, max_length=200)


class UpdateWebhookEndpoint(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str | None = Field(default=None, max_length=2048)
    event_types: list[EventType] | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, max_length=200)


class RotateSecret(BaseModel):
    model_config = ConfigDict(extra="ignore")

    keep_old_secret_active_for_24_hours: bool = False


class TestWebhook(BaseModel):
    model_config = ConfigDict(extra="ignore")

    event_type: EventType


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    name: str
    url: str
    event_types: list[str]
    created_at: int
    updated_at: int
    signing_secret_hint: str

    @classmethod
    def of(cls, endpoint: WebhookEndpoint) -> WebhookEndpointObject:
        return cls(
            id=endpoint.id,
            name=endpoint.name,
            url=endpoint.url,
            event_types=list(endpoint.event_types),
            created_at=endpoint.created_at,
            updated_at=endpoint.updated_at,
            signing_secret_hint=webhook_protocol.secret_hint(endpoint.secret),
        )


class WebhookEndpointWithSecret(WebhookEndpointObject):
    """Answered by create and rotate only: the one time the secret is shown."""

    signing_secret: str

    @classmethod
    def with_secret(cls, endpoint: WebhookEndpoint) -> WebhookEndpointWithSecret:
        return cls(
            **WebhookEndpointObject.of(endpoint).model_dump(), signing_secret=endpoint.secret
        )


class WebhookEndpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookEndpointObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedWebhookEndpoint(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class WebhookTestResult(BaseModel):
    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    #: The receiver's answer.
    status_code: int
    success: Literal[True] = True


class WebhookAttemptObject(BaseModel):
    attempt: int
    #: Unix seconds (float) the attempt ended.
    at: float
    #: The receiver's status code; ``null`` when no answer came (see ``error``).
    status_code: int | None
    latency_ms: float
    error: str | None

    @classmethod
    def of(cls, row: WebhookAttempt) -> WebhookAttemptObject:
        return cls(
            attempt=row.attempt,
            at=row.at,
            status_code=row.status_code,
            latency_ms=round(row.latency_seconds * 1000, 1),
            error=row.error,
        )


class WebhookDeliveryObject(BaseModel):
    """Offpeak's delivery log entry: one event owed to one endpoint and its attempts."""

    id: str
    object: Literal["webhook_endpoint.delivery"] = "webhook_endpoint.delivery"
    event_id: str
    event_type: str
    #: The batch the event is about (``data.id`` of the event).
    data_id: str
    #: ``pending`` (retrying), ``delivered`` (a 2xx answer) or ``failed`` (retries ended).
    status: str
    created_at: int
    next_attempt_at: int | None
    delivered_at: int | None
    attempts: list[WebhookAttemptObject]

    @classmethod
    def of(
        cls, delivery: WebhookDelivery, event: WebhookEvent, attempts: list[WebhookAttempt]
    ) -> WebhookDeliveryObject:
        return cls(
            id=delivery.id,
            event_id=event.id,
            event_type=event.type,
            data_id=event.object_id,
            status=delivery.status,
            created_at=int(delivery.created_at),
            next_attempt_at=None
            if delivery.next_attempt_at is None
            else int(delivery.next_attempt_at),
            delivered_at=None if delivery.delivered_at is None else int(delivery.delivered_at),
            attempts=[WebhookAttemptObject.of(a) for a in attempts],
        )


class WebhookDeliveryList(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookDeliveryObject]
    first_id: str | None
    last_id: str | None
    has_more: bool
