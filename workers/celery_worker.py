"""The Celery worker: the workers' app (``workers.worker_app``) with the tasks registered
(``celery -A workers.celery_worker worker``), how a worker process stops
(``install_stop_handling``) and how it runs (``run_worker``), both called by ``offpeak worker``."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from celery.signals import worker_init, worker_ready, worker_shutdown, worker_shutting_down

import workers.liveness  # noqa: F401  (registers and heartbeats the worker when ready)
import workers.tasks  # noqa: F401  (registers the tasks on ``app``)
from workers import profiling
from workers.worker_app import app

profiling.install()  # only with OFFPEAK_PROFILE_DIR set (the benchmarks' --profile)

log = logging.getLogger(__name__)

#: Exit code of a worker that had to stop before its work was handed back (Celery's EX_FAILURE).
EXIT_FORCED = 1


def run_worker(argv: list[str]) -> int:
    """Run Celery's worker command (``argv``: ``["worker", "-Q", ...]``) until it stops; its exit
    code: 0 after a warm shutdown, Celery's ``EX_FAILURE`` (1) when it stopped on an error it
    cannot recover from (a broker that refuses its commands, say).

    ``Celery.worker_main`` returns nothing, and the code it ends with never reaches its caller
    (celery 5.x: ``Celery.start`` drops what click returns), so a worker that died would exit
    0, and a supervisor that restarts only on failure would leave it down. The code is read off
    the worker itself, which Celery hands to ``worker_init``.
    """
    started: list[Any] = []

    def _keep(sender: Any = None, **_kwargs: Any) -> None:
        started.append(sender)

    worker_init.connect(_keep, weak=False)
    try:
        app.worker_main(argv)
    finally:
        worker_init.disconnect(_keep)
    if not started:
        return EXIT_FORCED  # Celery returned without building a worker
    return int(started[-1].exitcode or 0)


def force_exit(reason: str) -> None:
    """Kill this process's children (an engine-core) at once, then exit with ``EXIT_FORCED``
    without running cleanup that could block. Lines this worker still held stay leased to it
    and are taken over once the lease expires (``OFFPEAK_LEASE_SECONDS``)."""
    from offpeak.process_tree import kill_children

    log.warning("exiting at once: %s", reason)
    try:
        kill_children(timeout=0)
    finally:
        os._exit(EXIT_FORCED)


def install_stop_handling(
    role: str, stop_timeout: float, on_shutdown: Callable[[], None] | None = None
) -> None:
    """How this worker process answers SIGTERM, SIGINT and SIGQUIT once Celery runs.

    First signal: Celery starts its warm shutdown (it stops taking messages and waits for the
    task that runs) and ``workers.lifecycle.request_stop`` tells the runner to write back what
    finished, hand its held lines back to pending and return; after ``stop_timeout`` seconds
    without exiting, ``force_exit``. Any later signal: ``force_exit`` at once. When the worker
    shuts down, ``on_shutdown`` runs (an engine worker's: ``EngineWorker.stop`` by the stop
    deadline, ``workers.engine_worker``). A control worker runs beat in a thread
    (``workers.beat``), started when the worker is ready.
    """
    from workers import lifecycle

    signals_seen = 0

    # Celery sends worker_shutting_down from its own handler of each of these signals, in the
    # main thread: the one place that sees every signal Celery's handlers take.
    @worker_shutting_down.connect(weak=False)
    def _on_signal(sig: str = "", how: str = "", **_kwargs: Any) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            force_exit(f"{sig} during shutdown")
        log.info("%s: stopping within %.0f s (a second signal exits at once)", sig, stop_timeout)
        lifecycle.request_stop(within=stop_timeout)
        timer = threading.Timer(
            stop_timeout, force_exit, args=(f"not stopped {stop_timeout:.0f} s after {sig}",)
        )
        timer.daemon = True
        timer.start()

    if on_shutdown is not None:

        @worker_shutdown.connect(weak=False)
        def _shut_down(**_kwargs: Any) -> None:
            on_shutdown()

    if role == "control":
        from workers.beat import BeatThread

        beat = BeatThread(app, Path(app.conf.beat_schedule_filename))

        @worker_ready.connect(weak=False)
        def _start_beat(**_kwargs: Any) -> None:
            beat.start()

        @worker_shutdown.connect(weak=False)
        def _stop_beat(**_kwargs: Any) -> None:
            beat.stop()
