"""Celery tasks. Each takes ids, re-reads state from the database and is idempotent; the logic
lives in ``validation``, ``engine_worker`` (the engine worker's engines and runners) and
``finalize``."""

from __future__ import annotations

import logging
import time

from offpeak import celery_app
from offpeak.settings import get_settings
from offpeak.statuses import BatchStatus
from storage import task_messages
from storage.blobs import StoreUnavailable, get_blob_store
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import task_messages as task_messages_repo
from workers import billing, engine_worker, retention, vacuum, webhook_delivery
from workers import worker_metrics as metrics
from workers.estimate import estimate_batch
from workers.finalize import Step, finalize
from workers.scheduler.slack import sweep_estimates
from workers.validation import run_validation
from workers.worker_app import app

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


@app.task(name=celery_app.DRAIN_TASK)
def drain_model(model: str, mark: str | None = None) -> None:
    """Run ``model``'s batch work under the scheduler until nothing admissible is left: every
    runnable line ran, or the load (or a pause) holds the rest back; the sweep sends another
    drain every ``sweep_seconds`` while batches of the model are running. The work, the baton
    and the rebuild of a failed engine are this process's ``EngineWorker.drain``
    (``workers.engine_worker``)."""
    worker = engine_worker.current()
    # The next send queues one.
    task_messages.message_started(worker.settings, celery_app.drain_key(model), mark)
    worker.drain(model)


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
    re-send work whose message may have been lost (broker restart, killed worker), and, last
    (it can take seconds), vacuum where the server's autovacuum is off (``workers.vacuum``)."""
    settings = get_settings()
    at = int(time.time())
    with session_scope(settings.resolved_database_url) as session:
        expired = batches_repo.expired_ids(session, at)
        cancelling = batches_repo.ids_in_status(session, BatchStatus.CANCELLING)
        finalizing = batches_repo.ids_in_status(session, BatchStatus.FINALIZING)
        finalizing += batches_repo.finished_but_running(session)
        validating = batches_repo.ids_in_status(session, BatchStatus.VALIDATING)
        models = batches_repo.active_models(session)
        task_messages_repo.purge(session, before=at - 4 * celery_app.MAX_WAIT_SECONDS)
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
    vacuum.sweep(settings)
