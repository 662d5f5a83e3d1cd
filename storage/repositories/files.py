"""File metadata (the bytes live in the blob store)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, bindparam, or_, select
from sqlalchemy.orm import Session

from offpeak.ids import now
from storage.db import Executor, PollQuery
from storage.models import File


def add(session: Session, file: File) -> File:
    session.add(file)
    session.flush()
    return file


def _unexpired(at: int) -> ColumnElement[bool]:
    """Not past ``expires_at``: an expired file is gone for its tenant at once, before the
    retention sweep deletes its bytes and row."""
    return or_(File.expires_at.is_(None), File.expires_at > at)


def get(session: Session, tenant_id: str, file_id: str) -> File | None:
    """A live file of this tenant; another tenant's, a deleted or an expired file is ``None``."""
    return session.scalar(
        select(File).where(
            File.id == file_id,
            File.tenant_id == tenant_id,
            File.deleted.is_(False),
            _unexpired(now()),
        )
    )


#: A live file's columns a status poll shows (``api.schemas.files.file_json``) and its ``blob_key``,
#: built once with bound parameters (``poll_row``).
_POLL_ONE = PollQuery(select(
    File.id, File.bytes, File.created_at, File.expires_at, File.filename, File.purpose,
    File.status, File.blob_key,
).where(
    File.id == bindparam("file_id"),
    File.tenant_id == bindparam("tenant_id"),
    File.deleted.is_(False),
    _unexpired(bindparam("at")),  # type: ignore[arg-type]
))  # fmt: skip


def poll_row(db: Executor, tenant_id: str, file_id: str) -> dict[str, Any] | None:
    """``get``'s file as ``_POLL_ONE``'s columns by key (no ORM object), for the reads users
    poll; ``None`` for another tenant's, a deleted or an expired file."""
    return _POLL_ONE.first(db, {"file_id": file_id, "tenant_id": tenant_id, "at": now()})


def live_by_blob_key(session: Session, blob_key: str) -> File | None:
    """The live (not deleted) file stored under ``blob_key``; there is at most one (a unique
    index), so a re-run finalize finds and reuses its output and error files."""
    return session.scalar(select(File).where(File.blob_key == blob_key, File.deleted.is_(False)))


def get_any_of_tenant(session: Session, tenant_id: str, file_id: str) -> File | None:
    """This tenant's file by id, deleted or not (a list cursor may name a deleted file)."""
    return session.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id))


def get_any(session: Session, file_id: str) -> File | None:
    """A file by id, whatever its tenant (workers only)."""
    return session.get(File, file_id)


def page(
    session: Session,
    tenant_id: str,
    *,
    purpose: str | None,
    after: str | None,
    limit: int,
    descending: bool,
) -> Sequence[File]:
    """Up to ``limit + 1`` files after the cursor ``after`` (ids sort by creation time), so the
    caller can tell whether there are more."""
    query = select(File).where(
        File.tenant_id == tenant_id, File.deleted.is_(False), _unexpired(now())
    )
    if purpose:
        query = query.where(File.purpose == purpose)
    if after:
        query = query.where(File.id < after if descending else File.id > after)
    query = query.order_by(File.id.desc() if descending else File.id.asc()).limit(limit + 1)
    return session.scalars(query).all()
