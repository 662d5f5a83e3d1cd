"""The Celery app both sides share: broker configuration and queue names.

The API only sends tasks by name (it never imports ``workers``); workers register the task
functions on the same app. Settings follow Celery's guidance for long GPU jobs
(docs.celeryq.dev, "Optimizing" and "Tasks"): late acknowledgement, prefetch of one, and a
redelivery when a worker dies mid-task.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Iterable

from celery import Celery

from offpeak.settings import Settings
from storage.db import session_scope
from storage.repositories import queued_messages

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
    """A Celery app on the configured broker (Redis, or ``offpeak.broker``: files on disk)."""
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


log = logging.getLogger(__name__)

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


def _send_once(
    settings: Settings,
    task: str,
    queue: str,
    messages: dict[str, list[str]],
    *,
    countdown: float | None = None,
    sooner: bool = False,
) -> int:
    """Send ``task`` for each ``key → args`` of ``messages`` that has no message queued yet (see
    ``queued_messages.reserve``); the message carries the ``mark`` its task hands to
    ``message_started``. Returns the number sent. Raises what the database or the broker raises;
    keys reserved but not sent are released first, so nothing waits for a message never sent."""
    if not messages:
        return 0
    at = time.time()
    mark = secrets.token_hex(8)
    with session_scope(settings.resolved_database_url) as session:
        keys = queued_messages.reserve(
            session,
            list(messages),
            mark=mark,
            now=at,
            due_at=at + (countdown or 0.0),
            wait_seconds=first_wait_seconds(settings),
            max_wait_seconds=MAX_WAIT_SECONDS,
            sooner=sooner,
        )
    app = celery_for(settings)
    for done, key in enumerate(keys):
        try:
            app.send_task(
                task, args=messages[key], kwargs={"mark": mark}, queue=queue, countdown=countdown
            )
        except BaseException:
            _release(settings, keys[done:], mark)
            raise
    return len(keys)


def _release(settings: Settings, keys: list[str], mark: str) -> None:
    try:
        with session_scope(settings.resolved_database_url) as session:
            queued_messages.release(session, keys, mark)
    except Exception:  # the records then count as lost after their wait: re-sent, not stuck
        log.warning("could not release %d queued-message records", len(keys), exc_info=True)


def message_started(settings: Settings, key: str, mark: str | None) -> None:
    """Called first by a task whose message carries ``mark``: the key has no message queued any
    more, so the next sender sends one. A message sent before marks existed carries ``None``."""
    if mark is not None:
        with session_scope(settings.resolved_database_url) as session:
            queued_messages.release(session, [key], mark)


def send_validate(settings: Settings, batch_id: str) -> None:
    """Queue the batch's validation unless one is already queued."""
    send_validates(settings, [batch_id])


def send_validates(settings: Settings, batch_ids: Iterable[str]) -> int:
    """``send_validate`` for many batches in one database round trip (the sweep)."""
    messages = {validate_key(b): [b] for b in batch_ids}
    return _send_once(settings, VALIDATE_TASK, control_queue(settings), messages)


def send_finalize(settings: Settings, batch_id: str, countdown: float | None = None) -> None:
    """Queue a finalize of the batch, runnable in ``countdown`` seconds, unless one is queued that
    runs no later. At most two are ever queued per batch (a later one and the one
    that overtook it); the task itself re-queues one while the batch waits for its lines."""
    messages = {finalize_key(batch_id): [batch_id]}
    queue = control_queue(settings)
    _send_once(settings, FINALIZE_TASK, queue, messages, countdown=countdown, sooner=True)


def send_finalizes(settings: Settings, batch_ids: Iterable[str]) -> int:
    """The sweep's re-send: a finalize for each batch that has none queued or whose message was
    lost (a waiting batch's own retry is not overtaken: it keeps one chain per batch)."""
    messages = {finalize_key(b): [b] for b in batch_ids}
    return _send_once(settings, FINALIZE_TASK, control_queue(settings), messages)


def send_drain(settings: Settings, model: str) -> None:
    """Queue a drain of ``model`` unless one is already queued.

    One queued drain per model is enough: a drain runs until nothing admissible is left, so it
    takes every batch validated before it starts, and it clears the record as it starts, so work
    arriving during a drain queues the next one. With several engine workers per model, a drain
    that starts while lines are still pending sends the next one (``workers.tasks.drain_model``),
    so the idle workers join one after another.
    """
    messages = {drain_key(model): [model]}
    _send_once(settings, DRAIN_TASK, model_queue(settings, model), messages)
