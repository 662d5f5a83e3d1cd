"""Liveness and readiness: which workers are alive, which models have no engine worker, and
whether the database answers with the code's schema.

Health checks read through an engine of their own with short timeouts: a probe must answer in
seconds even when the database hangs or the request pool is exhausted by uploads.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.exc import OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

import migrations
from api.schemas.health import Health, HealthStatus, ModelHealth, Ready, WorkerHealth
from offpeak import __version__
from offpeak.settings import Settings
from storage.db import connect_args, get_engine
from storage.models import WorkerRecord
from storage.repositories import workers as workers_repo

log = logging.getLogger(__name__)

#: Seconds a health check waits to connect to PostgreSQL, and for one of its statements.
DB_TIMEOUT_SECONDS = 2
#: How far back "last heard from" looks; worker records older than this are pruned
#: (``workers.liveness.PRUNE_AFTER_SECONDS``).
HISTORY_SECONDS = 7 * 24 * 3600.0


def duration(seconds: float) -> str:
    """``75`` → ``"75 s"``, ``750`` → ``"12 min 30 s"``, ``11000`` → ``"3 h 3 min"``,
    ``200000`` → ``"2 d 7 h"``: a wait in the largest two units a person reads."""
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min" + (f" {s % 60} s" if s % 60 else "")
    if s < 86400:
        return f"{s // 3600} h" + (f" {s % 3600 // 60} min" if s % 3600 // 60 else "")
    return f"{s // 86400} d" + (f" {s % 86400 // 3600} h" if s % 86400 // 3600 else "")


def no_engine_message(model: str, seconds: float | None, loading: float | None = None) -> str:
    """Why ``model`` has no live engine worker: none registered, none for ``seconds``, or one
    has been loading for ``loading`` seconds (past the grace)."""
    if loading is not None:
        return (
            f"no engine worker serving {model}: one has been loading for {duration(loading)} "
            "(see its log)"
        )
    if seconds is None:
        return f"no engine worker serving {model}: none has registered"
    return f"no engine worker serving {model} for {duration(seconds)}"


@dataclass(frozen=True)
class Liveness:
    """What is alive behind the API at ``at`` (unix seconds)."""

    at: float
    alive: list[WorkerRecord]
    models: list[ModelHealth]
    control_alive: bool
    #: Seconds since a control worker was last heard from, when none is alive; None while one
    #: is, or when none ever registered.
    seconds_without_control: float | None

    @property
    def unserved(self) -> list[ModelHealth]:
        return [m for m in self.models if not m.engine_workers]

    def control_problem(self) -> str | None:
        """Why no control worker is alive, in words; None while one is."""
        if self.control_alive:
            return None
        if self.seconds_without_control is None:
            return "no control worker: none has registered (batches stay validating)"
        gone = duration(self.seconds_without_control)
        return f"no control worker for {gone} (batches stay validating or finalizing)"

    def problems(self) -> list[str]:
        """The unhealthy parts, in words: a missing control worker, then each unserved model."""
        control = self.control_problem()
        return ([control] if control else []) + [m.message for m in self.unserved if m.message]


def _has_role(record: WorkerRecord, role: str) -> bool:
    return role in (record.role or "engine").split(",")


def liveness(session: Session, settings: Settings, at: float | None = None) -> Liveness:
    """Workers alive at ``at`` (a heartbeat at most ``worker_alive_seconds`` old, not retired)
    and, per configured model, its live engine workers or how long it has had none."""
    at = time.time() if at is None else at
    records = workers_repo.seen_since(session, at - HISTORY_SECONDS)
    fresh = at - settings.worker_alive_seconds
    alive = [r for r in records if r.ready and r.heartbeat_at >= fresh]
    models = []
    for model in settings.models:
        serving = [r for r in records if _has_role(r, "engine") and model in (r.models or [])]
        live = [r.id for r in serving if r in alive]
        last = max((r.heartbeat_at for r in serving), default=None)
        without = None if live or last is None else max(at - last, 0.0)
        # A worker loading its engines (minutes for a large model) is no alarm within the grace;
        # past it, the wait is counted from its start, not from a previous run's last beat.
        loading = {r.id: at - r.started_at for r in serving if workers_repo.is_loading(r)}
        grace = settings.engine_load_grace_seconds
        in_grace = [i for i, s in loading.items() if s <= grace]
        message = None
        if not live and not in_grace:
            newest = max(serving, key=lambda r: r.heartbeat_at, default=None)
            late = loading.get(newest.id) if newest is not None else None
            message = no_engine_message(model, without, late)
        models.append(
            ModelHealth(
                model=model,
                engine_workers=live,
                seconds_without_engine_worker=without,
                message=message,
                loading_engine_workers=[] if live else in_grace,
            )
        )
    controls = [r for r in records if _has_role(r, "control")]
    control_alive = any(r in alive for r in controls)
    without_control = None
    if controls and not control_alive:
        without_control = max(at - max(r.heartbeat_at for r in controls), 0.0)
    return Liveness(at, alive, models, control_alive, without_control)


def alerts(session: Session, settings: Settings, at: float) -> list[dict[str, object]]:
    """The dashboard's warnings at ``at``: one per configured model without a live engine
    worker (``kind`` ``no_engine_worker``, ``model``, ``seconds`` without one or null if none
    ever registered, ``message``), then one if no control worker is alive."""
    state = liveness(session, settings, at)
    out: list[dict[str, object]] = [
        {
            "kind": "no_engine_worker",
            "model": m.model,
            "seconds": m.seconds_without_engine_worker,
            "message": m.message,
        }
        for m in state.unserved
        if m.message
    ]
    control = state.control_problem()
    if control:
        seconds = state.seconds_without_control
        out.append({"kind": "no_control_worker", "seconds": seconds, "message": control})
    return out


@lru_cache(maxsize=8)
def probe_engine(url: str) -> Engine:
    """An engine for health checks only: a small pool that fails in ``DB_TIMEOUT_SECONDS``
    instead of waiting behind the request pool or a hung server.

    The statement timeout is set per transaction (``SET LOCAL``), not as a startup parameter,
    which a pooler such as PgBouncer refuses (``unsupported startup parameter: options``)."""
    if url.startswith("sqlite"):
        return get_engine(url)  # a local file: no network to time out on
    if not url.startswith("postgresql"):
        return create_engine(url, pool_size=1, max_overflow=4, pool_timeout=DB_TIMEOUT_SECONDS)
    engine = create_engine(
        url,
        pool_size=1,
        max_overflow=4,
        pool_timeout=DB_TIMEOUT_SECONDS,
        pool_pre_ping=True,
        connect_args={**connect_args(url), "connect_timeout": DB_TIMEOUT_SECONDS},
    )

    @event.listens_for(engine, "begin")
    def _statement_timeout(connection: Connection) -> None:
        connection.exec_driver_sql(f"SET LOCAL statement_timeout = {DB_TIMEOUT_SECONDS * 1000}")

    return engine


@lru_cache(maxsize=8)
def schema_head(url: str) -> str | None:
    """The code's head schema revision (the migrations folder does not change while we run)."""
    return ScriptDirectory.from_config(migrations.alembic_config(url)).get_current_head()


def health(settings: Settings) -> Health:
    """The ``/healthz`` answer. Never raises for a database fault: it reports it."""
    at = time.time()
    url = settings.resolved_database_url
    try:
        with Session(probe_engine(url)) as session:
            state = liveness(session, settings, at)
    except SQLAlchemyError as exc:
        log.warning("health check: the database did not answer: %s", exc)
        database, problem = _database_problem(settings, exc)
        return Health(
            status="degraded",
            version=__version__,
            checked_at=at,
            worker_alive_seconds=settings.worker_alive_seconds,
            database=database,
            workers=[],
            models=[],
            models_without_engine_worker=[],
            problems=[problem],
        )
    problems = state.problems()
    return Health(
        status="degraded" if problems else "ok",
        version=__version__,
        checked_at=at,
        worker_alive_seconds=settings.worker_alive_seconds,
        database="ok",
        workers=[
            WorkerHealth(
                id=r.id,
                role=r.role,
                hostname=r.hostname,
                models=list(r.models or []),
                heartbeat_age_seconds=max(at - r.heartbeat_at, 0.0),
                started_at=r.started_at,
            )
            for r in state.alive
        ],
        models=state.models,
        models_without_engine_worker=[m.model for m in state.unserved],
        problems=problems,
    )


def _database_problem(
    settings: Settings, exc: SQLAlchemyError
) -> tuple[Literal["unavailable", "not_migrated"], str]:
    """What a failed health read means. A database that answered but refused the query (no
    such table or column) is asked for its schema revision; a connection fault is not asked
    twice, so a hung server costs one timeout."""
    if not isinstance(exc, OperationalError):
        try:
            readiness(settings)
        except NotReady as not_ready:
            if not_ready.code == "schema_out_of_date":
                return "not_migrated", not_ready.message
    return "unavailable", f"the database does not answer ({type(exc).__name__})"


class NotReady(Exception):
    """The API cannot serve requests now; ``code`` is ``database_unavailable`` or
    ``schema_out_of_date``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def readiness(settings: Settings) -> Ready:
    """The ``/readyz`` answer when ready. Raises ``NotReady`` when the database does not answer
    or its schema revision is not the code's head."""
    url = settings.resolved_database_url
    head = schema_head(url)
    try:
        with probe_engine(url).connect() as connection:
            connection.execute(text("SELECT 1"))
            current = MigrationContext.configure(connection).get_current_revision()
            if current == head:
                with Session(bind=connection) as session:
                    unserved = [m.model for m in liveness(session, settings).unserved]
    except SQLAlchemyError as exc:
        log.warning("readiness: the database did not answer: %s", exc)
        raise NotReady(
            f"The database does not answer ({type(exc).__name__}); retry later.",
            "database_unavailable",
        ) from exc
    if current != head:
        raise NotReady(
            f"The database is at schema revision {current or 'none'}, this code needs {head}: "
            "run `offpeak migrate`.",
            "schema_out_of_date",
        )
    return Ready(status="ready", schema_revision=str(head), models_without_engine_worker=unserved)


Viewer = Literal["operator", "tenant", "anonymous"]


def _opaque(worker_id: str) -> str:
    # Stable across answers, so a tenant can tell workers apart, without the host or the pid.
    return "w_" + hashlib.sha256(worker_id.encode()).hexdigest()[:12]


def for_viewer(health: Health, viewer: Viewer) -> Health | HealthStatus:
    """What ``viewer`` may see of ``health``: all of it (an operator), workers without their
    hosts and with opaque ids (a tenant), or only the status (no key)."""
    if viewer == "operator":
        return health
    if viewer == "anonymous":
        return HealthStatus(status=health.status, checked_at=health.checked_at)
    return health.model_copy(
        update={
            "workers": [
                w.model_copy(update={"id": _opaque(w.id), "hostname": None}) for w in health.workers
            ],
            "models": [
                m.model_copy(
                    update={
                        "engine_workers": [_opaque(i) for i in m.engine_workers],
                        "loading_engine_workers": [_opaque(i) for i in m.loading_engine_workers],
                    }
                )
                for m in health.models
            ],
        }
    )
