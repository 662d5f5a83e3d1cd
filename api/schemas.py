"""Wire types of the HTTP API (OpenAI's File and Batch objects), built from storage rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import inspect

from offpeak import endpoints
from offpeak.billing import Bill
from offpeak.statuses import BatchStatus
from storage.models import Base, Batch, File


def column_values(row: Base) -> dict[str, Any]:
    """An ORM object's column values by attribute name, as a row of the same columns gives them
    (``Row._asdict()``)."""
    return {attr.key: getattr(row, attr.key) for attr in inspect(type(row)).column_attrs}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer: OpenAI's ``{"error": {message, type, param, code}}``."""

    error: ErrorDetail


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: str
    status_details: str | None = None

    @classmethod
    def of(cls, file: File) -> FileObject:
        return cls.model_validate(file_json(column_values(file)))


def file_json(file: Mapping[str, Any]) -> dict[str, Any]:
    """``FileObject`` as JSON-ready values, in its fields' order, from a file's column values
    by attribute name (a row's ``_asdict()``, or ``column_values`` of a ``File``): what the
    reads users poll send as they are (``api.responses.WireJSON``), without building the model.
    ``FileObject.of`` validates the same dict, so the two agree (``tests/test_wire_json.py``)."""
    return {
        "id": file["id"],
        "object": "file",
        "bytes": file["bytes"],
        "created_at": file["created_at"],
        "expires_at": file["expires_at"],
        "filename": file["filename"],
        "purpose": file["purpose"],
        "status": file["status"],
        "status_details": None,
    }


def list_json(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of objects (``BatchList``, ``FileList``) as JSON-ready values."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


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
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


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

    @classmethod
    def of(cls, batch: Batch, bill: Bill | None = None) -> BatchObject:
        return cls.model_validate(batch_json(column_values(batch), bill))


def batch_json(batch: Mapping[str, Any], bill: Bill | None = None) -> dict[str, Any]:
    """``BatchObject`` as JSON-ready values, in its fields' order and with its types (floats
    where it has floats), from a batch's column values by attribute name (a row of
    ``batches.POLL_COLUMNS`` as ``_asdict()``, or ``column_values`` of a ``Batch``; a mapping
    because a dict's lookups cost a fraction of a row's attributes): what retrieve and list send
    as they are (``api.responses.WireJSON``), without building 20 models for a page.
    ``BatchObject.of`` validates the same dict, and ``tests/test_wire_json.py`` checks that the
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


class CreateBatch(BaseModel):
    """``POST /v1/batches`` body. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    # The enum documents the served endpoints; other values get the service's own 400.
    endpoint: str = Field(json_schema_extra={"enum": list(endpoints.BATCH_ENDPOINTS)})
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: dict[str, Any] | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "offpeak"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject] = Field(default_factory=list)


class UsageBucket(BaseModel):
    """Billed usage of one group: a model, a UTC day (``day`` as YYYY-MM-DD, ``start_time`` its
    first unix second), or everything. Amounts in US dollars."""

    object: Literal["usage.bucket"] = "usage.bucket"
    model: str | None = None
    day: str | None = None
    start_time: int | None = None
    batches: int
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    total_tokens: int
    gpu_seconds: float
    cost: float
    price: float
    realtime_price: float
    saving: float
    #: ``cost`` per million ``total_tokens`` (``offpeak.billing.cost_per_million_tokens``, the
    #: dashboard's rule); ``None`` without tokens.
    cost_per_million_tokens: float | None = None


class UsageReport(BaseModel):
    """``GET /v1/usage``: the tenant's billed batches that ended in ``[start, end)``."""

    object: Literal["list"] = "list"
    start: int
    end: int
    group_by: str | None
    currency: Literal["usd"] = "usd"
    data: list[UsageBucket]
    total: UsageBucket


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


# --- Admin: the scheduler's switch and view (``/v1/admin/scheduler``) --------------------------


class PauseRequest(BaseModel):
    """``pool``: a worker pool's name (``OFFPEAK_SCHEDULER__POOL``) or ``*`` for every pool."""

    # Strict: ``"hard": 0`` or ``"hard": "yes"`` is a 400, not a quiet guess.
    model_config = ConfigDict(strict=True)

    pool: str = "*"
    #: Also stop urgent batches (their windows may then be missed).
    hard: bool = False
    reason: str | None = None


class ResumeRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    pool: str = "*"


class PauseSwitch(BaseModel):
    object: Literal["scheduler.pause"] = "scheduler.pause"
    pool: str
    paused: bool
    hard: bool
    reason: str | None
    #: Unix seconds.
    updated_at: float | None


class PoolLoad(BaseModel):
    """A worker pool's last load reading (``load`` on the water-mark scale; ``None``: unread)."""

    pool: str
    load: float | None
    gate_open: bool | None
    paused: bool
    parts: dict[str, float | None]
    errors: dict[str, str]
    worker: str | None
    updated_at: float


class BatchSchedule(BaseModel):
    id: str
    model: str | None
    expires_at: int
    estimated_completion_at: int | None
    slack_seconds: float | None
    #: Lines not finished yet.
    remaining: int


class SchedulerView(BaseModel):
    object: Literal["scheduler"] = "scheduler"
    switches: list[PauseSwitch]
    pools: list[PoolLoad]
    batches: list[BatchSchedule]
