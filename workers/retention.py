"""The retention sweep: nothing grows forever.

Every ``retention_sweep_seconds`` (from the control worker's periodic sweep) it deletes

- files past their ``expires_at`` (uploads: ``expires_after`` or ``file_expiry_days``; output
  and error files: the batch's ``output_expires_after`` or ``output_file_expiry_days``) and
  files already deleted: their bytes, then their rows;
- the request rows of batches that ended more than ``request_retention_days`` ago and are
  billed: the batch object (its counts and usage live on the batch row), its files and its bill
  stay, so a retrieve still answers in full;
- idempotency keys past their 24 h, and webhook events (with their deliveries and attempts)
  older than ``webhook_log_days`` that nothing still owes.

Each kind is deleted in pieces of ``PIECE`` rows per transaction, so a sweep never holds a long
transaction on a busy table; whatever is left goes in the next sweep.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from offpeak.settings import Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.repositories import retention as retention_repo
from storage.repositories import webhooks as webhooks_repo

log = logging.getLogger(__name__)

#: Rows deleted per transaction.
PIECE = 5000
#: Files (blobs) deleted per transaction: each is a call to the blob store.
FILE_PIECE = 200
#: Pieces one sweep deletes at most, per kind.
MAX_PIECES = 20
DAY_SECONDS = 86_400


@dataclass
class Swept:
    """What one sweep deleted."""

    files: int = 0
    file_bytes: int = 0
    request_rows: int = 0
    batches_pruned: int = 0
    idempotency_keys: int = 0
    webhook_events: int = 0


_last_sweep: dict[str, float] = {}


def sweep_if_due(settings: Settings) -> Swept | None:
    """``sweep`` when this process last ran it ``retention_sweep_seconds`` ago or more (several
    control workers may each run it: every step is idempotent and skips rows locked by another).
    Errors are logged, not raised: the periodic sweep's other work must go on."""
    key = settings.resolved_database_url
    at = time.monotonic()
    if at - _last_sweep.get(key, float("-inf")) < settings.retention_sweep_seconds:
        return None
    _last_sweep[key] = at
    try:
        return sweep(settings)
    except Exception:
        log.exception("retention sweep failed; the next one tries again")
        return None


def sweep(settings: Settings, *, at: float | None = None) -> Swept:
    """Delete what retention allows at unix time ``at`` (now by default); see the module."""
    at = time.time() if at is None else at
    swept = Swept()
    _files(settings, int(at), swept)
    if settings.request_retention_days is not None:
        _request_rows(settings, int(at - settings.request_retention_days * DAY_SECONDS), swept)
    url = settings.resolved_database_url
    with session_scope(url) as session:
        swept.idempotency_keys = retention_repo.purge_idempotency_keys(session, at=at)
        swept.webhook_events = webhooks_repo.purge_events(
            session, before=int(at - settings.webhook_log_days * DAY_SECONDS)
        )
    if any(vars(swept).values()):
        log.info("retention sweep: %s", swept)
    return swept


def _files(settings: Settings, at: int, swept: Swept) -> None:
    blobs = get_blob_store(settings.resolved_blob_url)
    for _ in range(MAX_PIECES):
        with session_scope(settings.resolved_database_url) as session:
            found = retention_repo.expired_files(session, at=at, limit=FILE_PIECE)
            for _file_id, key in found:
                # Bytes first: a row left behind by a failure is found again next sweep, bytes
                # without a row would never be.
                if blobs.exists(key):
                    swept.file_bytes += blobs.size(key)
                    blobs.delete(key)
            swept.files += retention_repo.delete_files(session, [f for f, _ in found])
        if len(found) < FILE_PIECE:
            return


def _request_rows(settings: Settings, ended_before: int, swept: Swept) -> None:
    url = settings.resolved_database_url
    with session_scope(url) as session:
        batch_ids = retention_repo.batches_to_prune(session, ended_before=ended_before, limit=100)
    pieces = 0
    for batch_id in batch_ids:
        while pieces < MAX_PIECES:
            with session_scope(url) as session:
                deleted = retention_repo.delete_request_rows(session, batch_id, limit=PIECE)
            pieces += 1
            swept.request_rows += deleted
            if deleted < PIECE:
                swept.batches_pruned += 1
                break
