"""Wire types of ``/v1/admin/scheduler``: the scheduler's pause switch and its view."""

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
