"""Wire types of ``/v1/models``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "offpeak"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject] = Field(default_factory=list)
