"""Task messages, each sent at most once per key: the API and the workers queue validation,
finalization and drains through here.

A send first reserves the message's key (``storage.repositories.task_messages``: one database
round trip for many keys), then sends the task by name on the shared Celery app
(``offpeak.celery_app``); the task releases the key as it starts (``message_started``), so the
next send queues another. Keys and waits are ``offpeak.celery_app``'s.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable

from offpeak.celery_app import (
    DRAIN_TASK,
    FINALIZE_TASK,
    MAX_WAIT_SECONDS,
    VALIDATE_TASK,
    WEBHOOKS_KEY,
    WEBHOOKS_TASK,
    celery_for,
    control_queue,
    drain_key,
    finalize_key,
    first_wait_seconds,
    model_queue,
    validate_key,
)
from offpeak.settings import Settings
from storage.db import session_scope
from storage.repositories import task_messages as task_messages_repo

log = logging.getLogger(__name__)


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
    ``storage.repositories.task_messages.reserve``); the message carries the ``mark`` its task
    hands to ``message_started``. Returns the number sent. Raises what the database or the broker
    raises; keys reserved but not sent are released first, so nothing waits for a message never
    sent."""
    if not messages:
        return 0
    at = time.time()
    mark = secrets.token_hex(8)
    with session_scope(settings.resolved_database_url) as session:
        keys = task_messages_repo.reserve(
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
            task_messages_repo.release(session, keys, mark)
    except Exception:  # the records then count as lost after their wait: re-sent, not stuck
        log.warning("could not release %d task-message records", len(keys), exc_info=True)


def message_started(settings: Settings, key: str, mark: str | None) -> None:
    """Called first by a task whose message carries ``mark``: the key has no message queued any
    more, so the next sender sends one. A message sent before marks existed carries ``None``."""
    if mark is not None:
        with session_scope(settings.resolved_database_url) as session:
            task_messages_repo.release(session, [key], mark)


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


def send_drain(settings: Settings, model: str, countdown: float | None = None) -> None:
    """Queue a drain of ``model``, runnable in ``countdown`` seconds (``None``: now), unless one
    is already queued that runs no later: new work overtakes a drain that waits.

    One queued drain per model is enough: a drain runs until nothing admissible is left, so it
    takes every batch validated before it starts, and it clears the record as it starts, so work
    arriving during a drain queues the next one. With several engine workers per model, a drain
    that starts while lines are still pending sends the next one (``workers.tasks.drain_model``),
    so the idle workers join one after another.
    """
    messages = {drain_key(model): [model]}
    queue = model_queue(settings, model)
    _send_once(settings, DRAIN_TASK, queue, messages, countdown=countdown, sooner=True)


def send_deliver_webhooks(settings: Settings) -> None:
    """Queue a webhook delivery run (control queue) unless one is already queued: the webhook
    outbox's due deliveries are sent by it (``workers.webhook_delivery.deliver_due``)."""
    messages: dict[str, list[str]] = {WEBHOOKS_KEY: []}
    _send_once(settings, WEBHOOKS_TASK, control_queue(settings), messages)
