"""Per-tenant views on real PostgreSQL (a database of their own, so the engine shares count only
these tenants): queue positions under the fair-share rule, engine share against the share the
weights entitle, the operator's table, and that a tenant never sees another tenant."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from rich.console import Console
from sqlalchemy import update
from typer.testing import CliRunner

import offpeak.cli as cli
from offpeak.cli import client as client_tools
from offpeak.settings import ModelConfig, Settings, get_settings
from storage.db import session_scope
from storage.models import Batch, Tenant
from tests.support.billing import AcctTenant, make, run
from tests.support.database import fresh_database

MODEL = "views-model"
ADMIN_KEY = "admin-views-test"


@pytest.fixture(scope="module")
def own_settings(settings: Settings, run_id: str) -> Iterator[Settings]:
    with fresh_database(f"offpeak_views_{run_id}") as url:
        yield settings.model_copy(
            update={
                "database_url": url,
                "admin_api_key": ADMIN_KEY,
                "models": {**settings.models, MODEL: ModelConfig(engine="instant")},
            }
        )


def _weigh(settings: Settings, tenant: AcctTenant, weight: float) -> None:
    with session_scope(settings.resolved_database_url) as session:
        session.execute(update(Tenant).where(Tenant.id == tenant.id).values(weight=weight))


def _make_urgent(settings: Settings, batch_id: str) -> None:
    """No slack left: the deadline guard's rule makes the batch urgent."""
    with session_scope(settings.resolved_database_url) as session:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(estimated_completion_at=Batch.expires_at)
        )


def test_queue_positions_shares_and_what_each_side_sees(
    own_settings: Settings, base_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = own_settings
    big, small, heavy = AcctTenant(settings), AcctTenant(settings), AcctTenant(settings)
    _weigh(settings, heavy, 2.0)
    big_batches = [make(settings, big, 30, MODEL, "b"), make(settings, big, 4, MODEL, "u")]
    small_batch = make(settings, small, 5, MODEL, "s")
    heavy_batch = make(settings, heavy, 10, MODEL, "h")
    _make_urgent(settings, big_batches[1])

    queues = {}
    for tenant in (big, small, heavy):
        answer = tenant.http.get("/v1/queue", headers=tenant.headers)
        assert answer.status_code == 200, answer.text
        queues[tenant.name] = answer.json()
    # Shared lines: q_T of T's, while U is served min(q_U, q_T × w_U / w_T); urgent first.
    assert queues[big.name]["queue"] == [
        {"model": MODEL, "queued_lines": 34, "lines_ahead": 15,
         "urgent_lines_ahead": 0, "shared_lines_ahead": 5 + 10},
    ]  # fmt: skip
    assert queues[small.name]["queue"] == [
        {"model": MODEL, "queued_lines": 5, "lines_ahead": 19,
         "urgent_lines_ahead": 4, "shared_lines_ahead": 5 + 10},
    ]  # fmt: skip
    assert queues[heavy.name]["queue"] == [
        {"model": MODEL, "queued_lines": 10, "lines_ahead": 14,
         "urgent_lines_ahead": 4, "shared_lines_ahead": 5 + 5},
    ]  # fmt: skip
    assert queues[small.name]["share"]["engine_share"] is None  # nothing served yet
    assert queues[small.name]["share"]["entitled_share"] == pytest.approx(1 / 4)
    assert queues[heavy.name]["share"]["entitled_share"] == pytest.approx(2 / 4)

    # A tenant sees counts only: no other tenant's name, id or batch.
    board = small.http.get("/v1/dashboard?hours=1", headers=small.headers)
    assert board.status_code == 200, board.text
    assert board.json()["tenant"]["queue"] == queues[small.name]["queue"]
    assert board.json()["tenant"]["limits"]["batches_in_progress"]["used"] == 1
    others = [big.name, big.id, heavy.name, heavy.id, *big_batches, heavy_batch]
    for text in (board.text, str(queues[small.name])):
        assert not [secret for secret in others if secret in text]
    assert small_batch in board.text

    # The operator sees every tenant's figures, on the dashboard and in `offpeak tenants list`.
    admin = small.http.get("/v1/dashboard", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200, admin.text
    rows = {t["name"]: t for t in admin.json()["tenants"]}
    assert rows[small.name]["queue"][0]["lines_ahead"] == 19
    assert rows[heavy.name]["share"]["entitled_share"] == pytest.approx(0.5)
    assert "batches" not in admin.json()

    env = {**base_env, "OFFPEAK_DATABASE_URL": settings.resolved_database_url, "COLUMNS": "250"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    try:
        listed = CliRunner().invoke(cli.app, ["tenants", "list"])
    finally:
        get_settings.cache_clear()
    assert listed.exit_code == 0, listed.output
    line = next(row for row in listed.output.splitlines() if small.name in row).split()
    # name, id, weight, queued, ahead, share, entitled, ...
    assert line[2:7] == ["1", "5", "19", "-", "25%"], line

    # Once the engine ran every line, each tenant's share of what it finished.
    run(settings, MODEL)
    with session_scope(settings.resolved_database_url) as session:
        from api.services import tenant_views

        ids = [big.id, small.id, heavy.id]
        share = {t: v["share"] for t, v in tenant_views.figures(session, settings, ids).items()}
        assert all(not v["queue"] for v in tenant_views.figures(session, settings, ids).values())
    assert [share[t]["lines_finished"] for t in ids] == [34, 5, 10]
    assert share[small.id]["lines_share"] == pytest.approx(5 / 49)
    assert sum(share[t]["engine_share"] for t in ids) == pytest.approx(1.0)
    assert [share[t]["entitled_share"] for t in ids] == pytest.approx([0.25, 0.25, 0.5])

    # `offpeak usage` prints the tenant's queue and share after its bill and limits.
    monkeypatch.setattr(cli, "_client", lambda: small.sdk)
    usage = CliRunner().invoke(cli.app, ["usage"])
    assert usage.exit_code == 0, usage.output
    assert "queue" in usage.output and "(nothing queued)" in usage.output
    assert "engine-s" in usage.output and "entitled 25%" in usage.output


def test_print_queue_lists_each_model() -> None:
    out = io.StringIO()
    report = {
        "queue": [{"model": "m", "queued_lines": 1200, "lines_ahead": 5, "urgent_lines_ahead": 0,
                   "shared_lines_ahead": 5}],
        "share": {"window_seconds": 3600, "weight": 2.0, "entitled_share": 2 / 3,
                  "engine_seconds": 12.5, "engine_share": 0.5, "lines_finished": 40,
                  "lines_share": 0.5},
    }  # fmt: skip
    client_tools.print_queue(report, Console(file=out, width=100))
    text = out.getvalue()
    assert "1,200" in text and "50% (12.5 engine-s, 40 lines)" in text and "entitled 67%" in text
