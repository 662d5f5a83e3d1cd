"""Celery tasks. Each takes ids, re-reads state from the database and is idempotent; the logic
lives in ``validation``, ``runner`` and ``finalize``."""

from __future__ import annotations

import logging
import time

from offpeak import queues
from offpeak.settings import get_settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from workers.celery_app import app
from workers.engine import registry
from workers.finalize import finalize
from workers.runner import Runner, worker_id
from workers.validation import run_validation

log = logging.getLogger(__name__)


@app.task(name=queues.VALIDATE_TASK)
def validate_batch(batch_id: str) -> None:
    settings = get_settings()
    model = run_validation(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    if model is not None:
        queues.send_drain(settings, model)


@app.task(name=queues.DRAIN_TASK)
def drain_model(model: str) -> None:
    """Run every runnable line of ``model``; the engine is loaded once per process."""
    settings = get_settings()
    engine = registry.load(settings, model)
    touched: set[str] = set()
    runner = Runner(settings, engine, worker_id(), touched.add, device=registry.device_name())
    stats = runner.drain()
    for batch_id in touched:
        queues.send_finalize(settings, batch_id)
    if stats.requests:
        log.info(
            "%s: %d requests in %d chunks, %d prompt + %d completion tokens in %.1f s (%.0f tok/s)",
            model,
            stats.requests,
            stats.chunks,
            stats.prompt_tokens,
            stats.completion_tokens,
            stats.seconds,
            stats.completion_tokens / max(stats.seconds, 1e-9),
        )


@app.task(name=queues.FINALIZE_TASK)
def finalize_batch(batch_id: str) -> None:
    settings = get_settings()
    step = finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    if step.retry_in is not None:
        queues.send_finalize(settings, batch_id, countdown=step.retry_in)


@app.task(name=queues.SWEEP_TASK)
def sweep() -> None:
    """Periodic repair (run by the control worker's beat): expire batches past their window,
    and re-send work whose message may have been lost (broker restart, killed worker)."""
    settings = get_settings()
    at = int(time.time())
    with session_scope(settings.resolved_database_url) as session:
        expired = batches_repo.expired_ids(session, at)
        cancelling = batches_repo.ids_in_status(session, "cancelling")
        finalizing = batches_repo.ids_in_status(session, "finalizing")
        finalizing += batches_repo.finished_but_running(session)
        validating = batches_repo.ids_in_status(session, "validating")
        models = batches_repo.active_models(session)
    for batch_id in {*expired, *cancelling, *finalizing}:
        queues.send_finalize(settings, batch_id)
    for batch_id in validating:
        queues.send_validate(settings, batch_id)
    for model in models:
        if model in settings.models:
            queues.send_drain(settings, model)
