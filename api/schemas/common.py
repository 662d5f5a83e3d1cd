"""Shapes every route shares: OpenAI's error body, a page of objects, a row's column values."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from sqlalchemy import inspect

from storage.models import Base


def column_values(row: Base) -> dict[str, Any]:
    """An ORM object's column values by attribute name, as a row of the same columns gives them
    (``Row._asdict()``)."""
    return {attr.key: getattr(row, attr.key) for attr in inspect(type(row)).column_attrs}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


# The API's one error body: a second model of this name would appear twice in the OpenAPI
# document, under module-qualified names.
class ErrorResponse(BaseModel):
    """Every error answer: OpenAI's ``{"error": {message, type, param, code}}``."""

    error: ErrorDetail


def list_json(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of objects (``BatchList``, ``FileList``) as JSON-ready values."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
