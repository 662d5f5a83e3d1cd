"""Pausing and resuming a batch (``POST /v1/batches/{id}/pause`` and ``/resume``, Offpeak
extensions), by its tenant or the operator.

A paused batch stays ``in_progress`` (OpenAI's clients know no other status) with
``paused_at`` set: no claim takes its lines (``storage.repositories.requests.CLAIMABLE``), the
lines a worker already holds finish, and its window keeps running (a batch still paused at
``expires_at`` expires like any other). Each change sends a ``batch.paused`` or
``batch.resumed`` webhook event (``storage.webhook_events``).
"""

from __future__ import annotations

from functools import partial

from sqlalchemy.orm import Session

from api.errors import Conflict, NotFound
from api.services import batches as batches_service
from offpeak.endpoints import anthropic_messages
from offpeak.ids import now
from offpeak.settings import Settings
from offpeak.statuses import BatchStatus
from storage import task_messages, webhook_events
from storage.db import after_commit
from storage.models import Batch
from storage.repositories import batches as batches_repo

#: The statuses a batch may be paused or resumed in: before it ends, and before it is being
#: cancelled or finalized.
PAUSABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


def _locked(session: Session, tenant_id: str | None, batch_id: str, verb: str) -> Batch:
    """The batch, row-locked, of the tenant (any tenant's for the operator, ``None``).
    Raises ``NotFound`` for an unknown or another tenant's batch and ``Conflict`` (409) for one
    that is ending or has ended."""
    if tenant_id is not None:
        batches_service.get(session, tenant_id, batch_id)
    batch = batches_repo.get_for_update(session, batch_id, no_key=True, refresh=True)
    if batch is None or batch.endpoint == anthropic_messages.URL:
        raise NotFound(f"No batch found with id '{batch_id}'.", param="batch_id")
    if batch.status not in PAUSABLE:
        raise Conflict(f"Cannot {verb} a batch with status {batch.status!r}.", param="batch_id")
    return batch


def pause(session: Session, settings: Settings, tenant_id: str | None, batch_id: str) -> Batch:
    """Pause the batch; a batch already paused is answered as it is. Raises as ``_locked``."""
    batch = _locked(session, tenant_id, batch_id, "pause")
    if batch.paused_at is None:
        batch.paused_at = now()
        webhook_events.record(
            session, settings, batch, "batch.paused", f"batch.paused:{batch.id}:{batch.paused_at}"
        )
        session.flush()
    return batch


def resume(session: Session, settings: Settings, tenant_id: str | None, batch_id: str) -> Batch:
    """Resume a paused batch and send its model's drain; a batch not paused is answered as it
    is. Raises as ``_locked``."""
    batch = _locked(session, tenant_id, batch_id, "resume")
    if batch.paused_at is not None:
        paused_at, batch.paused_at = batch.paused_at, None
        webhook_events.record(
            session, settings, batch, "batch.resumed", f"batch.resumed:{batch.id}:{paused_at}"
        )
        session.flush()
        if batch.model is not None:
            send = partial(task_messages.send_drain, settings, batch.model)
            after_commit(session, send, f"sending drain {batch.model}")
    return batch
