"""A tenant's dashboard shows its own queue, tokens/s and chart, never another tenant's work on
the same model; no route a tenant's key opens shows another tenant's rates, lines or queue
lengths (the admin key's dashboard shows the fleet)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

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


#: Figures of work in progress or done: in a tenant's view each must be its own batches'.
RATES = ("per_second", "busy", "engine_seconds", "queued", "running", "tokens", "requests")


def _figures(value: object, path: str = "") -> Iterator[tuple[str, object]]:
    """Every ``(path, number)`` leaf of a JSON answer."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _figures(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _figures(item, f"{path}[{i}]")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path, value


def test_another_tenants_work_shows_on_no_route_a_tenant_can_read(settings: Settings) -> None:
    """Tenant A's finished and queued work, read through every route tenant B's key opens:
    none of A's rates, engine time, lines or queue lengths, only the count of A's lines ahead
    of B's once B queues its own."""
    model = f"tenant-scope-{uuid.uuid4().hex[:8]}"  # no other run's lines on it
    settings = settings.model_copy(
        update={
            "models": {**settings.models, model: ModelConfig(engine="instant")},
            "metrics_token": "scrape-scope-test",
            "admin_api_key": "admin-scope-test",
        }
    )
    a, b = AcctTenant(settings), AcctTenant(settings)
    ran = make(settings, a, 12, model, "a")
    run(settings, model)
    waiting = make(settings, a, 8, model, "w")
    own = a.http.get("/v1/dashboard?hours=1", headers=a.headers).json()
    mine = next(m for m in own["models"] if m["model"] == model)
    assert mine["queued_requests"] == 8 and mine["prompt_tokens_per_second"] > 0
    assert mine["engine_seconds"] > 0 and "busy_ratio" not in mine

    headers = {**b.headers, "x-api-key": b.key, "anthropic-version": "2023-06-01"}
    answers = {
        route: b.http.get(route, headers=headers)
        for route in ("/v1/dashboard?hours=1", "/v1/queue", "/v1/limits", "/v1/usage",
                      "/v1/models", "/v1/batches", "/v1/files", "/v1/messages/batches",
                      "/v1/webhook_endpoints", "/healthz")
    }  # fmt: skip
    for route, answer in answers.items():
        assert answer.status_code == 200, (route, answer.text)
        for secret in (a.id, a.name, ran, waiting):
            assert secret not in answer.text, (route, secret)
        moved = [
            (path, n)
            for path, n in _figures(answer.json())
            if n and any(word in path.rsplit(".", 1)[-1] for word in RATES)
        ]
        assert not moved, (route, moved)
    board = answers["/v1/dashboard?hours=1"].json()
    assert [m for m in board["models"] if m["model"] == model] == []
    assert model not in board["series"]["completion_tokens_per_second"]
    assert answers["/v1/queue"].json()["queue"] == []
    # The fleet's Prometheus series are the operator's: a tenant's key does not open them.
    assert b.http.get("/metrics", headers=b.headers).status_code == 401
    scrape = b.http.get("/metrics", headers={"Authorization": "Bearer scrape-scope-test"})
    assert scrape.status_code == 200 and f'model="{model}"' in scrape.text

    # B's own lines: the lines of A's that run first is all it learns of A's queue.
    make(settings, b, 3, model, "b")
    queue = b.http.get("/v1/queue", headers=b.headers).json()["queue"]
    assert queue == [
        {"model": model, "queued_lines": 3, "lines_ahead": 3,
         "urgent_lines_ahead": 0, "shared_lines_ahead": 3},
    ]  # fmt: skip
    board = b.http.get("/v1/dashboard?hours=1", headers=b.headers).json()
    row = next(m for m in board["models"] if m["model"] == model)
    assert row["queued_requests"] == 3 and row["running_requests"] == 0
    assert row["prompt_tokens_per_second"] == 0 and row["engine_seconds"] == 0
    assert row["cost_per_million_tokens"] in (None, 0)

    # The operator sees the fleet: every tenant's lines and the engines' busy fraction.
    fleet = b.http.get("/v1/dashboard", headers={"Authorization": "Bearer admin-scope-test"})
    row = next(m for m in fleet.json()["models"] if m["model"] == model)
    assert row["queued_requests"] == 8 + 3 and row["busy_ratio"] > 0
