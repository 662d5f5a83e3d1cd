"""The Celery app both sides share: broker configuration and queue names.

The API only sends tasks by name (it never imports ``workers``); workers register the task
functions on the same app. Settings follow Celery's guidance for long GPU jobs
(docs.celeryq.dev, "Optimizing" and "Tasks"): late acknowledgement, prefetch of one, and a
redelivery when a worker dies mid-task.
"""

from __future__ import annotations

import re

from celery import Celery

from offpeak.settings import Settings

VALIDATE_TASK = "offpeak.validate_batch"
DRAIN_TASK = "offpeak.drain_model"
FINALIZE_TASK = "offpeak.finalize_batch"
SWEEP_TASK = "offpeak.sweep"


def control_queue(settings: Settings) -> str:
    """Validation, finalization and sweeps: light work any control worker can do."""
    return f"{settings.queue_prefix}.control"


def model_queue(settings: Settings, model: str) -> str:
    """Engine work for one served model; only workers that serve ``model`` consume it."""
    return f"{settings.queue_prefix}.model.{re.sub(r'[^A-Za-z0-9_.-]', '_', model)}"


def make_celery(settings: Settings) -> Celery:
    """A Celery app on the configured broker (Redis, or kombu's filesystem transport)."""
    broker = settings.resolved_broker_url
    app = Celery("offpeak", broker=broker, set_as_current=False)
    options: dict[str, object] = {}
    if broker.startswith("filesystem://"):
        folder = settings.broker_folder
        for sub in ("in", "processed", "control"):
            (folder / sub).mkdir(parents=True, exist_ok=True)
        options = {
            "data_folder_in": str(folder / "in"),
            "data_folder_out": str(folder / "in"),
            "processed_folder": str(folder / "processed"),
            # Exchange tables; kombu's default is ./control in the working directory.
            "control_folder": str(folder / "control"),
            "store_processed": False,
        }
    else:
        # Longer than the longest drain task, so Redis does not redeliver a task still running.
        options = {"visibility_timeout": 6 * 3600}
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options=options,
        broker_connection_retry_on_startup=True,
        task_default_queue=control_queue(settings),
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
    )
    return app


_apps: dict[str, Celery] = {}


def celery_for(settings: Settings) -> Celery:
    """One Celery app per distinct broker/queue configuration in this process."""
    key = f"{settings.resolved_broker_url}|{settings.queue_prefix}|{settings.data_dir}"
    if key not in _apps:
        _apps[key] = make_celery(settings)
    return _apps[key]


def send_validate(settings: Settings, batch_id: str) -> None:
    celery_for(settings).send_task(VALIDATE_TASK, args=[batch_id], queue=control_queue(settings))


def send_finalize(settings: Settings, batch_id: str, countdown: float | None = None) -> None:
    celery_for(settings).send_task(
        FINALIZE_TASK, args=[batch_id], queue=control_queue(settings), countdown=countdown
    )


def send_drain(settings: Settings, model: str) -> None:
    celery_for(settings).send_task(DRAIN_TASK, args=[model], queue=model_queue(settings, model))
