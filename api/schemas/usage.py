"""Wire types of ``GET /v1/usage``: sums of a tenant's bills."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel


class UsageBucket(BaseModel):
    """Billed usage of one group: a model, a UTC day (``day`` as YYYY-MM-DD, ``start_time`` its
    first unix second), a model's LoRA adapter, or everything. Amounts in US dollars."""

    object: Literal["usage.bucket"] = "usage.bucket"
    model: str | None = None
    #: Grouped by adapter: the LoRA adapter the lines named (``null``: the model's own lines).
    adapter: str | None = None
    day: str | None = None
    start_time: int | None = None
    batches: int
    requests: int
    input_tokens: int
    cached_tokens: int
    output_tokens: int
    total_tokens: int
    gpu_seconds: float
    cost: float
    price: float
    realtime_price: float
    saving: float
    #: ``cost`` per million ``total_tokens`` (``offpeak.billing.cost_per_million_tokens``, the
    #: dashboard's rule); ``None`` without tokens.
    cost_per_million_tokens: float | None = None


class UsageReport(BaseModel):
    """``GET /v1/usage``: the tenant's billed batches that ended in ``[start, end)``."""

    object: Literal["list"] = "list"
    start: int
    end: int
    group_by: str | None
    currency: Literal["usd"] = "usd"
    data: list[UsageBucket]
    total: UsageBucket
