"""Batches: create, read, list and cancel. Validation and running happen in workers; this
module only records intent and sends the task once the transaction has committed."""

from __future__ import annotations

from functools import partial
from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from api.errors import BadRequest, Conflict, NotFound, unknown_cursor
from api.schemas.batches import CreateBatch, batch_json
from api.services import batch_eta
from api.services import billing as billing_service
from api.services import files as files_service
from api.services import quotas as quotas_service
from offpeak import endpoints
from offpeak.endpoints import anthropic_messages
from offpeak.failure_limit import FailureLimit
from offpeak.ids import new_id, now
from offpeak.settings import Settings, window_seconds
from offpeak.statuses import BatchStatus
from storage import task_messages
from storage.db import Executor, after_commit
from storage.models import Batch
from storage.repositories import batches as batches_repo
from storage.repositories import files as files_repo

# OpenAI's metadata limits (API reference, "metadata"): 16 pairs, keys ≤ 64, values ≤ 512 chars.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
CANCELLABLE = (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)


def _check_metadata(metadata: dict[str, Any] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA_PAIRS:
        raise BadRequest(f"metadata may hold at most {MAX_METADATA_PAIRS} pairs.", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise BadRequest(
                f"metadata keys may be at most {MAX_METADATA_KEY} characters.", param="metadata"
            )
        if not isinstance(value, str):
            raise BadRequest(f"metadata value for {key!r} must be a string.", param="metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise BadRequest(
                f"metadata values may be at most {MAX_METADATA_VALUE} characters.", param="metadata"
            )
    return dict(metadata)


def _output_expiry_seconds(policy: dict[str, Any] | None) -> int | None:
    """``output_expires_after`` → seconds after their creation the output and error files
    expire (OpenAI's shape ``{"anchor": "created_at", "seconds": 3600…2592000}``)."""
    if policy is None:
        return None
    if policy.get("anchor") != "created_at":
        raise BadRequest(
            "output_expires_after.anchor must be 'created_at'.", param="output_expires_after.anchor"
        )
    seconds = policy.get("seconds")
    low, high = files_service.MIN_EXPIRY_SECONDS, files_service.MAX_EXPIRY_SECONDS
    if isinstance(seconds, bool) or not isinstance(seconds, int) or not low <= seconds <= high:
        raise BadRequest(
            f"output_expires_after.seconds must be an integer between {low} (1 hour) and "
            f"{high} (30 days).",
            param="output_expires_after.seconds",
        )
    return seconds


def _failure_limit(settings: Settings, request: CreateBatch) -> dict[str, Any] | None:
    """The batch's breaker as stored: the create's ``failure_limit`` (``null``: none), or the
    server's setting when the create left it out. Raises ``BadRequest`` naming the field."""
    if "failure_limit" not in request.model_fields_set:
        limit = settings.failure_limit
        return None if limit is None else limit.model_dump()
    if request.failure_limit is None:
        return None
    try:
        return FailureLimit.model_validate(request.failure_limit).model_dump()
    except ValidationError as invalid:
        error = invalid.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise BadRequest(
            'Invalid failure_limit: expected {"fraction": a number between 0 and 1, '
            f'"after_lines": a whole number from 1}} ({where}: {error["msg"]}).',
            param="failure_limit" + (f".{where}" if where else ""),
        ) from None


def _refuse_endpoint(endpoint: str) -> None:
    """The 400 of a batch ``endpoint`` not served here: one code (``invalid_value``) for every
    such url, whether OpenAI's Batch API accepts it (``/v1/moderations``, images, videos) or
    not, so a client handles them alike; the message names the served values."""
    served = ", ".join(endpoints.BATCH_ENDPOINTS)
    known = endpoint in endpoints.UNSERVED_BATCH_ENDPOINTS
    raise BadRequest(
        f"Invalid 'endpoint': {endpoint!r} is "
        + ("an OpenAI batch endpoint this server does not serve" if known else "not supported")
        + f"; supported values are {served}.",
        param="endpoint",
        code="invalid_value",
    )


def create(session: Session, settings: Settings, tenant_id: str, request: CreateBatch) -> Batch:
    """Record a batch in ``validating`` and queue its validation.

    Raises ``BadRequest`` (endpoint, window, metadata, the input file's purpose) and
    ``QuotaExceeded`` (``max_batches_in_progress``); an unknown input file fails validation.
    """
    target = endpoints.ENDPOINTS.get(request.endpoint)
    # Anthropic's /v1/messages lines come only through the Message Batches API.
    if target is None or target.surface != "openai":
        _refuse_endpoint(request.endpoint)
    if request.completion_window not in settings.allowed_completion_windows:
        raise BadRequest(
            f"Invalid completion_window {request.completion_window!r}: allowed values are "
            f"{', '.join(settings.allowed_completion_windows)}.",
            param="completion_window",
        )
    # Parsed here once: the row keeps the seconds, which the deadline guard and billing read.
    window = window_seconds(request.completion_window)
    metadata = _check_metadata(request.metadata)
    output_expires_after = _output_expiry_seconds(request.output_expires_after)
    failure_limit = _failure_limit(settings, request)
    # An unknown input file is no 404: as at OpenAI the batch is created and its validation
    # fails it, naming the file (``workers.validation``).
    file = files_repo.get(session, tenant_id, request.input_file_id)
    if file is not None and file.purpose != "batch":
        raise BadRequest(
            f"File {file.id} has purpose {file.purpose!r}; a batch needs a file "
            "uploaded with purpose 'batch'.",
            param="input_file_id",
        )
    quotas_service.admit_batch(session, settings, tenant_id)
    created = now()
    batch = batches_repo.add(
        session,
        Batch(
            id=new_id("batch_"),
            tenant_id=tenant_id,
            endpoint=request.endpoint,
            input_file_id=request.input_file_id,
            completion_window=request.completion_window,
            status=BatchStatus.VALIDATING,
            metadata_=metadata,
            created_at=created,
            window_seconds=window,
            expires_at=created + window,
            total=0,
            completed=0,
            failed=0,
            input_tokens=0,
            cached_tokens=0,
            output_tokens=0,
            output_expires_after=output_expires_after,
            failure_limit=failure_limit,
        ),
    )
    send = partial(task_messages.send_validate, settings, batch.id)
    after_commit(session, send, f"sending validate {batch.id}")
    return batch


def _not_found(batch_id: str) -> NotFound:
    # OpenAI's recorded wording, which clients and peer test suites match on.
    return NotFound(f"No batch found with id '{batch_id}'.", param="batch_id")


def get(session: Session, tenant_id: str, batch_id: str) -> Batch:
    """Raises ``NotFound`` for an unknown or another tenant's batch."""
    batch = batches_repo.get(session, tenant_id, batch_id)
    # A Message Batch (Anthropic's surface, ``api.services.message_batches``) is not one here.
    if batch is None or batch.endpoint == anthropic_messages.URL:
        raise _not_found(batch_id)
    return batch


def poll(db: Executor, settings: Settings, tenant_id: str, batch_id: str) -> dict[str, Any]:
    """The Batch object a retrieve answers, as JSON-ready values
    (``api.schemas.batches.batch_json``): one statement once the batch is billed, two before (the
    engine time attributed so far).
    Read-only, rows rather than ORM objects: a status poll.

    Raises ``NotFound`` for an unknown or another tenant's batch."""
    row = batches_repo.poll_row(db, tenant_id, batch_id)
    if row is None or row["endpoint"] == anthropic_messages.URL:
        raise _not_found(batch_id)
    values = batch_json(row, billing_service.bills_of_rows(db, settings, [row])[batch_id])
    batch_eta.apply(db, settings, [values])
    return values


def page(
    db: Executor, settings: Settings, tenant_id: str, *, after: str | None, limit: int
) -> tuple[list[dict[str, Any]], bool]:
    """A page of Batch objects (``poll``'s), newest first, and whether more follow; one
    statement when they are all billed (and ``after`` is not given). Read-only.

    Raises ``BadRequest`` for a bad ``limit`` and an ``after`` that names none of the tenant's
    batches (``unknown_cursor``)."""
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be between 1 and 100.", param="limit")
    if after and not batches_repo.is_of_tenant(db, tenant_id, after):
        raise unknown_cursor("batch", after)
    rows = batches_repo.poll_page(
        db, tenant_id, after=after, limit=limit, exclude_endpoint=anthropic_messages.URL
    )
    shown = rows[:limit]
    bills = billing_service.bills_of_rows(db, settings, shown)
    batches = [batch_json(values, bills[values["id"]]) for values in shown]
    batch_eta.apply(db, settings, batches)
    return batches, len(rows) > limit


def cancel(session: Session, settings: Settings, tenant_id: str, batch_id: str) -> Batch:
    """Move a running batch to ``cancelling``; a control worker ends it as ``cancelled``.

    Idempotent for a batch already cancelling (a retried cancel answers the batch again).
    Raises ``Conflict`` (409) for a batch that has finished, ``cancelled`` included, or is
    finalizing (the contract, ``batch-api.md``: "a finished batch answers 409"), ``NotFound``
    for an unknown id.

    Answers at once while the batch is being validated: the row lock taken here does not wait
    for validation's ``COPY`` (``no_key``), and validation, seeing ``cancelling`` when it ends,
    drops its rows instead of starting the batch.
    """
    get(session, tenant_id, batch_id)
    batch = batches_repo.get_for_update(session, batch_id, no_key=True, refresh=True)
    assert batch is not None
    if batch.status == BatchStatus.CANCELLING:
        return batch
    if batch.status not in CANCELLABLE:
        raise Conflict(f"Cannot cancel a batch with status {batch.status!r}.", param="batch_id")
    batch.status = BatchStatus.CANCELLING
    batch.cancelling_at = now()
    session.flush()
    send = partial(task_messages.send_finalize, settings, batch.id)
    after_commit(session, send, f"sending finalize {batch.id}")
    return batch
