"""The worker heartbeat: every worker process, control or engine, says it is alive.

Once Celery's consumer is ready (``worker_ready``) the worker registers itself, with the role and
the models its queues say it serves, and a daemon thread refreshes its heartbeat every quarter of
``worker_alive_seconds``; a clean stop (``worker_shutdown``) retires it at once. A killed worker
stops beating, so readers (``/healthz``, the dashboard) see it gone after ``worker_alive_seconds``.

The beat comes from a thread of its own, not from the work loop: an idle engine worker (no batch,
so no result flushes) is alive, and a drain that runs for hours must not look dead. What it
proves: the process runs and reaches the database. A hung engine is the runner's concern (its
lease heartbeat stops covering a loop that does not turn).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterable

from celery.signals import worker_ready, worker_shutdown

from offpeak import celery_app
from offpeak.settings import Settings, get_settings
from storage.db import session_scope
from storage.repositories import workers as workers_repo

log = logging.getLogger(__name__)

#: Most seconds a worker's stop waits for its heartbeat thread and its record's retirement.
STOP_SECONDS = 4.0
#: Records of workers silent for this long are deleted when a worker registers (each start adds
#: one): a week of history is enough to say "no engine worker serving X for 3 days".
PRUNE_AFTER_SECONDS = 7 * 24 * 3600.0


def role_of(settings: Settings, consumed: Iterable[str]) -> tuple[str, list[str]]:
    """``(role, models)`` of a worker consuming the queues named ``consumed``: ``control`` for
    the control queue, ``engine`` with the configured models whose queues it consumes, or
    ``control,engine`` for both. Raises ``ValueError`` when it consumes none of Offpeak's."""
    names = set(consumed)
    models = [m for m in settings.models if celery_app.model_queue(settings, m) in names]
    control = celery_app.control_queue(settings) in names
    if control and models:
        return "control,engine", models
    if control:
        return "control", []
    if models:
        return "engine", models
    raise ValueError(f"none of Offpeak's queues among {sorted(names)}")


class WorkerHeartbeat:
    """Registers a worker and keeps its heartbeat fresh from a daemon thread until ``stop``."""

    def __init__(self, settings: Settings, worker_id: str, role: str, models: list[str]) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.role = role
        self.models = models
        self.interval = settings.worker_alive_seconds / 4
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: Held by a beat and by the retirement, so a late beat never revives a retired record.
        self._lock = threading.Lock()

    def register(self) -> None:
        """Write the worker's record (ready, heartbeat now) and prune long-silent ones."""
        with session_scope(self.settings.resolved_database_url) as session:
            workers_repo.register(
                session, self.worker_id, socket.gethostname(), self.models, role=self.role
            )
            workers_repo.prune(session, time.time() - PRUNE_AFTER_SECONDS)

    def beat(self) -> None:
        """One heartbeat; registers again if the record was pruned or retired meanwhile by
        someone else (never after ``stop``)."""
        with self._lock:
            if self._stop.is_set():
                return
            with session_scope(self.settings.resolved_database_url) as session:
                if workers_repo.heartbeat(session, self.worker_id, time.time()):
                    return
            self.register()

    def start(self) -> None:
        """Register (retrying in the thread if the database is down now) and start beating."""
        try:
            self.register()
        except Exception as exc:  # the thread's first beat registers once the database is back
            log.warning("worker %s could not register: %s", self.worker_id, exc)
        self._thread = threading.Thread(target=self._run, name="worker-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except Exception as exc:  # a database outage: keep trying, it shows as not alive
                log.warning("worker heartbeat failed: %s", exc)

    def stop(self) -> None:
        """Stop beating and retire the record, so readers see the worker gone at once. Bounded
        (``STOP_SECONDS`` at most): a worker's stop must not wait on a hung database."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_SECONDS / 2)
        retiring = threading.Thread(target=self._retire, name="worker-retire", daemon=True)
        retiring.start()
        retiring.join(timeout=STOP_SECONDS / 2)

    def _retire(self) -> None:
        try:
            with self._lock, session_scope(self.settings.resolved_database_url) as session:
                workers_repo.retire(session, self.worker_id)
        except Exception as exc:  # stopping anyway; the heartbeat's age tells the rest
            log.warning("worker %s could not retire: %s", self.worker_id, exc)


#: This process's heartbeat, once its Celery consumer is ready.
_heartbeat: WorkerHeartbeat | None = None


@worker_ready.connect(weak=False)
def _on_worker_ready(sender: object = None, **_kwargs: object) -> None:
    global _heartbeat
    from offpeak.ids import worker_id  # the id the runner writes into its leases

    settings = get_settings()
    app = getattr(sender, "app", None)
    consumed = list(app.amqp.queues.consume_from) if app is not None else []
    try:
        role, models = role_of(settings, consumed)
    except ValueError as exc:
        log.warning("no worker heartbeat: %s", exc)
        return
    _heartbeat = WorkerHeartbeat(settings, worker_id(), role, models)
    _heartbeat.start()


@worker_shutdown.connect(weak=False)
def _on_worker_shutdown(**_kwargs: object) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()


def announce_loading(settings: Settings, models: list[str]) -> None:
    """Record this engine worker as loading the engines of ``models`` (``/healthz`` and the
    dashboard give it ``engine_load_grace_seconds`` before reporting them unserved). A database
    fault is logged, never raised: the worker still starts."""
    from offpeak.ids import worker_id

    try:
        with session_scope(settings.resolved_database_url) as session:
            workers_repo.announce_loading(
                session, worker_id(), socket.gethostname(), models, time.time()
            )
    except Exception as exc:
        log.warning("could not record this worker as loading: %s", exc)
