"""What each tenant may use: the quota and rate-limit defaults (``Settings.limits``, from
``OFFPEAK_LIMITS__…``) and a tenant's own overrides (the ``tenants`` columns of the same names,
``None``: the default), resolved into one ``TenantLimits``.

Every limit is on out of the box, sized so that one tenant cannot take the host for itself
(docs/operations.md, "Default limits", says how each figure was chosen):

- enqueued tokens per tenant and model: a day (``enqueued_engine_seconds``) of one engine's
  measured output of that model, completion tokens per busy second of its engine chunks, the
  figure the scheduler's slack uses; before any is measured, ``expected_tokens_per_second``;
- batches in progress per tenant, batch creates per minute per tenant and requests per minute
  per key: fixed figures;
- stored bytes per tenant: none (the disk bounds it, not the engine).

``UNLIMITED`` (``-1``, written ``unlimited`` in the environment and in ``offpeak tenants set``)
turns a limit off, as a default or as one tenant's override. ``0`` is a limit too: it refuses
everything (a tenant frozen).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, Field

#: The limit names, as ``LimitSettings`` fields, ``TenantLimits`` fields and ``tenants`` columns.
LIMIT_NAMES = (
    "max_enqueued_tokens",
    "max_batches_in_progress",
    "max_file_bytes",
    "requests_per_minute",
    "batch_creates_per_minute",
)
#: The stored and configured value of a limit that is off.
UNLIMITED = -1
#: How ``UNLIMITED`` is written in the environment, the CLI and the views.
UNLIMITED_WORD = "unlimited"
#: Completion tokens of recent engine work needed before the measured rate is trusted (the
#: scheduler's threshold, ``workers.scheduler.slack.MEASURED_AFTER_TOKENS``).
MEASURED_AFTER_TOKENS = 2000


def _word(value: Any) -> Any:
    if isinstance(value, str) and value.strip().lower() == UNLIMITED_WORD:
        return UNLIMITED
    return value


#: A limit as configured: an integer >= 0, or ``-1`` / ``unlimited`` for none.
Limit = Annotated[int, BeforeValidator(_word), Field(ge=UNLIMITED)]


class LimitSettings(BaseModel):
    """The defaults for every tenant (``OFFPEAK_LIMITS__MAX_BATCHES_IN_PROGRESS=100``,
    ``OFFPEAK_LIMITS__REQUESTS_PER_MINUTE=unlimited`` …)."""

    max_enqueued_tokens: Limit | None = Field(
        default=None,
        description=(
            "Enqueued tokens per tenant and model: prompt + requested output "
            "(``max_tokens`` × ``n``, or the model's default) of the request lines not yet "
            "finished, OpenAI's batch queue limit. A batch that would pass it fails "
            "validation with ``token_limit_exceeded``. Unset: derived per model "
            "(``enqueued_tokens_default``)."
        ),
    )
    max_batches_in_progress: Limit = Field(
        default=50,
        description=(
            "Batches validating, in progress or finalizing at once per tenant; a create "
            "past it is answered 429 ``batch_limit_exceeded``. The scheduler splits a "
            "tenant's claims evenly between its batches, so more at once only slice its "
            "share thinner."
        ),
    )
    max_file_bytes: Limit = Field(
        default=UNLIMITED,
        description=(
            "Bytes of stored files per tenant (uploads, outputs and errors not deleted); an "
            "upload past it is answered 429 ``storage_limit_exceeded``. Not "
            "``Settings.max_file_bytes``, the size of one upload. Off by default (``-1``, "
            "``unlimited``): the disk bounds it, not the engine."
        ),
    )
    requests_per_minute: Limit = Field(
        default=600,
        description=(
            "API requests per minute per key (``/v1/…`` but the admin API); past it, 429 "
            "with ``Retry-After`` and OpenAI's ``x-ratelimit-*-requests`` headers. Ten "
            "clients polling a batch once a second (the OpenAI SDKs' ``poll_interval_ms`` "
            "default, 1000) fit. Counted in the broker's Redis, so one limit for every API "
            "process; with the embedded broker, or while Redis is unreachable, each API "
            "process keeps its own count (on one machine with ``OFFPEAK_API_WORKERS=N`` a "
            "key gets up to N times the limit)."
        ),
    )
    batch_creates_per_minute: Limit = Field(
        default=10,
        description=(
            "Batch creates (``POST /v1/batches`` and ``/v1/messages/batches``) per minute "
            "per tenant, all of its keys together; past it, 429 ``rate_limit_exceeded`` "
            "with ``Retry-After``, answered before the body is read."
        ),
    )
    enqueued_engine_seconds: float = Field(
        default=86_400.0,
        gt=0,
        description=(
            "Seconds of one engine's measured output of a model that a tenant may hold "
            "enqueued, when ``max_enqueued_tokens`` is derived: a day."
        ),
    )
    expected_tokens_per_second: float = Field(
        default=1000.0,
        gt=0,
        description=(
            "Completion tokens per second assumed for one engine of a model before any is "
            "measured (the derived ``max_enqueued_tokens`` until then): about one GPU "
            "serving a 7-8B model."
        ),
    )


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits in force (``None``: none); ``max_enqueued_tokens`` of one model."""

    max_enqueued_tokens: int | None = None
    max_batches_in_progress: int | None = None
    max_file_bytes: int | None = None
    requests_per_minute: int | None = None
    batch_creates_per_minute: int | None = None


def measured_tokens_per_second(completion_tokens: int, busy_seconds: float) -> float | None:
    """One engine's completion tokens per busy second over some engine chunks; ``None`` before
    ``MEASURED_AFTER_TOKENS`` tokens or any busy second."""
    if completion_tokens < MEASURED_AFTER_TOKENS or busy_seconds <= 0:
        return None
    return completion_tokens / busy_seconds


def enqueued_tokens_default(defaults: LimitSettings, tokens_per_second: float | None) -> int:
    """The derived enqueued-token limit of a model whose one engine was measured at
    ``tokens_per_second`` (``None``: not yet, ``expected_tokens_per_second``):
    ``⌈tokens/s × enqueued_engine_seconds⌉`` tokens."""
    rate = tokens_per_second if tokens_per_second else defaults.expected_tokens_per_second
    return math.ceil(rate * defaults.enqueued_engine_seconds)


def in_force(value: int | None) -> int | None:
    """A configured or stored limit as enforced: ``UNLIMITED`` (or below) is ``None``."""
    return None if value is None or value < 0 else value


def one(name: str, own: int | None, defaults: LimitSettings) -> int | None:
    """Limit ``name`` (not ``max_enqueued_tokens``) of a tenant whose override is ``own``."""
    return in_force(own if own is not None else getattr(defaults, name))


def enqueued_is_derived(overrides: Any, defaults: LimitSettings) -> bool:
    """Whether the tenant's enqueued-token limit is derived per model (no figure of its own
    and none in the settings)."""
    return getattr(overrides, "max_enqueued_tokens", None) is None and (
        defaults.max_enqueued_tokens is None
    )


def resolve(
    overrides: Any, defaults: LimitSettings, tokens_per_second: float | None = None
) -> TenantLimits:
    """The limits of a tenant whose overrides are ``overrides``'s attributes (a ``Tenant`` or
    any object with the ``LIMIT_NAMES``), each ``None`` falling back to ``defaults``; a derived
    ``max_enqueued_tokens`` is that of a model measured at ``tokens_per_second``."""
    values: dict[str, int | None] = {}
    for field in fields(TenantLimits):
        own = getattr(overrides, field.name, None)
        if field.name == "max_enqueued_tokens" and enqueued_is_derived(overrides, defaults):
            values[field.name] = enqueued_tokens_default(defaults, tokens_per_second)
        elif field.name == "max_enqueued_tokens":
            values[field.name] = in_force(own if own is not None else defaults.max_enqueued_tokens)
        else:
            values[field.name] = one(field.name, own, defaults)
    return TenantLimits(**values)
