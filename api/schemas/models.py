"""Wire types of ``/v1/models``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "offpeak"
    #: A LoRA adapter's base model (vLLM's ``/v1/models`` field); ``None`` for a base model.
    parent: str | None = None
    #: The model's own name (vLLM's field, where an adapter's is its path).
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject] = Field(default_factory=list)
