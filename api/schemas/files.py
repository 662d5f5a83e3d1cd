"""Wire types of ``/v1/files``: OpenAI's File object, built from storage rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel

from api.schemas.common import column_values
from storage.models import File


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: str
    status_details: str | None = None

    @classmethod
    def of(cls, file: File) -> FileObject:
        return cls.model_validate(file_json(column_values(file)))


def file_json(file: Mapping[str, Any]) -> dict[str, Any]:
    """``FileObject`` as JSON-ready values, in its fields' order, from a file's column values
    by attribute name (a row's ``_asdict()``, or ``column_values`` of a ``File``): what the
    reads users poll send as they are (``api.responses.WireJSON``), without building the model.
    ``FileObject.of`` validates the same dict, so the two agree
    (``tests/unit/test_wire_json.py``)."""
    return {
        "id": file["id"],
        "object": "file",
        "bytes": file["bytes"],
        "created_at": file["created_at"],
        "expires_at": file["expires_at"],
        "filename": file["filename"],
        "purpose": file["purpose"],
        "status": file["status"],
        "status_details": None,
    }


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True
