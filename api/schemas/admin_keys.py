"""Wire types of ``/v1/admin/keys``: API keys managed over HTTP with the admin key."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CreateKey(BaseModel):
    model_config = ConfigDict(strict=True)

    #: The tenant's name (created if new).
    tenant: str = Field(min_length=1, max_length=200)
    #: A label for the key.
    name: str | None = Field(default=None, max_length=200)


class AdminKey(BaseModel):
    """A key as an operator sees it: never the key itself (only its hash is kept), except
    ``key`` in the answer that created it."""

    object: Literal["admin.api_key"] = "admin.api_key"
    id: str
    tenant: str
    name: str | None
    #: The key's first characters.
    prefix: str
    created_at: int
    revoked_at: int | None
    #: The key in plain text: in the creating answer only, once.
    key: str | None = None


class AdminKeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdminKey]
