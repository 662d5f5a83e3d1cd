"""The engine worker's life in one object: boot, engines, runners, recovery, release, stop.

``offpeak worker --role engine`` builds an ``EngineWorker``, makes it this process's
(``install``) and ``boot``s it before Celery takes work; the drain task (``workers.tasks``) finds
it with ``current()`` and calls ``drain``; Celery's shutdown and the command's exit call ``stop``.
Tests build their own and ``install`` it; nothing here is a module global but that one slot.

Engines are loaded through ``workers.engine.registry`` (one per served model in this process),
wrapped to be releasable where the pool says so (``workers.engine.release``), and each is driven
by one ``Runner`` kept for the process's life: the gate's hysteresis, the urgent set and the
engine sizing carry over from one drain to the next.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import NoReturn

from offpeak import celery_app
from offpeak.ids import worker_id
from offpeak.settings import Settings, get_settings
from storage import task_messages
from storage.db import session_scope
from storage.repositories import requests as requests_repo
from storage.repositories import workers as workers_repo
from workers import lifecycle, shutdown
from workers import worker_metrics as metrics
from workers.engine import load_failure, registry, release
from workers.engine.base import Engine, EngineFault
from workers.engine.load_failure import EngineLoadError
from workers.engine.release_check import ReleaseCheck
from workers.runner import Runner

log = logging.getLogger(__name__)

#: Exit status of an engine worker that gave up rebuilding its engine (EX_SOFTWARE).
EXIT_ENGINE_BROKEN = 70


def baton_delay(empty_drains: int, longest: float) -> float | None:
    """Seconds the baton of a drain waits after ``empty_drains`` drains in a row that claimed
    nothing: ``None`` (at once) after one that claimed, then 0.25 s doubling up to ``longest``
    (the sweep's period, which sends a drain anyway)."""
    if empty_drains <= 0:
        return None
    return min(longest, 0.25 * 2 ** min(empty_drains - 1, 16))


class EngineWorker:
    """One engine worker process's engines and runners, and what it does when one fails.

    ``load(settings, model)`` builds a model's engine (``registry.load``), ``device()`` names
    the device (``registry.device_name``), ``exit(code)`` ends the process at once
    (``os._exit``: Celery would catch ``SystemExit`` inside a task); tests pass their own.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        load: Callable[[Settings, str], Engine] = registry.load,
        device: Callable[[], str] = registry.device_name,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.settings = settings
        self._load_engine, self._device, self._exit = load, device, exit
        #: One runner per served model, built (its engine loaded) on first use.
        self.runners: dict[str, Runner] = {}
        #: Drains in a row, per model, in which this process claimed no line: the baton such a
        #: drain passes waits (``baton_delay``), so a closed gate or lines locked elsewhere
        #: cannot spin the queue.
        self.empty_drains: dict[str, int] = {}
        #: Monotonic times of this process's recent engine failures, per model.
        self.failures: dict[str, list[float]] = {}
        #: The release check, started by ``start_runners`` with a releasable engine.
        self.release_check: ReleaseCheck | None = None

    # Boot ------------------------------------------------------------------------------------

    def queues(self) -> list[str]:
        """The Celery queues this worker consumes: one per served model."""
        return [celery_app.model_queue(self.settings, m) for m in self.settings.served_models]

    def boot(self) -> None:
        """Everything before Celery takes work: say the worker is loading (no alarm meanwhile),
        load every engine and build its runner (``start_runners``), register the worker, and
        send each model a drain once Celery is ready, so lines left by a crash or a restart run
        without waiting for the sweep. An engine that does not start ends the process with
        ``EXIT_ENGINE_NOT_STARTED`` (``workers.engine.load_failure``), after saying which
        setting to change and closing the engines started before it."""
        from celery.signals import worker_ready

        from workers import liveness  # its import connects the heartbeat to Celery's signals
        from workers.runner.gc_tuning import tune_collector

        tune_collector()  # the runner's lines would trigger full collections (see there)
        settings = self.settings
        liveness.announce_loading(settings, settings.served_models)
        try:
            self.start_runners()
        except EngineLoadError as exc:
            self._exit_not_started(exc)
        with session_scope(settings.resolved_database_url) as session:
            workers_repo.register(
                session, worker_id(), socket.gethostname(), settings.served_models
            )

        @worker_ready.connect(weak=False)
        def _resume(**_kwargs: object) -> None:
            for name in settings.served_models:
                task_messages.send_drain(settings, name)

    def start_runners(self) -> None:
        """Load each served model's engine and build its runner, so the first drain starts at
        once: building a runner looks up the device, which imports torch (about a second)
        where no engine has yet. With a releasable engine among them, start the release
        check (``workers.engine.release_check``: an engine whose model has no batch running is
        released too).

        Raises ``EngineLoadError`` naming the model whose engine did not start and the setting
        to change; the engines started before it stay loaded, for ``stop`` to close."""
        settings = self.settings
        for model in settings.served_models:
            try:
                self.runner_for(model)
            except Exception as exc:
                started = [m for m in settings.served_models if m in self.runners]
                raise EngineLoadError(
                    model, load_failure.explain(settings, model, exc, started)
                ) from exc
        if self.release_check is None and any(
            isinstance(r.engine, release.ReleasableEngine) for r in self.runners.values()
        ):
            self.release_check = ReleaseCheck(
                settings, lambda: self.runners, settings.sweep_seconds
            )
            self.release_check.start()

    def runner_for(self, model: str) -> Runner:
        """This process's runner for ``model``, built (and its engine loaded) on first use."""
        if model not in self.runners:
            engine = self._load(model)
            self.runners[model] = Runner(self.settings, engine, worker_id(), device=self._device())
        return self.runners[model]

    def _load(self, model: str) -> Engine:
        """``model``'s engine, releasable while the gate is closed where its pool says so."""
        engine = self._load_engine(self.settings, model)
        return release.releasable(self.settings, engine, registry.load_seconds(model))

    # Work ------------------------------------------------------------------------------------

    def drain(self, model: str) -> None:
        """Run ``model``'s batch work under the scheduler until nothing admissible is left, and
        send a finalize for every batch it touched. While lines wait, one drain stays queued
        (the baton), so every idle engine worker of the model joins in turn (a busy one takes
        no second message: prefetch 1, solo pool). A failed engine is rebuilt (``recover``):
        its lines go back to pending, never to failed."""
        settings = self.settings
        with session_scope(settings.resolved_database_url) as session:
            waiting = requests_repo.has_pending(session, model)
        if waiting:
            delay = baton_delay(self.empty_drains.get(model, 0), settings.sweep_seconds)
            task_messages.send_drain(settings, model, countdown=delay)
        try:
            with (
                self.release_check.busy(model) if self.release_check is not None else nullcontext()
            ):
                runner = self.runner_for(model)
                stats = runner.drain()
                self.empty_drains[model] = (
                    0 if stats.chunks else self.empty_drains.get(model, 0) + 1
                )
                if stats.outcome == "yielded":
                    log.info("%s: batch work held back (%s)", model, runner.gate.reason)
                    # The gate may stay closed for long: free the engine's memory for real-time
                    # serving.
                    release.release_if_held_back(runner.engine, runner.gate, settings, time.time())
        except EngineFault as fault:
            self.recover(model, fault)
            return
        for batch_id in stats.touched:
            task_messages.send_finalize(settings, batch_id)

    def recover(self, model: str, fault: EngineFault) -> None:
        """The engine of ``model`` failed and the runner handed its lines back: close it and
        load a new one into the same runner (its gate and urgent set carry over), then send a
        drain so the lines run again. After ``max_engine_failures`` failures within
        ``engine_failure_window_seconds``, or when the new engine cannot load, exit the process
        with ``EXIT_ENGINE_BROKEN`` for its supervisor (``offpeak up``, Docker, systemd) to
        restart.

        A remote engine (``engine: "remote"``) is rebuilt by waiting for its server, however
        long it is away: restarting this process would not bring a remote server back, so its
        failures do not count towards the exit (lines a failing server keeps failing are still
        caught by ``max_line_attempts``)."""
        settings = self.settings
        log.error("%s: engine failed (%s); its lines went back to pending", model, fault)
        metrics.ENGINE_FAILURES.labels(model).inc()
        registry.discard(model)
        if settings.models[model].engine == "remote":
            self._reconnect(model)
            return
        at = time.monotonic()
        window = settings.engine_failure_window_seconds
        recent = [t for t in self.failures.get(model, []) if at - t < window]
        self.failures[model] = [*recent, at]
        if len(self.failures[model]) >= settings.max_engine_failures:
            log.critical(
                "%s: %d engine failures in %.0f s; exiting for the supervisor to restart this "
                "worker",
                model,
                len(self.failures[model]),
                window,
            )
            self._exit_broken()
        try:
            engine = self._load(model)
        except Exception:
            log.critical("%s: cannot load a new engine; exiting", model, exc_info=True)
            self._exit_broken()
        self._replace(model, engine)

    def _reconnect(self, model: str) -> None:
        """A remote engine's rebuild: ``registry.load`` waits for the server's ``/health``."""
        from workers.engine.remote import ServerUnavailable

        try:
            engine = self._load(model)
        except ServerUnavailable:
            log.info("%s: stopping while the server is away", model)
            return
        except Exception:
            log.critical("%s: cannot connect a new remote engine; exiting", model, exc_info=True)
            self._exit_broken()
        self._replace(model, engine)

    def _replace(self, model: str, engine: Engine) -> None:
        if model in self.runners:
            self.runners[model].replace_engine(engine)
        task_messages.send_drain(self.settings, model)

    # Stop ------------------------------------------------------------------------------------

    def stop(self, deadline: float | None) -> None:
        """This worker's last act on its engines: stop the release check, close every
        loaded engine in parallel and end every process they started, all by ``deadline``
        (``time.monotonic()``; ``None``: the closes take what they take,
        ``workers.shutdown.stop_engines``). Safe to call twice; never raises."""
        if self.release_check is not None:
            self.release_check.stop()
        shutdown.stop_engines(registry.take_all(), deadline)

    def shut_down(self) -> None:
        """``stop`` by the deadline this process's stop request set (``workers.lifecycle``):
        Celery's ``worker_shutdown``, and the command's exit."""
        self.stop(lifecycle.stop_deadline())

    def _exit_broken(self) -> None:
        shutdown.close_engines(registry.take_all(), None)
        logging.shutdown()
        # The drain message (acked late) is redelivered to the worker that replaces this one.
        self._exit(EXIT_ENGINE_BROKEN)

    def _exit_not_started(self, error: EngineLoadError) -> NoReturn:
        """Say ``error`` on stderr and in the log, free what the engines started before it hold,
        and exit with ``EXIT_ENGINE_NOT_STARTED`` at once: the interpreter's own exit would wait
        on the half-started engine's threads and children."""
        from offpeak import process_tree

        log.error("%s", error)
        print(f"offpeak worker: {error}", file=sys.stderr, flush=True)
        self.stop(time.monotonic() + load_failure.CLOSE_SECONDS)
        process_tree.kill_children(timeout=0)
        sys.stderr.flush()
        self._exit(load_failure.EXIT_ENGINE_NOT_STARTED)
        raise SystemExit(load_failure.EXIT_ENGINE_NOT_STARTED)  # only where ``exit`` returned


_current: EngineWorker | None = None


def current() -> EngineWorker:
    """This process's engine worker: the one ``install``ed (``offpeak worker`` boots it), else
    one built from the settings on first use (a bare ``celery -A workers.celery_worker``)."""
    global _current
    if _current is None:
        _current = EngineWorker(get_settings())
    return _current


def install(worker: EngineWorker | None) -> EngineWorker | None:
    """Make ``worker`` this process's engine worker (``None``: none yet); returns the one it
    replaces, for a test to put back."""
    global _current
    previous, _current = _current, worker
    return previous
