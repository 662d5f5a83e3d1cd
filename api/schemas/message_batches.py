"""Wire types of Anthropic's Message Batches API (``/v1/messages/batches``), built from the same
batch rows as OpenAI's Batch objects.

Shapes follow Anthropic's API reference (Message Batches) and the official ``anthropic`` SDK's
types (``anthropic.types.messages``): times are RFC 3339 strings, ids ``msgbatch_…``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from offpeak.statuses import BatchStatus
from storage.models import Batch

#: ``processing_status`` of each batch status: Anthropic has three.
PROCESSING_STATUS: dict[str, Literal["in_progress", "canceling"]] = {
    BatchStatus.VALIDATING: "in_progress",
    BatchStatus.IN_PROGRESS: "in_progress",
    BatchStatus.FINALIZING: "in_progress",
    BatchStatus.CANCELLING: "canceling",
}


def rfc3339(unix_seconds: int | float | None) -> str | None:
    """``2026-12-01T12:00:00Z`` of a unix time, ``None`` for none."""
    if unix_seconds is None:
        return None
    return datetime.fromtimestamp(unix_seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class MessageBatchRequestCounts(BaseModel):
    """Requests by outcome. As Anthropic's, they move from ``processing`` to the others only
    once processing of the whole batch has ended; they always add up to the batch's requests."""

    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatch(BaseModel):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: MessageBatchRequestCounts
    created_at: str
    expires_at: str
    ended_at: str | None
    cancel_initiated_at: str | None
    archived_at: str | None = None
    #: Where ``GET …/results`` streams the results, once the batch has ended.
    results_url: str | None

    @classmethod
    def of(cls, batch: Batch, counts: MessageBatchRequestCounts, base_url: str) -> MessageBatch:
        """``base_url``: the API's own root (``http://host:port``), for ``results_url``."""
        ended = batch.ended_at
        return cls(
            id=batch.id,
            processing_status=PROCESSING_STATUS.get(batch.status, "ended"),
            request_counts=counts,
            created_at=rfc3339(batch.created_at) or "",
            expires_at=rfc3339(batch.expires_at) or "",
            ended_at=rfc3339(ended),
            cancel_initiated_at=rfc3339(batch.cancelling_at),
            results_url=(
                f"{base_url.rstrip('/')}/v1/messages/batches/{batch.id}/results"
                if ended is not None
                else None
            ),
        )


class MessageBatchList(BaseModel):
    """A page, newest first: ``first_id``/``last_id`` are the cursors for ``before_id`` and
    ``after_id``."""

    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class DeletedMessageBatch(BaseModel):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"


class MessageBatchRequest(BaseModel):
    """One of ``requests``: the ``params`` are a Messages API body, checked when the request
    runs (a problem ends that request ``errored``)."""

    custom_id: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    params: dict[str, Any]


class CreateMessageBatch(BaseModel):
    """``POST /v1/messages/batches``: 1 to 100,000 requests (256 MB at most)."""

    requests: list[MessageBatchRequest] = Field(min_length=1, max_length=100_000)


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error on these routes: ``{"type": "error", "error": {type, message}}``."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
