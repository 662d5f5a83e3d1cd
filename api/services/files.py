"""Files: streaming upload with UTF-8 and size checks, listing, content and deletion."""

from __future__ import annotations

import codecs
import hashlib
from collections.abc import Iterator
from typing import IO, Any

from sqlalchemy.orm import Session

from api.errors import BadRequest, NotFound, PayloadTooLarge, unknown_cursor
from api.schemas.files import file_json
from api.services import quotas as quotas_service
from offpeak.ids import new_id, now
from offpeak.settings import Settings
from storage.blobs import CHUNK_BYTES, BlobStore
from storage.db import Executor
from storage.models import File
from storage.repositories import files as files_repo

#: Purposes a client may upload with. Output and error files get ``batch_output``.
UPLOAD_PURPOSES = ("batch",)
DAY_SECONDS = 86_400
MAX_FILENAME = 512  # the column's width
#: OpenAI's bounds on ``expires_after[seconds]``: one hour to thirty days.
MIN_EXPIRY_SECONDS, MAX_EXPIRY_SECONDS = 3600, 30 * DAY_SECONDS


def _utf8_error_message(first_bytes: bytes, offset: int) -> str:
    hint = ""
    if first_bytes.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        hint = " It looks like UTF-16 (it starts with a UTF-16 byte-order mark)."
    elif b"\x00" in first_bytes[:64]:
        hint = " It contains NUL bytes, as UTF-16 or UTF-32 text does."
    return (
        f"The file is not valid UTF-8 (first bad byte at offset {offset}).{hint} "
        "Batch input files must be UTF-8 encoded JSONL; re-save the file as UTF-8."
    )


def upload(
    session: Session,
    blobs: BlobStore,
    settings: Settings,
    *,
    tenant_id: str,
    stream: IO[bytes],
    filename: str,
    purpose: str,
    expires_after_seconds: int | None,
) -> File:
    """Store an uploaded file, reading ``stream`` in 1 MiB pieces (never whole).

    Raises ``BadRequest`` (purpose, expiry, non-UTF-8 bytes), ``PayloadTooLarge`` (over
    ``settings.max_file_bytes``), ``QuotaExceeded`` (over the tenant's stored-bytes quota,
    ``api.services.quotas.admit_upload``), and what the row's insert raises (the database
    unavailable: the API's 503). Nothing is stored when it raises: the bytes are deleted again.

    One gap: when the request's commit fails after this returned (the database went away
    between the insert and the commit), the bytes stay under ``files/<id>`` with no row: never
    listed, served, billed nor swept. They are kept because a commit cut off mid-way may still
    have committed, and deleting them would leave a listed file without its bytes.
    """
    if purpose not in UPLOAD_PURPOSES:
        raise BadRequest(
            f"Invalid purpose {purpose!r}: this server accepts {', '.join(UPLOAD_PURPOSES)}.",
            param="purpose",
        )
    if len(filename) > MAX_FILENAME:
        raise BadRequest(f"The filename is longer than {MAX_FILENAME} characters.", param="file")
    expires_in = settings.file_expiry_days * DAY_SECONDS
    if expires_after_seconds is not None:
        if not MIN_EXPIRY_SECONDS <= expires_after_seconds <= MAX_EXPIRY_SECONDS:
            raise BadRequest(
                "expires_after[seconds] must be between 3600 (1 hour) and 2592000 (30 days).",
                param="expires_after.seconds",
            )
        expires_in = expires_after_seconds
    file_id = new_id("file-")
    key = f"files/{file_id}"
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    size = 0
    head = b""
    with blobs.writer(key) as out:
        while chunk := stream.read(CHUNK_BYTES):
            if not head:
                head = chunk[:64]
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as exc:
                raise BadRequest(
                    _utf8_error_message(head, size + exc.start),
                    param="file",
                    code="invalid_file_encoding",
                ) from None
            size += len(chunk)
            if size > settings.max_file_bytes:
                raise PayloadTooLarge(
                    f"The file is larger than the limit of {settings.max_file_bytes} bytes.",
                    param="file",
                )
            out.write(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise BadRequest(
                _utf8_error_message(head, size), param="file", code="invalid_file_encoding"
            ) from None
    created = now()
    file = File(
        id=file_id,
        tenant_id=tenant_id,
        filename=filename,
        purpose=purpose,
        bytes=size,
        status="processed",
        blob_key=key,
        created_at=created,
        expires_at=created + expires_in,
        deleted=False,
    )
    try:
        quotas_service.admit_upload(session, settings, tenant_id, size)
        return files_repo.add(session, file)
    except BaseException:
        blobs.delete(key)
        raise


def upload_fingerprint(
    stream: IO[bytes],
    filename: str,
    purpose: str,
    expires_after_anchor: str | None,
    expires_after_seconds: int | None,
) -> dict[str, object]:
    """What identifies an upload for ``Idempotency-Key``: its form fields and the SHA-256 of
    the file's bytes (not the raw multipart body, whose boundary a retrying client draws
    anew). Reads ``stream`` in 1 MiB pieces and rewinds it."""
    digest = hashlib.sha256()
    while chunk := stream.read(CHUNK_BYTES):
        digest.update(chunk)
    stream.seek(0)
    return {
        "filename": filename,
        "purpose": purpose,
        "expires_after": [expires_after_anchor, expires_after_seconds],
        "sha256": digest.hexdigest(),
    }


def get(session: Session, tenant_id: str, file_id: str) -> File:
    """Raises ``NotFound`` for an unknown, deleted or another tenant's file."""
    file = files_repo.get(session, tenant_id, file_id)
    if file is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return file


def retrieve(db: Executor, tenant_id: str, file_id: str) -> dict[str, Any]:
    """The File object, as JSON-ready values (``api.schemas.files.file_json``), from a row of its
    columns: a read users poll. Raises ``NotFound`` as ``get`` does."""
    row = files_repo.poll_row(db, tenant_id, file_id)
    if row is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return file_json(row)


#: Pieces of a file ``content`` reads before it answers: a file up to ``CHUNK_BYTES`` long is
#: then all read (the second read finds its end).
READ_AHEAD = 2


def content(
    db: Executor, blobs: BlobStore, tenant_id: str, file_id: str
) -> tuple[list[bytes], Iterator[bytes] | None]:
    """The file's bytes: its first pieces, read here (up to ``READ_AHEAD`` of ``CHUNK_BYTES``),
    and an iterator over the rest, ``None`` when they were all of it (an output file of up to
    1 MiB: most of the downloads that end a poll). The caller reads the rest as it sends it.

    Raises ``NotFound`` as ``get`` does, and when the file's bytes are no longer stored."""
    row = files_repo.poll_row(db, tenant_id, file_id)
    if row is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    chunks = blobs.iter_chunks(row["blob_key"])
    head: list[bytes] = []
    try:
        for _ in range(READ_AHEAD):
            chunk = next(chunks, None)
            if chunk is None:
                return head, None
            head.append(chunk)
    except FileNotFoundError:
        raise NotFound(f"The content of {file_id} is no longer stored.", param="file_id") from None
    return head, chunks


def delete(session: Session, blobs: BlobStore, tenant_id: str, file_id: str) -> None:
    """Delete the file's metadata (soft) and bytes; request rows already taken from it stay."""
    file = get(session, tenant_id, file_id)
    session.refresh(file, with_for_update=True)  # concurrent deletes: exactly one succeeds
    if file.deleted:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    file.deleted = True
    session.flush()
    blobs.delete(file.blob_key)


def page(
    session: Session,
    tenant_id: str,
    *,
    purpose: str | None,
    after: str | None,
    limit: int,
    order: str,
) -> tuple[list[File], bool]:
    """A page of files and whether more follow. Raises ``BadRequest`` for a bad limit/order and
    an unknown ``after`` (``api.errors.unknown_cursor``)."""
    if not 1 <= limit <= 10_000:
        raise BadRequest("limit must be between 1 and 10000.", param="limit")
    if order not in ("asc", "desc"):
        raise BadRequest("order must be 'asc' or 'desc'.", param="order")
    # A deleted file still marks a place in the list; an id that was never the tenant's does not.
    if after and files_repo.get_any_of_tenant(session, tenant_id, after) is None:
        raise unknown_cursor("file", after)
    rows = list(
        files_repo.page(
            session,
            tenant_id,
            purpose=purpose,
            after=after,
            limit=limit,
            descending=order == "desc",
        )
    )
    return rows[:limit], len(rows) > limit
