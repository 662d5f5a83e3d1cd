"""Wire types of ``/v1/batches``: OpenAI's Batch object with Offpeak's money and schedule
fields, built from storage rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.schemas.common import column_values
from offpeak import endpoints
from offpeak.billing import Bill
from offpeak.statuses import BatchStatus
from storage.models import Batch


class BatchErrorEntry(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorEntry]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """OpenAI's batch ``usage``, and Offpeak's extension: what the prefix cache saved.
    ``prefix_cache_hit_rate`` is cached over input tokens (0 before any); ``prompt_tokens_computed``
    is input minus cached tokens; ``min_prompt_tokens`` the least the engine could have computed
    (each prefix group's shared prefix once, ``storage.repositories.batches.min_prompt_tokens``),
    ``None`` until the batch ends."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    prefix_cache_hit_rate: float = 0.0
    prompt_tokens_computed: int = 0
    min_prompt_tokens: int | None = None


class BatchEstimate(BaseModel):
    """What a batch should cost, known before it runs: its prompt tokens counted with the
    model's own tokenizer, the most completion tokens its lines allow (``max_tokens`` × ``n``,
    or the context window's rest), and the batch price from the prompts alone (``price_low``)
    to the prompts plus every completion budget (``price_high``), in US dollars. Lines the
    endpoint would refuse (``invalid_requests``: they fail alone, unbilled) are left out."""

    prompt_tokens: int
    max_completion_tokens: int
    price_low: float
    price_high: float
    requests: int
    invalid_requests: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None
    # Offpeak's additions (extra fields, which the openai SDK keeps), in US dollars: engine
    # seconds attributed to the batch, our cost, the price billed, the real-time list price of
    # the same tokens and the saving. Live estimates until ``billed_at`` is set (offpeak.billing).
    gpu_seconds: float | None = None
    cost: float | None = None
    price: float | None = None
    cost_per_million_tokens: float | None = None
    realtime_price: float | None = None
    saving: float | None = None
    billed_at: int | None = None
    # The scheduler's estimate while the batch runs (docs/scheduling.md): seconds to spare between
    # the estimated completion time (unix seconds) and ``expires_at``; negative means late.
    slack_seconds: float | None = None
    estimated_completion_at: int | None = None
    # The cost estimate (``workers.estimate.estimate_batch``), counted once the batch is in
    # progress (``None`` until then): ``{prompt_tokens, max_completion_tokens, price_low,
    # price_high, requests, invalid_requests}``, US dollars.
    estimate: BatchEstimate | None = None
    # Unix seconds the batch was paused (``POST /v1/batches/{id}/pause``), ``None`` while it is
    # not; a paused batch keeps OpenAI's status ``in_progress``.
    paused_at: int | None = None
    # The batch's breaker (``offpeak.failure_limit``): ``{"fraction", "after_lines"}`` or
    # ``None``.
    failure_limit: dict[str, Any] | None = None
    # Set while the estimated completion falls past ``expires_at``
    # (``api.services.batch_eta.warning``): ``{"code", "message", "estimated_completion_at",
    # "expires_at"}``; ``None`` otherwise. A warning only: the batch runs on.
    completion_warning: dict[str, Any] | None = None

    @classmethod
    def of(cls, batch: Batch, bill: Bill | None = None) -> BatchObject:
        return cls.model_validate(batch_json(column_values(batch), bill))


def batch_json(batch: Mapping[str, Any], bill: Bill | None = None) -> dict[str, Any]:
    """``BatchObject`` as JSON-ready values, in its fields' order and with its types (floats
    where it has floats), from a batch's column values by attribute name (a row of
    ``batches.POLL_COLUMNS`` as ``_asdict()``, or ``column_values`` of a ``Batch``; a mapping
    because a dict's lookups cost a fraction of a row's attributes): what retrieve and list send
    as they are (``api.responses.WireJSON``), without building 20 models for a page.
    ``BatchObject.of`` validates the same dict, and ``tests/unit/test_wire_json.py`` checks that the
    model's JSON and this dict's are the same bytes."""
    errors = batch["errors"]
    estimate = batch["estimate"]
    return {
        "id": batch["id"],
        "object": "batch",
        "endpoint": batch["endpoint"],
        "model": batch["model"],
        "errors": None
        if not errors
        else {
            "object": "list",
            "data": [
                {
                    "code": e["code"],
                    "message": e["message"],
                    "param": e.get("param"),
                    "line": e.get("line"),
                }
                for e in errors
            ],
        },
        "input_file_id": batch["input_file_id"],
        "completion_window": batch["completion_window"],
        "status": batch["status"],
        "output_file_id": batch["output_file_id"],
        "error_file_id": batch["error_file_id"],
        "created_at": batch["created_at"],
        "in_progress_at": batch["in_progress_at"],
        "expires_at": batch["expires_at"],
        "finalizing_at": batch["finalizing_at"],
        "completed_at": batch["completed_at"],
        "failed_at": batch["failed_at"],
        "expired_at": batch["expired_at"],
        "cancelling_at": batch["cancelling_at"],
        "cancelled_at": batch["cancelled_at"],
        "request_counts": {
            "total": batch["total"],
            "completed": batch["completed"],
            "failed": batch["failed"],
        },
        "usage": {
            "input_tokens": batch["input_tokens"],
            "input_tokens_details": {"cached_tokens": batch["cached_tokens"]},
            "output_tokens": batch["output_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": batch["input_tokens"] + batch["output_tokens"],
            **prefix_cache_fields(
                batch["input_tokens"], batch["cached_tokens"], batch["min_prompt_tokens"]
            ),
        },
        "metadata": batch["metadata_"],
        **_bill_fields(bill),
        **_schedule_fields(batch),
        "estimate": None
        if not estimate
        else {
            "prompt_tokens": int(estimate["prompt_tokens"]),
            "max_completion_tokens": int(estimate["max_completion_tokens"]),
            "price_low": float(estimate["price_low"]),
            "price_high": float(estimate["price_high"]),
            "requests": int(estimate["requests"]),
            "invalid_requests": int(estimate["invalid_requests"]),
        },
        "paused_at": batch["paused_at"],
        "failure_limit": batch["failure_limit"],
        "completion_warning": None,
    }


def prefix_cache_fields(
    input_tokens: int, cached_tokens: int, min_prompt_tokens: int | None
) -> dict[str, Any]:
    """``BatchUsage``'s extension fields from the batch's token counters."""
    return {
        "prefix_cache_hit_rate": round(cached_tokens / input_tokens, 4) if input_tokens else 0.0,
        "prompt_tokens_computed": input_tokens - cached_tokens,
        "min_prompt_tokens": None if min_prompt_tokens is None else int(min_prompt_tokens),
    }


def _bill_fields(bill: Bill | None) -> dict[str, Any]:
    if bill is None:
        return dict.fromkeys(_BILL_FIELDS)
    per_million = bill.cost_per_million_tokens
    return {
        "gpu_seconds": float(round(bill.gpu_seconds, 6)),
        "cost": float(bill.cost),
        "price": float(bill.price),
        "cost_per_million_tokens": None if per_million is None else float(per_million),
        "realtime_price": float(bill.realtime_price),
        "saving": float(bill.saving),
        "billed_at": None if bill.billed_at is None else int(bill.billed_at),
    }


_BILL_FIELDS = (
    "gpu_seconds", "cost", "price", "cost_per_million_tokens", "realtime_price", "saving",
    "billed_at",
)  # fmt: skip


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchResultList(BaseModel):
    """A page of ``GET /v1/batches/{id}/results`` (an Offpeak extension): each item a line of
    the batch's output or error file, exactly as the file holds it (OpenAI's batch output line:
    ``id``, ``custom_id``, ``response``, ``error``)."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class CreateBatch(BaseModel):
    """``POST /v1/batches`` body. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    # The enum documents the served endpoints; other values get the service's own 400.
    endpoint: str = Field(json_schema_extra={"enum": list(endpoints.BATCH_ENDPOINTS)})
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: dict[str, Any] | None = None
    # An Offpeak extension (the SDK's ``extra_body``): the batch's breaker,
    # ``{"fraction": 0.2, "after_lines": 100}`` (``offpeak.failure_limit``); ``null``: none;
    # left out: the server's ``failure_limit`` setting.
    failure_limit: dict[str, Any] | None = None


def _schedule_fields(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``slack_seconds`` and ``estimated_completion_at`` of an ``in_progress`` batch that the
    scheduler has estimated (``storage.models.Batch.estimated_completion_at``); ``None``
    otherwise."""
    eta = batch["estimated_completion_at"]
    if batch["status"] != BatchStatus.IN_PROGRESS or eta is None:
        return {"slack_seconds": None, "estimated_completion_at": None}
    return {
        "slack_seconds": float(round(batch["expires_at"] - eta, 1)),
        "estimated_completion_at": int(eta),
    }
