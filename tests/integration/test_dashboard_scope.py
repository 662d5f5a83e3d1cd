"""A tenant's dashboard shows its own queue, tokens/s and chart, never another tenant's work on
the same model."""

from __future__ import annotations

from offpeak.settings import ModelConfig, Settings
from storage.db import session_scope
from tests.support.billing import AcctTenant, make, run

MODEL = "dashboard-scope-model"


def _model_row(settings: Settings, tenant: AcctTenant) -> dict:  # type: ignore[type-arg]
    from api.services import dashboard

    with session_scope(settings.resolved_database_url) as session:
        data = dashboard.data(session, settings, tenant.id, hours=1)
    rows = [m for m in data["models"] if m["model"] == MODEL]
    series = data["series"]["completion_tokens_per_second"].get(MODEL, [])
    row = rows[0] if rows else {"queued_requests": 0, "completion_tokens_per_second": 0.0}
    return {**row, "charted": sum(value for _t, value in series)}


def test_a_tenants_dashboard_shows_only_its_own_work(settings: Settings) -> None:
    settings = settings.model_copy(
        update={"models": {**settings.models, MODEL: ModelConfig(engine="instant")}}
    )
    busy, idle = AcctTenant(settings), AcctTenant(settings)
    make(settings, busy, 6, MODEL)
    queued = _model_row(settings, busy)
    assert queued["queued_requests"] == 6
    assert _model_row(settings, idle)["queued_requests"] == 0

    run(settings, MODEL)
    ran = _model_row(settings, busy)
    assert ran["completion_tokens_per_second"] > 0 and ran["charted"] > 0
    other = _model_row(settings, idle)
    assert other["completion_tokens_per_second"] == 0 and other["charted"] == 0
