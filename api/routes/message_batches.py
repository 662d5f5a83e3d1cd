"""``/v1/messages/batches``: Anthropic's Message Batches API (``api.services.message_batches``).

Authenticated by ``x-api-key`` (the same keys as ``Authorization: Bearer``); the
``anthropic-version`` header is accepted and changes nothing. Errors come in Anthropic's shape
(``api.errors``).
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response, StreamingResponse

from api.deps import AnthropicTenant, BlobsDep, SessionDep, SettingsDep
from api.schemas.message_batches import (
    AnthropicErrorResponse,
    CreateMessageBatch,
    DeletedMessageBatch,
    MessageBatch,
    MessageBatchList,
)
from api.services import idempotency
from api.services import message_batches as service

router = APIRouter(prefix="/v1/messages/batches", tags=["message batches"])

_DESCRIPTIONS = {
    400: "invalid_request_error: a parameter is missing or invalid, or the batch's state "
    "does not allow this.",
    401: "authentication_error: no x-api-key, or an incorrect one.",
    404: "not_found_error: no such Message Batch (also for another tenant's id).",
    409: "invalid_request_error: a create with this Idempotency-Key is still running.",
    413: "request_too_large: the body is over 256 MB.",
    422: "invalid_request_error: the Idempotency-Key was used with another body.",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": AnthropicErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


async def _raw_body(request: Request) -> bytes:
    # Read here, parsed by the service: the requests are copied to the input file as they are.
    return await request.body()


def _schema() -> dict[str, Any]:
    """``CreateMessageBatch``'s JSON schema with its one nested model written in place (the
    route reads the body itself, so FastAPI does not list the model's schema)."""
    schema = CreateMessageBatch.model_json_schema()
    request = schema.pop("$defs")["MessageBatchRequest"]
    schema["properties"]["requests"]["items"] = request
    return schema


def _base_url(request: Request) -> str:
    return str(request.base_url)


@router.post(
    "",
    response_model=MessageBatch,
    responses=_errors(400, 401, 409, 413, 422),
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": _schema()}}}
    },
)
def create_message_batch(
    request: Request,
    raw: Annotated[bytes, Depends(_raw_body)],
    session: SessionDep,
    settings: SettingsDep,
    blobs: BlobsDep,
    tenant: AnthropicTenant,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias=idempotency.HEADER,
            description="Makes the create safe to retry: a retry with the same key and body "
            "returns the first answer and creates nothing (kept 24 h, per tenant).",
        ),
    ] = None,
) -> Response:
    once = idempotency.Idempotency(
        settings=settings,
        tenant_id=tenant.id,
        key=idempotency.parse_key(idempotency_key),
        method=request.method,
        path=request.url.path,
    )

    def produce() -> MessageBatch:
        batch = service.create(session, blobs, settings, tenant.id, raw)
        counts = service.counts(session, [batch])
        return MessageBatch.of(batch, counts[batch.id], _base_url(request))

    # The body's bytes identify it: a client's retry sends the same ones.
    return once.run(session, hashlib.sha256(raw).hexdigest(), produce)


@router.get("", response_model=MessageBatchList, responses=_errors(400, 401))
def list_message_batches(
    request: Request,
    session: SessionDep,
    tenant: AnthropicTenant,
    after_id: str | None = None,
    before_id: str | None = None,
    # Documented, not enforced here: the service refuses other values with its own message.
    limit: Annotated[int, Query(json_schema_extra={"minimum": 1, "maximum": 1000})] = 20,
) -> MessageBatchList:
    rows, has_more = service.page(
        session, tenant.id, after_id=after_id, before_id=before_id, limit=limit
    )
    counts = service.counts(session, rows)
    data = [MessageBatch.of(b, counts[b.id], _base_url(request)) for b in rows]
    return MessageBatchList(
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )


@router.get("/{message_batch_id}", response_model=MessageBatch, responses=_errors(400, 401, 404))
def retrieve_message_batch(
    request: Request, session: SessionDep, tenant: AnthropicTenant, message_batch_id: str
) -> MessageBatch:
    batch = service.get(session, tenant.id, message_batch_id)
    return MessageBatch.of(batch, service.counts(session, [batch])[batch.id], _base_url(request))


@router.post(
    "/{message_batch_id}/cancel", response_model=MessageBatch, responses=_errors(400, 401, 404)
)
def cancel_message_batch(
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    tenant: AnthropicTenant,
    message_batch_id: str,
) -> MessageBatch:
    batch = service.cancel(session, settings, tenant.id, message_batch_id)
    return MessageBatch.of(batch, service.counts(session, [batch])[batch.id], _base_url(request))


@router.delete(
    "/{message_batch_id}", response_model=DeletedMessageBatch, responses=_errors(400, 401, 404)
)
def delete_message_batch(
    session: SessionDep, blobs: BlobsDep, tenant: AnthropicTenant, message_batch_id: str
) -> DeletedMessageBatch:
    batch = service.delete(session, blobs, tenant.id, message_batch_id)
    return DeletedMessageBatch(id=batch.id)


@router.get(
    "/{message_batch_id}/results",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "JSONL: one `{custom_id, result}` line per request.",
            "content": {"application/x-jsonl": {}},
        },
        **_errors(400, 401, 404),
    },
)
def message_batch_results(
    session: SessionDep, blobs: BlobsDep, tenant: AnthropicTenant, message_batch_id: str
) -> StreamingResponse:
    chunks = service.results(session, blobs, tenant.id, message_batch_id)
    return StreamingResponse(chunks, media_type="application/x-jsonl")
