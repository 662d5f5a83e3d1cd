"""Wire types of ``/v1/admin/adapters``: LoRA adapters registered on a running service."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AddAdapter(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    #: The name lines give as their ``model`` (vLLM's ``--lora-modules`` name).
    name: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/@-]*$")
    #: The served model it was trained on.
    base_model: str = Field(min_length=1, max_length=200)
    #: A PEFT adapter folder on the engine workers' hosts, or ``blob:<prefix>`` in the file store.
    path: str = Field(min_length=1, max_length=4096)


class AdapterView(BaseModel):
    object: Literal["adapter"] = "adapter"
    name: str
    base_model: str
    path: str
    #: ``config`` (``lora_modules``: removed by editing the configuration) or ``registered``.
    source: Literal["config", "registered"]
    created_at: int


class AdapterList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdapterView]


class AdapterDeleted(BaseModel):
    object: Literal["adapter.deleted"] = "adapter.deleted"
    name: str
    deleted: bool = True
