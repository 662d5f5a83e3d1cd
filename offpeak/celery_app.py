"""The Celery app both sides share: broker configuration, task and queue names, and the keys
and waits of the once-per-key sending (``storage.task_messages`` sends, with its records in the
database).

The API only sends tasks by name (it never imports ``workers``); the workers' app, this one
with the task functions registered, is ``workers.celery_worker``. Settings follow Celery's
guidance for long GPU jobs (docs.celeryq.dev, "Optimizing" and "Tasks"): late acknowledgement,
prefetch of one, and a redelivery when a worker dies mid-task.
"""

from __future__ import annotations

import re

from celery import Celery

from offpeak.settings import Settings

VALIDATE_TASK = "offpeak.validate_batch"
DRAIN_TASK = "offpeak.drain_model"
FINALIZE_TASK = "offpeak.finalize_batch"
SWEEP_TASK = "offpeak.sweep"
WEBHOOKS_TASK = "offpeak.deliver_webhooks"


def control_queue(settings: Settings) -> str:
    """Validation, finalization and sweeps: light work any control worker can do."""
    return f"{settings.queue_prefix}.control"


def model_queue(settings: Settings, model: str) -> str:
    """Engine work for one served model; only workers that serve ``model`` consume it."""
    return f"{settings.queue_prefix}.model.{re.sub(r'[^A-Za-z0-9_.-]', '_', model)}"


def make_celery(settings: Settings) -> Celery:
    """A Celery app on the configured broker: Redis (``offpeak.redis_broker``), or files on disk
    (``offpeak.broker``)."""
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
        # kombu's own filesystem transport lets a consumer read a half-written message file
        # (JSONDecodeError kills the worker); this one writes and claims files atomically.
        app.conf.broker_transport = "offpeak.broker:Transport"
    else:
        # Longer than the longest drain task, so Redis does not redeliver a task still running.
        options = {"visibility_timeout": 6 * 3600}
        if broker.startswith("redis://"):
            # kombu's Redis transport raises AttributeError when a channel closes after its
            # connection was collected (a broker restart), and Celery stops the worker for it.
            app.conf.broker_transport = "offpeak.redis_broker:Transport"
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


#: Sweeps a sent message may stay unstarted past its due time before it counts as lost and the
#: next sender (the sweep at the latest) sends it again (60 s at the default ``sweep_seconds``,
#: never under 5 s); the wait doubles with each re-send of the same key, up to
#: ``MAX_WAIT_SECONDS``. A control message normally starts within seconds; a drain waits while
#: its worker runs another drain (up to hours), hence the doubling.
FIRST_WAIT_SWEEPS = 6
MAX_WAIT_SECONDS = 900.0


def first_wait_seconds(settings: Settings) -> float:
    return max(5.0, FIRST_WAIT_SWEEPS * settings.sweep_seconds)


def validate_key(batch_id: str) -> str:
    return f"validate:{batch_id}"


def finalize_key(batch_id: str) -> str:
    return f"finalize:{batch_id}"


def drain_key(model: str) -> str:
    return f"drain:{model}"


#: One queued webhook delivery run at a time: a run sends every delivery that is due.
WEBHOOKS_KEY = "webhooks"
