"""Wire types of ``/v1/admin/scheduler`` (the scheduler's pause switch and its view), of
``/v1/admin/tenants`` and of a tenant's own limits and queue (``/v1/limits``, ``/v1/queue``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


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


class EnqueuedTokens(BaseModel):
    """Enqueued tokens: the figure every model shares (``None``: derived per model from its
    engine's measured output, or none), the limit in force per model (configured models and
    those held; ``None``: none) and what each model's running batches hold."""

    limit_per_model: int | None
    limit_by_model: dict[str, int | None]
    by_model: dict[str, int]


class LimitUse(BaseModel):
    limit: int | None
    used: int


class RateLimit(BaseModel):
    """Requests per minute (per key), or batch creates per minute (per tenant); ``None``: no
    limit."""

    limit: int | None


class TenantLimitsView(BaseModel):
    """A tenant's limits in force beside its use of them (``GET /v1/limits``)."""

    enqueued_tokens: EnqueuedTokens
    batches_in_progress: LimitUse
    stored_bytes: LimitUse
    requests_per_minute: RateLimit
    batch_creates_per_minute: RateLimit


class QueuePosition(BaseModel):
    """A tenant's queued lines of one model (not finished: pending or running) and the lines of
    other tenants that will run before they are done, urgent (the deadline guard's) and shared
    (what the fair share serves others meanwhile; ``api.services.tenant_views.positions``)."""

    model: str
    queued_lines: int
    lines_ahead: int
    urgent_lines_ahead: int
    shared_lines_ahead: int


class EngineShare(BaseModel):
    """A tenant's share of the engines over the last ``window_seconds``: engine-seconds and lines
    finished, as fractions of all tenants' (``None``: nothing served), beside
    ``entitled_share``, its weight over the weights of the tenants competing (``None``: it has
    no work queued and was not served)."""

    window_seconds: int
    weight: float
    entitled_share: float | None
    engine_seconds: float
    engine_share: float | None
    lines_finished: int
    lines_share: float | None


class QueueView(BaseModel):
    """``GET /v1/queue``: the calling tenant's queue positions per model and its engine share."""

    object: Literal["queue"] = "queue"
    queue: list[QueuePosition]
    share: EngineShare


class TenantView(TenantLimitsView):
    """A tenant as the operator sees it: ``overrides`` are its own figures (``None``: the
    setting's default), the rest the limits in force and its use."""

    object: Literal["tenant"] = "tenant"
    id: str
    name: str
    created_at: int
    weight: float
    overrides: dict[str, int | None]
    queue: list[QueuePosition]
    share: EngineShare


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[TenantView]


class TenantUpdate(BaseModel):
    """Overrides to set; a field left out is left alone, ``null`` puts a limit back to the
    setting's default. Limits are integers >= 0 (0 refuses everything) or -1 (no limit for this
    tenant, whatever the default), the weight > 0."""

    model_config = ConfigDict(strict=True, extra="forbid")

    weight: float | None = None
    max_enqueued_tokens: int | None = None
    max_batches_in_progress: int | None = None
    max_file_bytes: int | None = None
    requests_per_minute: int | None = None
    batch_creates_per_minute: int | None = None
