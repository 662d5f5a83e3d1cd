"""Ending a batch: write its output and error files, settle ``request_counts`` and ``usage``,
and set its final status. Idempotent: running it twice, or after a crash half-way, leaves one
output file, one error file and the same counts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import IO

from sqlalchemy.orm import Session

from offpeak.endpoints import anthropic_messages, batch_lines, records
from offpeak.failure_limit import FailureLimit, error_entry
from offpeak.ids import new_id, now
from offpeak.settings import Settings
from offpeak.statuses import BatchStatus, LineStatus
from storage.blobs import BlobStore
from storage.db import session_scope
from storage.models import Batch, File
from storage.repositories import batches as batches_repo
from storage.repositories import files as files_repo
from storage.repositories import requests as requests_repo
from workers import billing, webhook_delivery

log = logging.getLogger(__name__)

#: The status the lines left unrun take, by the batch's final status.
_UNRUN_LINES = {
    BatchStatus.CANCELLED: LineStatus.CANCELLED,
    BatchStatus.EXPIRED: LineStatus.EXPIRED,
    # Stopped by its breaker (``offpeak.failure_limit``): the rest is cancelled.
    BatchStatus.FAILED: LineStatus.CANCELLED,
}


@dataclass
class Step:
    """What a finalize call did: ``done`` (nothing left to do) or ``retry_in`` seconds."""

    done: bool
    retry_in: float | None = None


def _set_output_expiry(session: Session, settings: Settings, batch: Batch) -> None:
    """Give the batch's output and error (or results) files their ``expires_at``: the batch's
    ``output_expires_after`` (anchor ``created_at``: seconds after the file was written), else
    ``output_file_expiry_days``, else none (kept until deleted, OpenAI's default)."""
    seconds = batch.output_expires_after
    if seconds is None and settings.output_file_expiry_days is not None:
        seconds = settings.output_file_expiry_days * 86_400
    if seconds is None:
        return
    for file_id in (batch.output_file_id, batch.error_file_id):
        file = files_repo.get_any(session, file_id) if file_id else None
        if file is not None:
            file.expires_at = file.created_at + seconds


def _write_files(session: Session, blobs: BlobStore, batch: Batch) -> None:
    """Stream the batch's rows into its output and error files and record them, once: the blob
    keys are fixed, so a re-run overwrites the bytes, and reuses the file rows it finds under them
    (a unique index on live blob keys backs this up).

    Each line is rendered in OpenAI's shape from the row's record (``offpeak.endpoints``), whose
    ids were fixed when the line finished; a never-ran line's id is derived from the batch and
    its custom_id. A re-run therefore writes the same bytes.

    A Message Batch (Anthropic's surface) gets one results file instead, its ``output_file_id``
    (``_write_results``)."""
    if batch.endpoint == anthropic_messages.URL:
        _write_results(session, blobs, batch)
        return
    out_key, err_key = f"outputs/{batch.id}/output.jsonl", f"outputs/{batch.id}/errors.jsonl"
    with blobs.writer(out_key) as out_file, blobs.writer(err_key) as err_file:
        out, err = _Lines(out_file), _Lines(err_file)
        for custom_id, status, result in requests_repo.iter_finished(session, batch.id):
            if status == LineStatus.SUCCEEDED and not result:
                out.add(b"")
                continue
            # pending/running rows do not exist once a batch is ending
            line = batch_lines.batch_line(batch.id, custom_id, status, result)
            if line is not None:
                (out if line.file == "output" else err).add(line.json)
        out.flush()
        err.flush()
    _keep_file(session, blobs, batch, (out.bytes, out_key, "output", "output_file_id"))
    _keep_file(session, blobs, batch, (err.bytes, err_key, "error", "error_file_id"))


class _Lines:
    """JSONL lines written to ``handle`` in pieces of ``PIECE_LINES`` (one write call each: a
    write per line through the blob store's file object costs more than the line);
    ``bytes``: what was added, newlines included."""

    PIECE_LINES = 1024

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.bytes = 0
        self._piece: list[bytes] = []

    def add(self, line: bytes) -> None:
        self._piece.append(line)
        self.bytes += len(line) + 1
        if len(self._piece) >= self.PIECE_LINES:
            self.flush()

    def flush(self) -> None:
        if self._piece:
            self._piece.append(b"")
            self.handle.write(b"\n".join(self._piece))
            self._piece.clear()


def _write_results(session: Session, blobs: BlobStore, batch: Batch) -> None:
    """A Message Batch's results file: one line per request in Anthropic's shape
    (``anthropic_messages.result_line``: succeeded, errored, canceled or expired), rendered from
    the rows' records like the OpenAI files, so a re-run writes the same bytes."""
    key = f"outputs/{batch.id}/results.jsonl"
    size = 0
    with blobs.writer(key) as out:
        for custom_id, status, result in requests_repo.iter_finished(session, batch.id):
            if status not in LineStatus.ENDED:
                continue  # pending/running rows do not exist once a batch is ending
            record = records.load(result) if result else None
            line = anthropic_messages.result_line(custom_id, record, status) + b"\n"
            out.write(line)
            size += len(line)
    _keep_file(session, blobs, batch, (size, key, "results", "output_file_id"))


def _keep_file(
    session: Session, blobs: BlobStore, batch: Batch, written: tuple[int, str, str, str]
) -> None:
    """Record a blob just written, ``written = (size in bytes, key, kind, attr)``, as the
    batch's ``attr`` file (``output_file_id``…) named after ``kind``, reusing the file row a
    previous run made for it; an empty one is deleted instead."""
    size, key, kind, attr = written
    created = now()
    existing = files_repo.live_by_blob_key(session, key)
    if size == 0:
        blobs.delete(key)
        if existing is not None:
            existing.deleted = True
        return
    if existing is not None:
        existing.bytes = size
        setattr(batch, attr, existing.id)
        return
    file = files_repo.add(
        session,
        File(
            id=new_id("file-"),
            tenant_id=batch.tenant_id,
            filename=f"{batch.id}_{kind}.jsonl",
            purpose="batch_output",
            bytes=size,
            status="processed",
            blob_key=key,
            created_at=created,
            expires_at=None,
            deleted=False,
        ),
    )
    setattr(batch, attr, file.id)


#: Seconds between looks at a cancelling or expired batch whose lines a worker still holds:
#: a quarter of the time it has waited, within these bounds. A live worker stops a cancelled
#: batch's lines within seconds; a dead one's leases run out after ``lease_seconds``.
RETRY_MIN_SECONDS = 1.0
RETRY_MAX_SECONDS = 10.0


def _retry_in(waited: float) -> float:
    return min(max(RETRY_MIN_SECONDS, waited / 4), RETRY_MAX_SECONDS)


def _advance(settings: Settings, blobs: BlobStore, batch_id: str) -> Step:
    """Advance a batch towards its end, if it is ready; safe to call any number of times.

    - ``in_progress`` with every line finished → ``finalizing`` → ``completed``.
    - ``in_progress`` past ``expires_at`` with lines left undone → unrun lines become
      ``batch_expired`` → ``expired``; with every line finished it ends ``completed`` (a finalize
      that runs late, the control worker down at the deadline, changes nothing).
    - ``cancelling`` → unrun lines become ``batch_cancelled`` → ``cancelled``, once no worker
      still holds a live lease on one of its lines (``retry_in`` says when to look again);
      ``failed`` instead, with its ``errors`` entry, when its breaker stopped it
      (``offpeak.failure_limit``).
    """
    url = settings.resolved_database_url
    with session_scope(url) as session:
        batch = batches_repo.lock(session, batch_id)
        if batch is None or batch.status in BatchStatus.FINAL:
            return Step(done=True)
        if batch.status == BatchStatus.VALIDATING:
            return Step(done=False)
        at = time.time()
        if (
            batch.status == BatchStatus.IN_PROGRESS
            and batch.expires_at <= at
            and batches_repo.window_left_work(session, batch_id)
        ):
            target = BatchStatus.EXPIRED
        elif batch.status == BatchStatus.CANCELLING:
            stopped = batch.failure_limit_reached_at is not None
            target = BatchStatus.FAILED if stopped else BatchStatus.CANCELLED
        else:
            target = BatchStatus.COMPLETED
        if target in _UNRUN_LINES:
            requests_repo.end_unfinished(session, batch_id, _UNRUN_LINES[target], at)
        unfinished = batches_repo.unfinished_by_status(session, batch_id)
        if unfinished:
            # Lines still pending or held by a live worker: that worker finishes or aborts them.
            batches_repo.refresh_counts(session, [batch_id])
            if target == BatchStatus.COMPLETED:
                return Step(done=False)  # the drain that finishes the lines sends the finalize
            since = batch.expires_at if target == BatchStatus.EXPIRED else batch.cancelling_at
            return Step(done=False, retry_in=_retry_in(at - (since or at)))
        if target == BatchStatus.COMPLETED and batch.status == BatchStatus.IN_PROGRESS:
            batch.status, batch.finalizing_at = BatchStatus.FINALIZING, now()
    with session_scope(url) as session:
        # Locked on SQLite too: two finalizes that both passed the status check wrote two files.
        batch = batches_repo.lock(session, batch_id)
        if batch is None or batch.status in BatchStatus.FINAL:
            return Step(done=True)
        batches_repo.refresh_counts(session, [batch_id])
        session.refresh(batch)
        batch.min_prompt_tokens = batches_repo.min_prompt_tokens(session, batch_id)
        _write_files(session, blobs, batch)
        _set_output_expiry(session, settings, batch)
        stamp = now()
        final = {
            BatchStatus.COMPLETED: "completed_at",
            BatchStatus.EXPIRED: "expired_at",
            BatchStatus.CANCELLED: "cancelled_at",
            BatchStatus.FAILED: "failed_at",
        }
        if target == BatchStatus.FAILED:
            batch.errors = [_breaker_error(session, batch)]
        batch.status = target
        setattr(batch, final[target], stamp)
        # The outbox row commits with the status, never an HTTP call under this lock.
        webhook_delivery.record_final(session, settings, batch)
        log.info(
            "batch %s %s: %d completed, %d failed", batch_id, target, batch.completed, batch.failed
        )
    return Step(done=True)


def _breaker_error(session: Session, batch: Batch) -> dict[str, object]:
    """The ``errors.data`` entry of a batch its breaker stopped, with its lines' counts."""
    counts = batches_repo.line_counts(session, batch.id)
    failed = counts.get(LineStatus.FAILED, 0)
    ran = counts.get(LineStatus.SUCCEEDED, 0) + failed
    limit = FailureLimit.model_validate(batch.failure_limit)
    return error_entry(limit, ran, failed, counts.get(LineStatus.CANCELLED, 0))


def finalize(settings: Settings, blobs: BlobStore, batch_id: str) -> Step:
    """``_advance``, then, once the batch has ended, its bill (``workers.billing``).

    Billing runs in its own transaction after the final status has committed: if it fails, the
    batch stays ended and unbilled, and the sweep bills it later. Billed at most once, however
    often this runs.
    """
    step = _advance(settings, blobs, batch_id)
    if step.done:
        billing.bill_safely(settings, batch_id)
    return step
