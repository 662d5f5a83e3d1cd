"""What each tenant may use: the quota and rate-limit defaults (``Settings.limits``, from
``OFFPEAK_LIMITS__…``) and a tenant's own overrides (the ``tenants`` columns of the same names,
``None``: the default), resolved into one ``TenantLimits``.

Every default is ``None``, no limit: a fresh install serves one team, whose batches, files and
polls nothing should refuse until an operator shares the service and sets the figures that fit
its hardware (a CPU host and a GPU host differ a hundredfold in tokens per hour, so no single
number would be right for both). ``0`` is a limit too: it refuses everything (a tenant frozen).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pydantic import BaseModel, Field

#: The limit names, as ``LimitSettings`` fields, ``TenantLimits`` fields and ``tenants`` columns.
LIMIT_NAMES = (
    "max_enqueued_tokens",
    "max_batches_in_progress",
    "max_file_bytes",
    "requests_per_minute",
)


class LimitSettings(BaseModel):
    """The defaults for every tenant (``OFFPEAK_LIMITS__MAX_ENQUEUED_TOKENS=2000000`` …)."""

    #: Enqueued tokens per tenant and model: prompt + requested output (``max_tokens`` × ``n``,
    #: or the model's default) of the request lines not yet finished, OpenAI's batch queue
    #: limit. A batch that would pass it fails validation with ``token_limit_exceeded``.
    max_enqueued_tokens: int | None = Field(default=None, ge=0)
    #: Batches validating, in progress or finalizing at once per tenant; a create past it is
    #: answered 429 ``batch_limit_exceeded``.
    max_batches_in_progress: int | None = Field(default=None, ge=0)
    #: Bytes of stored files per tenant (uploads, outputs and errors not deleted); an upload
    #: past it is answered 429 ``storage_limit_exceeded``. Not ``Settings.max_file_bytes``,
    #: the size of one upload.
    max_file_bytes: int | None = Field(default=None, ge=0)
    #: API requests per minute per key (``/v1/…`` but the admin API); past it, 429 with
    #: ``Retry-After`` and OpenAI's ``x-ratelimit-*-requests`` headers.
    requests_per_minute: int | None = Field(default=None, ge=0)


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits in force (``None``: none)."""

    max_enqueued_tokens: int | None = None
    max_batches_in_progress: int | None = None
    max_file_bytes: int | None = None
    requests_per_minute: int | None = None


def resolve(overrides: Any, defaults: LimitSettings) -> TenantLimits:
    """The limits of a tenant whose overrides are ``overrides``'s attributes (a ``Tenant`` or
    any object with the ``LIMIT_NAMES``), each ``None`` falling back to ``defaults``."""
    values = {}
    for field in fields(TenantLimits):
        own = getattr(overrides, field.name, None)
        values[field.name] = own if own is not None else getattr(defaults, field.name)
    return TenantLimits(**values)
