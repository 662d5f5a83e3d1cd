"""A tenant's quotas at the API: the batches-in-progress check of a create, the stored-bytes
check of an upload, and the figures a tenant (``GET /v1/limits``) and an operator
(``api.services.tenants``) see.

Each check locks the tenant's row (``quotas_repo.lock_tenant``) in the request's transaction,
counts from the live rows and lets the create go on only under the limit, so two creates at once
cannot both pass a quota that admits one: the second waits for the first's commit and counts its
row. The enqueued-token quota is checked by validation (``workers.validation``), where the
batch's lines are first read, as OpenAI's is.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy.orm import Session

from api.errors import QuotaExceeded
from offpeak import tenant_limits
from offpeak.settings import Settings
from offpeak.tenant_limits import TenantLimits
from storage.db import Executor
from storage.models import Tenant
from storage.repositories import quotas as quotas_repo


def _locked_limits(session: Session, settings: Settings, tenant_id: str) -> TenantLimits:
    tenant = quotas_repo.lock_tenant(session, tenant_id)
    return tenant_limits.resolve(tenant, settings.limits)


def admit_batch(session: Session, settings: Settings, tenant_id: str) -> None:
    """Hold the tenant's row for the rest of the transaction and check one more batch fits
    its ``max_batches_in_progress``. Raises ``QuotaExceeded`` (429 ``batch_limit_exceeded``)."""
    limit = _locked_limits(session, settings, tenant_id).max_batches_in_progress
    if limit is None:
        return
    running = quotas_repo.batches_in_progress(session, tenant_id)
    if running >= limit:
        raise QuotaExceeded(
            f"Batch limit reached for this organization: {running} batches are validating, "
            f"in progress or finalizing; the limit is {limit} (max_batches_in_progress). Try "
            "again once one has ended, or cancel one.",
            code="batch_limit_exceeded",
        )


def admit_upload(session: Session, settings: Settings, tenant_id: str, size: int) -> None:
    """Hold the tenant's row for the rest of the transaction and check ``size`` more bytes fit
    its ``max_file_bytes``. Raises ``QuotaExceeded`` (429 ``storage_limit_exceeded``)."""
    limit = _locked_limits(session, settings, tenant_id).max_file_bytes
    if limit is None:
        return
    stored = quotas_repo.stored_bytes(session, tenant_id)
    if stored + size > limit:
        raise QuotaExceeded(
            f"Storage limit reached for this organization: {stored} bytes of files are stored "
            f"and this upload adds {size}; the limit is {limit} bytes (max_file_bytes). Delete "
            "files you no longer need and upload again.",
            param="file",
            code="storage_limit_exceeded",
        )


def model_rates(db: Executor, settings: Settings, models: Iterable[str]) -> dict[str, float | None]:
    """``model → one engine's measured completion tokens/s`` (``None``: not measured yet), over
    the scheduler's throughput window (``quotas_repo.engine_tokens_per_second``)."""
    since = time.time() - settings.scheduler.throughput_window_seconds
    return {model: quotas_repo.engine_tokens_per_second(db, model, since) for model in models}


def shown_models(settings: Settings, use: quotas_repo.TenantUse) -> set[str]:
    """The models whose enqueued-token limit a view shows: those configured and those the
    tenant holds tokens of."""
    return set(settings.models) | set(use.enqueued_tokens)


def figures(
    tenant: Any, settings: Settings, use: quotas_repo.TenantUse, rates: dict[str, float | None]
) -> dict[str, Any]:
    """A tenant's limits beside its use, as JSON-ready values (``None``: no limit).
    ``enqueued_tokens.limit_per_model`` is the figure every model shares (the tenant's or the
    setting's), ``None`` when derived per model or off; ``limit_by_model`` is the limit in
    force of each model of ``rates`` (its measured tokens/s)."""
    limits = tenant_limits.resolve(tenant, settings.limits)
    derived = tenant_limits.enqueued_is_derived(tenant, settings.limits)
    by_model = {
        model: tenant_limits.resolve(tenant, settings.limits, rate).max_enqueued_tokens
        for model, rate in sorted(rates.items())
    }
    return {
        "enqueued_tokens": {
            "limit_per_model": None if derived else limits.max_enqueued_tokens,
            "limit_by_model": by_model,
            "by_model": use.enqueued_tokens,
        },
        "batches_in_progress": {
            "limit": limits.max_batches_in_progress,
            "used": use.batches_in_progress,
        },
        "stored_bytes": {"limit": limits.max_file_bytes, "used": use.stored_bytes},
        "requests_per_minute": {"limit": limits.requests_per_minute},
        "batch_creates_per_minute": {"limit": limits.batch_creates_per_minute},
    }


def of_tenant(session: Session, settings: Settings, tenant_id: str) -> dict[str, Any]:
    """``figures`` of one tenant (``GET /v1/limits``)."""
    tenant = session.get(Tenant, tenant_id)
    use = quotas_repo.use_of(session, [tenant_id])[tenant_id]
    return figures(
        tenant, settings, use, model_rates(session, settings, shown_models(settings, use))
    )
