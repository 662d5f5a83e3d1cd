"""Message Batches (Anthropic's surface) on the same storage and scheduler as OpenAI's batches.

A create turns the inline ``requests`` into an input file of request lines
(``{custom_id, method, url: "/v1/messages", body: params}``) and a batch row whose endpoint is
``/v1/messages``, then queues its validation: from there validation, claims, leases, deadlines,
finalize (which writes Anthropic's results file) and billing are the ones every batch gets.
Each request's ``params`` are checked when it runs (``offpeak.endpoints.anthropic_messages``);
only the envelope is checked here, as Anthropic's API does.

Errors raised here are ``api.errors.ApiError``s; on these routes they are rendered in
Anthropic's shape (``api.errors``).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import orjson
from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.errors import BadRequest, NotFound
from api.schemas.message_batches import CreateMessageBatch, MessageBatchRequestCounts
from api.services import quotas as quotas_service
from offpeak.endpoints import anthropic_messages
from offpeak.ids import new_id, now
from offpeak.settings import Settings, window_seconds
from offpeak.statuses import BatchStatus, LineStatus
from storage import task_messages
from storage.blobs import BlobStore
from storage.db import after_commit
from storage.models import Batch, File
from storage.repositories import batches as batches_repo
from storage.repositories import files as files_repo
from storage.repositories import message_batches as repo

#: Anthropic's limits (Message Batches, "Batch limitations"): 100,000 requests or 256 MB.
MAX_REQUESTS = 100_000
MAX_BODY_BYTES = 256 * 1024 * 1024
#: A Message Batch ends processing 24 hours after creation at the latest.
WINDOW = "24h"
WINDOW_SECONDS = window_seconds(WINDOW)
MAX_LIST_LIMIT = 1000
#: Batch statuses in which cancelling means something.
CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


def _parse(raw: bytes) -> CreateMessageBatch:
    """The create body. Raises ``BadRequest`` in Anthropic's wording (``<path>: <problem>``)."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise BadRequest("The request body is not valid JSON.") from None
    try:
        return CreateMessageBatch.model_validate(document)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"]) or "body"
        message = error["msg"]
        if error["type"] == "string_pattern_mismatch":
            message = "must match ^[a-zA-Z0-9_-]{1,64}$ (1 to 64 letters, digits, '-' or '_')"
        raise BadRequest(f"{where}: {message}", param=where) from None


def _batch_model(body: CreateMessageBatch, served: dict[str, object]) -> str:
    """The model the batch runs on: the one its requests name among the served models. A
    request naming a model not served errors alone when it runs; a batch naming two served
    models is refused (one batch runs one model here). With no served model named, the first
    configured one, whose worker then answers every request ``not_found_error``."""
    chosen: tuple[int, str] | None = None
    for index, request in enumerate(body.requests):
        model = request.params.get("model")
        if not isinstance(model, str) or model not in served:
            continue
        if chosen is None:
            chosen = (index, model)
        elif model != chosen[1]:
            raise BadRequest(
                f"requests.{index}.params.model: this server runs a Message Batch on one model; "
                f"this batch names {chosen[1]!r} (requests.{chosen[0]}) and {model!r}. Send one "
                "batch per model.",
                param=f"requests.{index}.params.model",
            )
    if chosen is not None:
        return chosen[1]
    if not served:
        raise BadRequest("This server serves no model.")
    return next(iter(served))


def _request_lines(body: CreateMessageBatch) -> Iterator[bytes]:
    seen: dict[str, int] = {}
    for index, request in enumerate(body.requests):
        if request.custom_id in seen:
            raise BadRequest(
                f"requests.{index}.custom_id: {request.custom_id!r} is used by "
                f"requests.{seen[request.custom_id]} too; each request needs its own custom_id.",
                param=f"requests.{index}.custom_id",
            )
        seen[request.custom_id] = index
        yield orjson.dumps(
            {
                "custom_id": request.custom_id,
                "method": "POST",
                "url": anthropic_messages.URL,
                "body": request.params,
            }
        )


def create(
    session: Session, blobs: BlobStore, settings: Settings, tenant_id: str, raw: bytes
) -> Batch:
    """Record a Message Batch from the create body ``raw`` (JSON bytes) and queue its
    validation. Raises ``BadRequest`` for a body that is not ``{requests: [{custom_id,
    params}]}`` with 1–100,000 requests, a malformed or repeated ``custom_id``, or two served
    models, and ``QuotaExceeded`` past the tenant's batches-in-progress or storage quota.
    Nothing is stored when it raises."""
    body = _parse(raw)
    model = _batch_model(body, dict(settings.models))
    batch_id = new_id("msgbatch_")
    file_id = new_id("file-")
    key = f"files/{file_id}"
    size = 0
    try:
        with blobs.writer(key) as out:
            for line in _request_lines(body):
                out.write(line + b"\n")
                size += len(line) + 1
    except BaseException:
        blobs.delete(key)
        raise
    created = now()
    try:
        quotas_service.admit_batch(session, settings, tenant_id)
        quotas_service.admit_upload(session, settings, tenant_id, size)
        files_repo.add(
            session,
            File(
                id=file_id,
                tenant_id=tenant_id,
                filename=f"{batch_id}_requests.jsonl",
                purpose="batch",
                bytes=size,
                status="processed",
                blob_key=key,
                created_at=created,
                expires_at=created + settings.file_expiry_days * 86_400,
                deleted=False,
            ),
        )
        batch = batches_repo.add(
            session,
            Batch(
                id=batch_id,
                tenant_id=tenant_id,
                endpoint=anthropic_messages.URL,
                # Set now, not by validation: every line runs on it (a line naming another
                # model fails alone there, ``Endpoint.refuses_file_for_body``).
                model=model,
                input_file_id=file_id,
                completion_window=WINDOW,
                status=BatchStatus.VALIDATING,
                created_at=created,
                window_seconds=WINDOW_SECONDS,
                expires_at=created + WINDOW_SECONDS,
                total=len(body.requests),
                requests_submitted=len(body.requests),
                completed=0,
                failed=0,
                input_tokens=0,
                cached_tokens=0,
                output_tokens=0,
            ),
        )
    except BaseException:
        blobs.delete(key)
        raise
    after_commit(session, partial(task_messages.send_validate, settings, batch.id), batch.id)
    return batch


def get(session: Session, tenant_id: str, batch_id: str) -> Batch:
    """Raises ``NotFound`` for an unknown, deleted or another tenant's Message Batch."""
    batch = repo.get(session, tenant_id, batch_id)
    if batch is None:
        raise NotFound(f"No message batch found with id '{batch_id}'.", param="message_batch_id")
    return batch


def page(
    session: Session,
    tenant_id: str,
    *,
    after_id: str | None,
    before_id: str | None,
    limit: int,
) -> tuple[list[Batch], bool]:
    """A page of Message Batches, newest first, and whether more follow. Raises
    ``BadRequest`` for a ``limit`` outside 1–1000 or both cursors at once."""
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise BadRequest(f"limit: must be between 1 and {MAX_LIST_LIMIT}", param="limit")
    if after_id is not None and before_id is not None:
        raise BadRequest("Only one of after_id and before_id may be given.", param="after_id")
    return repo.page(session, tenant_id, after_id=after_id, before_id=before_id, limit=limit)


#: Where the requests of a batch that ended without running them (no request rows: validation
#: refused the file, or the batch was cancelled or expired while it was being validated) go.
_UNRUN = {
    BatchStatus.FAILED: "errored",
    BatchStatus.CANCELLED: "canceled",
    BatchStatus.EXPIRED: "expired",
}


def counts(session: Session, batches: list[Batch]) -> dict[str, MessageBatchRequestCounts]:
    """``request_counts`` of each batch, Anthropic's way: every request ``processing`` until
    the batch has ended, then each by outcome. A completed batch's counters say it (its lines
    succeeded or errored); a cancelled or expired one's lines are counted by status, in one
    grouped count."""
    split = [b.id for b in batches if b.status in (BatchStatus.CANCELLED, BatchStatus.EXPIRED)]
    by_status = repo.line_statuses(session, split)
    out = {}
    for batch in batches:
        submitted = batch.requests_submitted or batch.total
        if batch.status not in BatchStatus.FINAL:
            out[batch.id] = MessageBatchRequestCounts(
                processing=submitted, succeeded=0, errored=0, canceled=0, expired=0
            )
            continue
        lines = by_status.get(
            batch.id, {LineStatus.SUCCEEDED: batch.completed, LineStatus.FAILED: batch.failed}
        )
        tally = {
            "succeeded": lines.get(LineStatus.SUCCEEDED, 0),
            "errored": lines.get(LineStatus.FAILED, 0),
            "canceled": lines.get(LineStatus.CANCELLED, 0),
            "expired": lines.get(LineStatus.EXPIRED, 0),
        }
        unrun = submitted - sum(tally.values())
        if unrun > 0:
            tally[_UNRUN.get(BatchStatus(batch.status), "errored")] += unrun
        out[batch.id] = MessageBatchRequestCounts(processing=0, **tally)
    return out


def cancel(session: Session, settings: Settings, tenant_id: str, batch_id: str) -> Batch:
    """Start cancelling: ``canceling`` until the requests a worker holds have stopped, then
    ``ended`` (requests that never ran are ``canceled``, finished ones keep their result).
    A batch already canceling or ended, or being finalized, is returned as it is."""
    get(session, tenant_id, batch_id)
    batch = batches_repo.get_for_update(session, batch_id, no_key=True, refresh=True)
    assert batch is not None
    if batch.status not in CANCELLABLE:
        return batch
    batch.status = BatchStatus.CANCELLING
    batch.cancelling_at = now()
    session.flush()
    send = partial(task_messages.send_finalize, settings, batch.id)
    after_commit(session, send, f"sending finalize {batch.id}")
    return batch


def delete(session: Session, blobs: BlobStore, tenant_id: str, batch_id: str) -> Batch:
    """Delete an ended Message Batch: its request lines, its input and results files (bytes
    too) go; the row stays, hidden, for its bill. Raises ``BadRequest`` for a batch still
    processing (Anthropic: cancel it first), ``NotFound`` for an unknown or deleted one."""
    get(session, tenant_id, batch_id)
    batch = batches_repo.get_for_update(session, batch_id, refresh=True)
    if batch is None or batch.deleted_at is not None:
        raise NotFound(f"No message batch found with id '{batch_id}'.", param="message_batch_id")
    if batch.status not in BatchStatus.FINAL:
        raise BadRequest(
            f"Message Batch {batch_id} cannot be deleted while it is still processing; "
            "cancel it first and delete it once it has ended.",
            param="message_batch_id",
        )
    repo.mark_deleted(session, batch, now())
    keys = []
    for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id):
        file = files_repo.get_any(session, file_id) if file_id else None
        if file is not None and not file.deleted:
            file.deleted = True
            keys.append(file.blob_key)
    session.flush()
    after_commit(session, partial(_delete_blobs, blobs, keys), f"deleting files of {batch_id}")
    return batch


def _delete_blobs(blobs: BlobStore, keys: list[str]) -> None:
    for key in keys:
        blobs.delete(key)


def results(session: Session, blobs: BlobStore, tenant_id: str, batch_id: str) -> Iterator[bytes]:
    """The results JSONL of an ended batch, in pieces: the file finalize wrote, or, for a
    batch that ended without running its requests, a line per request of its input (errored
    with the reason validation gave, canceled or expired). Raises ``BadRequest`` while the
    batch is processing, ``NotFound`` for an unknown one or results no longer stored."""
    batch = get(session, tenant_id, batch_id)
    if batch.status not in BatchStatus.FINAL:
        raise BadRequest(
            f"Message Batch {batch_id} has not ended yet; its results are available once "
            "processing_status is 'ended'.",
            param="message_batch_id",
        )
    if batch.output_file_id is not None:
        file = files_repo.get_any(session, batch.output_file_id)
        if file is None or file.deleted or not blobs.exists(file.blob_key):
            raise NotFound(f"The results of {batch_id} are no longer stored.")
        return blobs.iter_chunks(file.blob_key)
    return _unrun_results(session, blobs, batch)


def _unrun_results(session: Session, blobs: BlobStore, batch: Batch) -> Iterator[bytes]:
    file = files_repo.get_any(session, batch.input_file_id)
    if file is None or file.deleted or not blobs.exists(file.blob_key):
        return iter(())
    kind = _UNRUN.get(BatchStatus(batch.status), "errored")
    if kind == "errored":
        reason = (batch.errors or [{}])[0].get("message") or "The batch could not be run."
        result: dict[str, object] = {
            "type": "errored",
            "error": anthropic_messages.error_body(400, reason),
        }
    else:
        result = {"type": kind}
    key = file.blob_key

    def lines() -> Iterator[bytes]:
        with blobs.open(key) as stream:
            for raw in stream:
                if raw.strip():
                    custom_id = orjson.loads(raw)["custom_id"]
                    yield orjson.dumps({"custom_id": custom_id, "result": result}) + b"\n"

    return lines()
