"""The batch ETA on real PostgreSQL with the instant engine (a database of its own, so only
these batches queue and only these engine chunks measure the rate): ``estimated_completion_at``
appears once a rate is measured, moves as the lines ahead finish, is ``null`` while paused, and
a batch behind a large queue at a tiny measured rate carries ``completion_warning``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import update
from typer.testing import CliRunner

import offpeak.cli as cli
from api.services import batch_eta
from offpeak.settings import ModelConfig, Settings
from storage.db import session_scope
from storage.models import EngineChunk, Tenant
from tests.support.billing import AcctTenant, make, run
from tests.support.database import fresh_database

MODEL = "eta-model"
SLOW_MODEL = "eta-slow-model"


@pytest.fixture(scope="module")
def own_settings(settings: Settings, run_id: str) -> Iterator[Settings]:
    with fresh_database(f"offpeak_eta_{run_id}") as url:
        models = {MODEL: ModelConfig(engine="instant"), SLOW_MODEL: ModelConfig(engine="instant")}
        yield settings.model_copy(
            update={"database_url": url, "models": {**settings.models, **models}}
        )


@pytest.fixture(autouse=True)
def fresh_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every poll reads the queue and the rate again (no process cache between steps)."""
    monkeypatch.setattr(batch_eta, "CACHE_SECONDS", 0.0)
    batch_eta.clear_cache()


def _measured(settings: Settings, model: str, lines: int, busy_seconds: float) -> None:
    """An engine chunk of ``model``: ``lines`` finished in ``busy_seconds`` of stepping."""
    at = time.time()
    with session_scope(settings.resolved_database_url) as session:
        session.add(
            EngineChunk(
                worker_id="eta-test", model=model, device="cpu", started_at=at - busy_seconds,
                ended_at=at, busy_seconds=busy_seconds, requests=lines, prompt_tokens=0,
                cached_tokens=0, completion_tokens=2 * lines,
            )
        )  # fmt: skip


def _extra(tenant: AcctTenant, batch_id: str) -> dict[str, Any]:
    return tenant.sdk.batches.retrieve(batch_id).model_extra or {}


def test_the_eta_appears_and_moves_as_the_lines_ahead_finish(own_settings: Settings) -> None:
    settings = own_settings
    mine, other = AcctTenant(settings), AcctTenant(settings)
    batch = make(settings, mine, 30, MODEL, "m")
    ahead = make(settings, other, 30, MODEL, "o")
    # No line of the model has finished: nothing is known.
    assert _extra(mine, batch)["estimated_completion_at"] is None

    _measured(settings, MODEL, 10, 100.0)  # 0.1 lines/s
    before = time.time()
    first = _extra(mine, batch)
    after = time.time()
    # 30 of the other tenant's lines run beside its own 30 (equal weights): 60 lines at 0.1/s.
    assert before + 600 - 1 <= first["estimated_completion_at"] <= after + 600
    assert first["slack_seconds"] == pytest.approx(
        mine.sdk.batches.retrieve(batch).expires_at - first["estimated_completion_at"], abs=1.0
    )
    assert first["completion_warning"] is None

    # Paused, it claims nothing: no estimate. The instant engine runs the other batch meanwhile.
    paused = mine.http.post(f"/v1/batches/{batch}/pause", headers=mine.headers)
    assert paused.status_code == 200, paused.text
    assert _extra(mine, batch)["estimated_completion_at"] is None
    run(settings, MODEL)
    assert other.sdk.batches.retrieve(ahead).request_counts.completed == 30  # type: ignore[union-attr]
    resumed = mine.http.post(f"/v1/batches/{batch}/resume", headers=mine.headers)
    assert resumed.status_code == 200, resumed.text

    # Nothing ahead now, and 30 more lines measured in well under a second: far sooner.
    moved = _extra(mine, batch)["estimated_completion_at"]
    assert time.time() <= moved < first["estimated_completion_at"] - 400
    run(settings, MODEL)
    done = mine.sdk.batches.retrieve(batch)
    assert done.request_counts.completed == 30  # type: ignore[union-attr]
    assert (done.model_extra or {})["estimated_completion_at"] <= time.time() + 1


def test_a_batch_behind_a_large_queue_at_a_tiny_rate_gets_the_warning(
    own_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = own_settings
    mine, crowd = AcctTenant(settings), AcctTenant(settings)
    _measured(settings, SLOW_MODEL, 5, 2500.0)  # 0.002 lines/s
    # Alone, its 10 lines take 5,000 s of its 24 h window: no warning.
    early = make(settings, mine, 10, SLOW_MODEL, "e")
    alone = _extra(mine, early)
    assert alone["estimated_completion_at"] is not None and alone["completion_warning"] is None

    # A tenant of weight 50 queues 400 lines: its share puts them all ahead of the next batch.
    with session_scope(settings.resolved_database_url) as session:
        session.execute(update(Tenant).where(Tenant.id == crowd.id).values(weight=50.0))
    make(settings, crowd, 400, SLOW_MODEL, "c")
    late = make(settings, mine, 10, SLOW_MODEL, "l")
    extra = _extra(mine, late)
    warning = extra["completion_warning"]
    assert warning is not None and warning["code"] == "may_miss_completion_window"
    assert warning["estimated_completion_at"] == extra["estimated_completion_at"]
    assert warning["estimated_completion_at"] > warning["expires_at"]
    assert extra["slack_seconds"] < 0
    assert "after its completion window ends" in warning["message"]
    # A warning, not an error: the batch runs on.
    assert mine.sdk.batches.retrieve(late).status == "in_progress"
    assert mine.sdk.batches.retrieve(late).errors is None

    # The list (and so the dashboard) shows the same.
    listed = {b.id: b.model_extra or {} for b in mine.sdk.batches.list(limit=10).data}
    assert listed[late]["completion_warning"]["code"] == "may_miss_completion_window"

    # The dashboard's data and `offpeak status` show it too.
    board = mine.http.get("/v1/dashboard?hours=1", headers=mine.headers)
    assert board.status_code == 200, board.text
    shown = {b["id"]: b for b in board.json()["batches"]}
    assert shown[late]["completion_warning"]["code"] == "may_miss_completion_window"
    # Each read estimates from its own clock: the two reads may be a second or two apart.
    assert abs(shown[late]["estimated_completion_at"] - extra["estimated_completion_at"]) <= 5
    monkeypatch.setattr(cli, "_client", lambda: mine.sdk)
    status = CliRunner().invoke(cli.app, ["status", late], env={"COLUMNS": "200"})
    assert status.exit_code == 0, status.output
    # The table's cells as one text: a cell's words may wrap onto its next line.
    shown_text = " ".join(status.output.replace("│", " ").split())
    assert "(in " in shown_text and "after its completion window ends" in shown_text
