"""Wire types of ``/healthz`` (liveness, and what is alive behind the API) and ``/readyz``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class WorkerHealth(BaseModel):
    """A worker whose heartbeat is fresh (at most ``worker_alive_seconds`` old)."""

    #: The worker's id for an operator (``host:pid:random``); for a tenant, an opaque digest
    #: of it that names the same worker across answers.
    id: str
    #: ``control``, ``engine`` or ``control,engine``.
    role: str
    #: For an operator only (the admin key or the metrics token); null for a tenant.
    hostname: str | None
    #: The models an engine worker serves; [] for a control worker.
    models: list[str]
    heartbeat_age_seconds: float = Field(ge=0)
    #: Unix seconds.
    started_at: float


class ModelHealth(BaseModel):
    """A configured model and the live engine workers serving it."""

    model: str
    #: Ids of the live engine workers serving the model.
    engine_workers: list[str]
    #: Seconds since the last engine worker serving the model was heard from; null while one is
    #: alive, or when none has ever registered (within the records kept: 7 days).
    seconds_without_engine_worker: float | None
    #: E.g. "no engine worker serving X for 75 s"; null while the model is served, or while an
    #: engine worker for it is loading within ``OFFPEAK_ENGINE_LOAD_GRACE_SECONDS``.
    message: str | None
    #: Ids of the engine workers loading the model's engine (within that grace), not yet live.
    loading_engine_workers: list[str] = []


class HealthStatus(BaseModel):
    """``GET /healthz`` without a key: the process runs; ``status`` is ``degraded`` when
    something behind it is down (a key says what: ``Health``)."""

    status: Literal["ok", "degraded"]
    #: Unix seconds of this answer.
    checked_at: float


class Health(BaseModel):
    """``GET /healthz`` with a key: answered with 200 while the API process runs, whatever else
    is down; ``status`` is ``degraded`` when the database does not answer, no control worker is
    alive or a configured model has no live engine worker (``problems`` says which, in words).
    A tenant's key sees workers without their hosts; the admin key or the metrics token sees
    everything."""

    status: Literal["ok", "degraded"]
    version: str
    #: Unix seconds of this answer.
    checked_at: float
    worker_alive_seconds: float
    #: ``not_migrated``: it answers, but its schema is not the code's (``offpeak migrate``).
    database: Literal["ok", "unavailable", "not_migrated"]
    workers: list[WorkerHealth]
    models: list[ModelHealth]
    models_without_engine_worker: list[str]
    problems: list[str]


class Ready(BaseModel):
    """``GET /readyz`` when the API can take requests: the database answers and its schema is
    the code's. A model without a live engine worker does not make the API unready (batches are
    accepted and wait for a worker); it is listed here too."""

    status: Literal["ready"]
    schema_revision: str
    models_without_engine_worker: list[str]
