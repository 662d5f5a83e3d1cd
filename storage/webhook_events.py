"""A batch's webhook event into the transactional outbox, in the caller's transaction, with a
pending delivery per endpoint of the tenant subscribed to it; the delivery task is sent once the
transaction commits. Written by finalize and validation (the final statuses,
``workers.webhook_delivery.record_final``) and by the API (a batch paused or resumed);
delivered by ``workers.webhook_delivery.deliver_due``."""

from __future__ import annotations

import time
from functools import partial

from sqlalchemy.orm import Session

from offpeak import webhook_protocol
from offpeak.endpoints import BATCH_ENDPOINTS
from offpeak.ids import new_id, now
from offpeak.settings import Settings
from storage import task_messages
from storage.db import after_commit
from storage.models import Batch
from storage.repositories import webhooks as webhooks_repo


def record(
    session: Session, settings: Settings, batch: Batch, event_type: str, dedupe_key: str
) -> None:
    """Write ``event_type`` of ``batch`` to the outbox unless an event of ``dedupe_key`` is
    there already (a task running again adds none). A Message Batch (Anthropic's surface, which
    has no webhooks) gets none: OpenAI's events name /v1/batches objects."""
    if batch.endpoint not in BATCH_ENDPOINTS:
        return
    endpoint_ids = webhooks_repo.subscribed_endpoint_ids(session, batch.tenant_id, event_type)
    if not endpoint_ids:
        return
    event_id, created, at = new_id("evt_"), now(), time.time()
    added = webhooks_repo.add_event(
        session,
        tenant_id=batch.tenant_id,
        event_id=event_id,
        event_type=event_type,
        object_id=batch.id,
        body=webhook_protocol.event_body(event_id, event_type, created, batch.id),
        created_at=created,
        dedupe_key=dedupe_key,
        endpoint_ids=endpoint_ids,
        at=at,
        give_up_at=at + settings.webhook_retry_hours * 3600,
    )
    if added:
        send = partial(task_messages.send_deliver_webhooks, settings)
        after_commit(session, send, f"sending deliver_webhooks for {event_id}")
