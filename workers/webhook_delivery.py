"""Webhook delivery from the transactional outbox.

``record_final`` runs inside the transaction that sets a batch's final status (finalize,
validation), so the event exists exactly when the status does: no HTTP call there, and nothing
lost when a worker dies after the commit. ``deliver_due`` (the ``deliver_webhooks`` task, sent
after that commit and by the sweep while deliveries are due) leases due deliveries, commits,
then posts each with httpx outside any transaction, and logs the attempt. A failed attempt is
retried with exponential backoff (``offpeak.webhook_protocol.retry_delay``) until
``webhook_retry_hours`` after the event; delivery is at least once (a worker killed between the
POST and the log sends again once the lease runs out), and ``webhook-id`` lets the receiver drop
duplicates.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from sqlalchemy.orm import Session

from offpeak import webhook_protocol, webhook_target
from offpeak.settings import Settings
from storage import webhook_events
from storage.db import session_scope
from storage.models import Batch
from storage.repositories import webhooks as webhooks_repo

log = logging.getLogger(__name__)

#: Deliveries one claim takes; the task claims again until none is due.
CLAIM_SIZE = 20
#: Attempts of one claim sent at once, so one slow receiver does not hold up the others.
PARALLEL_POSTS = 8


def record_final(session: Session, settings: Settings, batch: Batch) -> None:
    """Write the event of ``batch``'s final status to the outbox, with a pending delivery per
    endpoint of the tenant subscribed to it, in the caller's transaction (the one that sets the
    status), and send the delivery task once it commits. A batch that already has the event
    (finalize running again) gets no second one: ``dedupe_key`` is unique."""
    event_type = webhook_protocol.EVENT_OF_STATUS.get(batch.status)  # type: ignore[call-overload]
    if event_type is not None:
        webhook_events.record(session, settings, batch, event_type, f"{event_type}:{batch.id}")


def attempt(settings: Settings, due: webhooks_repo.DueDelivery) -> webhook_target.Attempt:
    """One signed POST of a leased delivery, its target checked again as it is sent (a name may
    resolve to a private address by now): a refused target is a failed attempt."""
    headers = webhook_protocol.signed_headers(
        due.event_id, due.body, due.signing_secrets, time.time()
    )
    return webhook_target.send(
        due.url,
        due.body,
        headers,
        timeout=settings.webhook_timeout_seconds,
        allow_http=settings.webhook_allow_http,
        allow_private=settings.webhook_allow_private_targets,
    )


def deliver_due(settings: Settings, *, max_rounds: int = 50) -> int:
    """Send every delivery due now, ``CLAIM_SIZE`` at a time; returns the attempts made.

    A claim's attempts are sent ``PARALLEL_POSTS`` at a time; its lease covers them all timing
    out, plus a margin, so a delivery whose worker died is due again soon after. The attempt's
    ``at`` in the log is when its answer was recorded. ``max_rounds`` bounds one call (the sweep
    sends the task again while deliveries are due).
    """
    url = settings.resolved_database_url
    # Long enough for every attempt of a claim, sent PARALLEL_POSTS at a time, to time out.
    waves = -(-CLAIM_SIZE // PARALLEL_POSTS)
    lease = waves * settings.webhook_timeout_seconds + 30
    made = 0
    for _ in range(max_rounds):
        with session_scope(url) as session:
            claimed = webhooks_repo.claim_due(
                session, at=time.time(), limit=CLAIM_SIZE, lease_seconds=lease
            )
        if not claimed:
            break
        with ThreadPoolExecutor(min(PARALLEL_POSTS, len(claimed))) as pool:
            results = list(pool.map(partial(attempt, settings), claimed))
        for due, result in zip(claimed, results, strict=True):
            at = time.time()
            next_at: float | None = None
            if not result.delivered:
                delay = webhook_protocol.retry_delay(
                    due.attempt,
                    settings.webhook_retry_base_seconds,
                    settings.webhook_retry_max_seconds,
                )
                next_at = at + delay if at + delay <= due.give_up_at else None
            with session_scope(url) as session:
                webhooks_repo.record_attempt(
                    session,
                    due.delivery_id,
                    attempt=due.attempt,
                    at=at,
                    status_code=result.status_code,
                    latency_seconds=result.latency_seconds,
                    error=result.error,
                    delivered=result.delivered,
                    next_attempt_at=next_at,
                )
            made += 1
            if not result.delivered:
                log.info(
                    "webhook %s attempt %d to %s: %s %s; %s",
                    due.event_id,
                    due.attempt,
                    due.url,
                    result.status_code,
                    result.error or "",
                    "retry later" if next_at else "giving up",
                )
    return made


def any_due(settings: Settings) -> bool:
    with session_scope(settings.resolved_database_url) as session:
        return webhooks_repo.any_due(session, time.time())
