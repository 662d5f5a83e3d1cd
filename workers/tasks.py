"""Celery tasks. Each takes ids, re-reads state from the database and is idempotent; the logic
lives in ``validation``, ``runner`` and ``finalize``."""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext

from offpeak import celery_app
from offpeak.ids import worker_id
from offpeak.settings import Settings, get_settings
from offpeak.statuses import BatchStatus
from storage import task_messages
from storage.blobs import StoreUnavailable, get_blob_store
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import queued_messages
from storage.repositories import requests as requests_repo
from workers import billing, retention, webhook_delivery
from workers import worker_metrics as metrics
from workers.celery_worker import app
from workers.engine import registry, release
from workers.engine.base import Engine, EngineFault
from workers.engine.idle_release import IdleReleaser
from workers.estimate import estimate_batch
from workers.finalize import Step, finalize
from workers.runner import Runner
from workers.scheduler.slack import sweep_estimates
from workers.validation import run_validation

log = logging.getLogger(__name__)


@app.task(name=celery_app.VALIDATE_TASK)
def validate_batch(batch_id: str, mark: str | None = None) -> None:
    """Validate the batch; once it is in progress, send its model's drain, then count its cost
    estimate beside the run (``workers.estimate.estimate_batch``: its lines need not wait for
    it). A redelivered message (the worker died in between) counts an estimate still missing."""
    settings = get_settings()
    task_messages.message_started(settings, celery_app.validate_key(batch_id), mark)
    try:
        model = run_validation(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    except StoreUnavailable as exc:
        # Its rows rolled back and it is still ``validating``: the sweep sends it again.
        log.warning("batch %s: validation waits for the file store (%s)", batch_id, exc)
        return
    if model is not None:
        task_messages.send_drain(settings, model)
    estimate_batch(settings, batch_id)


#: One runner per served model in this process, kept between drain tasks: the gate's hysteresis,
#: the urgent set and the engine sizing carry over from one drain to the next.
_runners: dict[str, Runner] = {}
#: Drains in a row, per model, in which this process claimed no line: the baton such a drain
#: passes waits (``baton_delay``), so a closed gate or lines locked elsewhere cannot spin the queue.
_empty_drains: dict[str, int] = {}
#: The engine worker's idle-release check (``start_runners``); ``None`` until then.
_idle: IdleReleaser | None = None


def runner_for(settings: Settings, model: str) -> Runner:
    """This process's runner for ``model``, built (and its engine loaded) on first use."""
    if model not in _runners:
        engine = _load(settings, model)
        _runners[model] = Runner(settings, engine, worker_id(), device=registry.device_name())
    return _runners[model]


def start_runners(settings: Settings) -> None:
    """Load each served model's engine and build its runner before the worker takes work
    (``offpeak worker --role engine``), so the first drain starts at once: building a runner
    looks up the device, which imports torch (about a second) where no engine has yet. With a
    releasable engine among them, start the idle-release check (``workers.engine.idle_release``:
    an engine whose model has no batch running is released too)."""
    global _idle
    for model in settings.served_models:
        runner_for(settings, model)
    if _idle is None and any(
        isinstance(r.engine, release.ReleasableEngine) for r in _runners.values()
    ):
        _idle = IdleReleaser(settings, lambda: _runners, settings.sweep_seconds)
        _idle.start()


def _load(settings: Settings, model: str) -> Engine:
    """The registry's engine of ``model``, releasable while the gate is closed where its pool
    says so (``workers.engine.release``)."""
    engine = registry.load(settings, model)
    return release.releasable(settings, engine, registry.load_seconds(model))


#: Monotonic times of this process's recent engine failures, per model.
_engine_failures: dict[str, list[float]] = {}
#: Exit status of an engine worker that gave up rebuilding its engine (EX_SOFTWARE).
EXIT_ENGINE_BROKEN = 70


def recover_engine(settings: Settings, model: str, fault: EngineFault) -> None:
    """The engine of ``model`` failed and the runner handed its lines back: close it and load a
    new one into the same runner (its gate and urgent set carry over), then send a drain so the
    lines run again. After ``max_engine_failures`` failures within
    ``engine_failure_window_seconds``, or when the new engine cannot load, exit the process with
    ``EXIT_ENGINE_BROKEN`` for its supervisor (``offpeak up``, Docker, systemd) to restart.

    A remote engine (``engine: "remote"``) is rebuilt by waiting for its server, however long it
    is away: restarting this process would not bring a remote server back, so its failures do
    not count towards the exit (lines a failing server keeps failing are still caught by
    ``max_line_attempts``)."""
    log.error("%s: engine failed (%s); its lines went back to pending", model, fault)
    metrics.ENGINE_FAILURES.labels(model).inc()
    registry.discard(model)
    if settings.models[model].engine == "remote":
        _reconnect(settings, model)
        return
    at = time.monotonic()
    recent = [
        t
        for t in _engine_failures.get(model, [])
        if at - t < settings.engine_failure_window_seconds
    ]
    _engine_failures[model] = [*recent, at]
    if len(_engine_failures[model]) >= settings.max_engine_failures:
        log.critical(
            "%s: %d engine failures in %.0f s; exiting for the supervisor to restart this worker",
            model,
            len(_engine_failures[model]),
            settings.engine_failure_window_seconds,
        )
        _exit_broken()
    try:
        engine = _load(settings, model)
    except Exception:
        log.critical("%s: cannot load a new engine; exiting", model, exc_info=True)
        _exit_broken()
    if model in _runners:
        _runners[model].replace_engine(engine)
    task_messages.send_drain(settings, model)


def _reconnect(settings: Settings, model: str) -> None:
    """A remote engine's rebuild: ``registry.load`` waits for the server's ``/health``."""
    from workers.engine.remote import ServerUnavailable

    try:
        engine = _load(settings, model)
    except ServerUnavailable:
        log.info("%s: stopping while the server is away", model)
        return
    except Exception:
        log.critical("%s: cannot connect a new remote engine; exiting", model, exc_info=True)
        _exit_broken()
    if model in _runners:
        _runners[model].replace_engine(engine)
    task_messages.send_drain(settings, model)


def _exit_broken() -> None:
    registry.close_all()
    logging.shutdown()
    # os._exit, not sys.exit: Celery would catch SystemExit inside a task; and the drain message
    # (acked late) is redelivered to the worker that replaces this one.
    os._exit(EXIT_ENGINE_BROKEN)


def baton_delay(empty_drains: int, longest: float) -> float | None:
    """Seconds the baton of a drain waits after ``empty_drains`` drains in a row that claimed
    nothing: ``None`` (at once) after one that claimed, then 0.25 s doubling up to ``longest``
    (the sweep's period, which sends a drain anyway)."""
    if empty_drains <= 0:
        return None
    return min(longest, 0.25 * 2 ** min(empty_drains - 1, 16))


@app.task(name=celery_app.DRAIN_TASK)
def drain_model(model: str, mark: str | None = None) -> None:
    """Run ``model``'s batch work under the scheduler until nothing admissible is left: every
    runnable line ran, or the load (or a pause) holds the rest back; the sweep sends another
    drain every ``sweep_seconds`` while batches of the model are running. A failed engine is
    rebuilt (``recover_engine``): its lines go back to pending, never to failed."""
    settings = get_settings()
    # The next send queues one.
    task_messages.message_started(settings, celery_app.drain_key(model), mark)
    # Pass the baton: while lines wait, one drain stays queued, so every idle engine worker of
    # the model joins in turn (a busy one takes no second message: prefetch 1, solo pool).
    with session_scope(settings.resolved_database_url) as session:
        waiting = requests_repo.has_pending(session, model)
    if waiting:
        delay = baton_delay(_empty_drains.get(model, 0), settings.sweep_seconds)
        task_messages.send_drain(settings, model, countdown=delay)
    try:
        with _idle.busy(model) if _idle is not None else nullcontext():
            runner = runner_for(settings, model)
            stats = runner.drain()
            _empty_drains[model] = 0 if stats.chunks else _empty_drains.get(model, 0) + 1
            if stats.outcome == "yielded":
                log.info("%s: batch work held back (%s)", model, runner.gate.reason)
                # The gate may stay closed for long: free the engine's memory for real-time
                # serving.
                release.release_if_held_back(runner.engine, runner.gate, settings, time.time())
    except EngineFault as fault:
        recover_engine(settings, model, fault)
        return
    for batch_id in stats.touched:
        task_messages.send_finalize(settings, batch_id)


#: Seconds before a finalize that found the file store away looks again (on top of the store's
#: own retries, ``storage.blobs.RETRY_SECONDS``).
STORE_RETRY_SECONDS = 15.0


@app.task(name=celery_app.FINALIZE_TASK)
def finalize_batch(batch_id: str, mark: str | None = None) -> None:
    """Finalize the batch; while it waits for its lines, queue the next look (one chain per
    batch: ``send_finalize`` skips it when another finalize of the batch is queued sooner)."""
    settings = get_settings()
    task_messages.message_started(settings, celery_app.finalize_key(batch_id), mark)
    try:
        step = finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    except StoreUnavailable as exc:
        # Nothing was written or billed (the transaction rolled back); the rows are intact.
        log.warning("batch %s: finalize waits for the file store (%s)", batch_id, exc)
        step = Step(done=False, retry_in=STORE_RETRY_SECONDS)
    if step.retry_in is not None:
        task_messages.send_finalize(settings, batch_id, countdown=step.retry_in)


@app.task(name=celery_app.WEBHOOKS_TASK)
def deliver_webhooks(mark: str | None = None) -> None:
    """Send every webhook delivery that is due (``workers.webhook_delivery.deliver_due``)."""
    settings = get_settings()
    task_messages.message_started(settings, celery_app.WEBHOOKS_KEY, mark)
    webhook_delivery.deliver_due(settings)


@app.task(name=celery_app.SWEEP_TASK)
def sweep() -> None:
    """Periodic repair (run by the control worker's beat): expire batches past their window,
    and re-send work whose message may have been lost (broker restart, killed worker)."""
    settings = get_settings()
    at = int(time.time())
    with session_scope(settings.resolved_database_url) as session:
        expired = batches_repo.expired_ids(session, at)
        cancelling = batches_repo.ids_in_status(session, BatchStatus.CANCELLING)
        finalizing = batches_repo.ids_in_status(session, BatchStatus.FINALIZING)
        finalizing += batches_repo.finished_but_running(session)
        validating = batches_repo.ids_in_status(session, BatchStatus.VALIDATING)
        models = batches_repo.active_models(session)
        queued_messages.purge(session, before=at - 4 * celery_app.MAX_WAIT_SECONDS)
    # Each is skipped while a message for it is queued, and re-sent once that one is lost.
    task_messages.send_finalizes(settings, sorted({*expired, *cancelling, *finalizing}))
    task_messages.send_validates(settings, validating)
    for model in models:
        if model in settings.models:
            task_messages.send_drain(settings, model)
    # Estimates move on while no engine worker runs the model (load high, workers down).
    # Every configured model: one with nothing left gets its replicas needed back to 0.
    sweep_estimates(settings, list(settings.models), time.time())
    billing.bill_unbilled(settings)  # ended batches whose billing step failed or never ran
    if webhook_delivery.any_due(settings):  # retries coming due, and any run whose message was lost
        task_messages.send_deliver_webhooks(settings)
    retention.sweep_if_due(settings)
    metrics.sample_load(settings)
