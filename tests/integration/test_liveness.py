"""Liveness a user can see: ``/healthz`` says which control and engine workers
are alive and which configured models have none; ``/readyz`` answers 503 (never 500) when the
database is down or not migrated; the dashboard's data carries "no engine worker serving X for
…"; ``offpeak submit --wait`` warns once on stderr and still succeeds.

On real PostgreSQL, in a database of this module's own (registered workers would change the
scheduler's estimates in other tests' database), with real worker processes for the heartbeat."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, select, update

import migrations
from api.app import create_app
from api.services import health as health_service
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import ModelConfig, Settings
from storage.db import session_scope
from storage.models import WorkerRecord
from storage.repositories import workers as workers_repo
from tests.support.database import (
    PG_ADMIN,
    database_url,
    drop_database,
    fresh_database,
    new_key,
)
from tests.support.servers import free_port

MODEL = "liveness-model"
OTHER = "liveness-other"
#: The operator's token: ``/healthz`` names workers and hosts only to it.
OPERATOR_TOKEN = "liveness-operator-token"
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
MODELS = {MODEL: ModelConfig(engine="instant"), OTHER: ModelConfig(engine="instant")}


@pytest.fixture(scope="module")
def db_url(run_id: str) -> Iterator[str]:
    with fresh_database(f"offpeak_{run_id}_liveness") as url:
        yield url


@pytest.fixture()
def lv_settings(settings: Settings, db_url: str) -> Settings:
    return settings.model_copy(
        update={
            "database_url": db_url,
            "models": MODELS,
            "worker_alive_seconds": 60.0,
            "metrics_token": OPERATOR_TOKEN,
        }
    )


@pytest.fixture()
def client(lv_settings: Settings, db_url: str) -> Iterator[TestClient]:
    """The API in-process on this module's database, with no worker registered."""
    with session_scope(db_url) as session:
        session.execute(delete(WorkerRecord))
    with TestClient(create_app(lv_settings), headers=OPERATOR) as http:
        yield http


def register(url: str, worker_id: str, models: list[str], role: str = "engine") -> None:
    with session_scope(url) as session:
        workers_repo.register(session, worker_id, "liveness-host", models, role=role)


def last_heard(url: str, worker_id: str, seconds_ago: float) -> None:
    """Make a worker's last heartbeat ``seconds_ago`` old: a worker that stopped beating then."""
    with session_scope(url) as session:
        session.execute(
            update(WorkerRecord)
            .where(WorkerRecord.id == worker_id)
            .values(heartbeat_at=time.time() - seconds_ago)
        )


def by_model(health: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["model"]: row for row in health["models"]}


def test_no_workers_lists_every_model_as_unserved(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    health = response.json()
    assert health["status"] == "degraded" and health["database"] == "ok"
    assert health["workers"] == []
    assert health["models_without_engine_worker"] == [MODEL, OTHER]
    row = by_model(health)[MODEL]
    assert row["engine_workers"] == [] and row["seconds_without_engine_worker"] is None
    assert row["message"] == f"no engine worker serving {MODEL}: none has registered"
    assert any(p.startswith("no control worker") for p in health["problems"])


def test_fresh_heartbeat_is_alive_and_serves_its_model(client: TestClient, db_url: str) -> None:
    register(db_url, "engine-a", [MODEL])
    register(db_url, "control-a", [], role="control")
    health = client.get("/healthz").json()
    workers = {w["id"]: w for w in health["workers"]}
    assert set(workers) == {"engine-a", "control-a"}
    assert workers["engine-a"]["role"] == "engine" and workers["engine-a"]["models"] == [MODEL]
    assert workers["control-a"]["role"] == "control" and workers["control-a"]["models"] == []
    assert 0 <= workers["engine-a"]["heartbeat_age_seconds"] < health["worker_alive_seconds"]
    assert by_model(health)[MODEL]["engine_workers"] == ["engine-a"]
    assert by_model(health)[MODEL]["message"] is None
    # The other model still has no engine worker, and says so; the control worker is alive.
    assert health["models_without_engine_worker"] == [OTHER]
    assert health["problems"] == [f"no engine worker serving {OTHER}: none has registered"]


def test_stale_heartbeat_is_not_alive(client: TestClient, db_url: str) -> None:
    register(db_url, "engine-old", [MODEL])
    register(db_url, "control-old", [], role="control")
    last_heard(db_url, "engine-old", 2 * 3600)
    last_heard(db_url, "control-old", 61)
    health = client.get("/healthz").json()
    assert health["workers"] == []
    assert MODEL in health["models_without_engine_worker"]
    row = by_model(health)[MODEL]
    assert row["seconds_without_engine_worker"] >= 2 * 3600
    assert re.fullmatch(rf"no engine worker serving {MODEL} for 2 h( \d+ min)?", row["message"])
    assert any(p.startswith("no control worker for 1 min") for p in health["problems"])


def test_retired_worker_is_gone_at_once(client: TestClient, db_url: str) -> None:
    """A clean stop retires the record: its fresh heartbeat no longer counts."""
    register(db_url, "engine-stopped", [MODEL])
    with session_scope(db_url) as session:
        workers_repo.retire(session, "engine-stopped")
    health = client.get("/healthz").json()
    assert health["workers"] == [] and MODEL in health["models_without_engine_worker"]
    assert by_model(health)[MODEL]["seconds_without_engine_worker"] is not None


def announce_loading(url: str, worker_id: str, models: list[str], seconds_ago: float) -> None:
    with session_scope(url) as session:
        at = time.time() - seconds_ago
        workers_repo.announce_loading(session, worker_id, "liveness-host", models, at)


def test_a_worker_loading_its_engine_is_no_alarm_within_the_grace(
    client: TestClient, db_url: str, lv_settings: Settings
) -> None:
    """At a start the previous run's worker is 90 minutes silent while the new one loads its
    engine: no "for 1 h 30 min" alarm, the model lists the loading worker instead."""
    register(db_url, "engine-previous-run", [MODEL])
    last_heard(db_url, "engine-previous-run", 90 * 60)
    register(db_url, "control-now", [], role="control")
    announce_loading(db_url, "engine-loading", [MODEL], 30)
    key = new_key(lv_settings)
    health = client.get("/healthz").json()
    row = by_model(health)[MODEL]
    assert row["loading_engine_workers"] == ["engine-loading"]
    assert row["engine_workers"] == [] and row["message"] is None
    assert not any(MODEL in p and "1 h 30 min" in p for p in health["problems"])
    answer = client.get("/v1/dashboard", headers={"Authorization": f"Bearer {key}"}).json()
    assert [a for a in answer["alerts"] if a.get("model") == MODEL] == []

    register(db_url, "engine-loading", [MODEL])  # loaded: ready, and alive
    row = by_model(client.get("/healthz").json())[MODEL]
    assert row["engine_workers"] == ["engine-loading"] and row["loading_engine_workers"] == []


def test_a_load_past_the_grace_is_reported_from_its_start(
    client: TestClient, db_url: str, lv_settings: Settings
) -> None:
    register(db_url, "engine-previous-run", [MODEL])
    last_heard(db_url, "engine-previous-run", 90 * 60)
    announce_loading(db_url, "engine-stuck", [MODEL], lv_settings.engine_load_grace_seconds + 60)
    row = by_model(client.get("/healthz").json())[MODEL]
    assert row["loading_engine_workers"] == []
    assert (
        row["message"]
        == f"no engine worker serving {MODEL}: one has been loading for 16 min (see its log)"
    )


def test_readyz_is_ready_without_engine_workers(client: TestClient) -> None:
    """No engine worker keeps the API ready (batches wait for one); it is reported."""
    response = client.get("/readyz")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ready"
    assert (
        body["schema_revision"] == migrations.revisions(client.app.state.settings.database_url)[1]
    )
    assert body["models_without_engine_worker"] == [MODEL, OTHER]


def check_not_ready(client: TestClient, code: str) -> dict[str, Any]:
    response = client.get("/readyz")
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "5"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == code
    health = client.get("/healthz", headers=OPERATOR)
    assert health.status_code == 200, "liveness stays 200 while the process runs"
    assert health.json()["status"] == "degraded"
    return {"ready": error, "health": health.json()}


def test_readyz_503_when_the_database_does_not_listen(lv_settings: Settings) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/offpeak"  # nothing listens
    down = lv_settings.model_copy(update={"database_url": url})
    # Not entered: the app's startup check would refuse this database.
    answers = check_not_ready(TestClient(create_app(down)), "database_unavailable")
    assert answers["health"]["database"] == "unavailable"
    assert answers["health"]["problems"] == ["the database does not answer (OperationalError)"]


def test_readyz_503_on_an_unmigrated_database(lv_settings: Settings, run_id: str) -> None:
    name = f"offpeak_{run_id}_unmigrated"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        url = database_url(name)
        bare = lv_settings.model_copy(update={"database_url": url})
        answers = check_not_ready(TestClient(create_app(bare)), "schema_out_of_date")
        assert "offpeak migrate" in answers["ready"]["message"]
        assert answers["health"]["database"] == "not_migrated"
    finally:
        health_service.probe_engine(url).dispose()
        drop_database(name)


def test_readyz_503_when_the_database_goes_away(lv_settings: Settings, run_id: str) -> None:
    """Ready while the database is there; its loss turns readiness to 503, liveness stays 200."""
    with fresh_database(f"offpeak_{run_id}_vanishing") as url:
        vanishing = lv_settings.model_copy(update={"database_url": url})
        with TestClient(create_app(vanishing)) as http:
            assert http.get("/readyz").status_code == 200
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
            check_not_ready(http, "database_unavailable")


def test_dashboard_data_says_which_model_has_no_engine_worker(
    client: TestClient, lv_settings: Settings, db_url: str
) -> None:
    register(db_url, "engine-b", [OTHER])
    register(db_url, "engine-gone", [MODEL])
    register(db_url, "control-b", [], role="control")
    last_heard(db_url, "engine-gone", 75)
    key = new_key(lv_settings)
    response = client.get("/v1/dashboard", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200
    alerts = response.json()["alerts"]
    assert [a["kind"] for a in alerts] == ["no_engine_worker"], "the other model is served"
    assert alerts[0]["model"] == MODEL and alerts[0]["seconds"] >= 75
    assert re.fullmatch(
        rf"no engine worker serving {MODEL} for 1 min 1[5-9] s", alerts[0]["message"]
    )


# --- Real worker processes -------------------------------------------------------------------

ALIVE_SECONDS = 3.0


def wait_until(check: Callable[[], Any], what: str, timeout: float = 90) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout`` seconds (a bound
    on a hang, not an assertion on speed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for: {what}")


@pytest.fixture()
def stack(
    base_env: dict[str, str],
    db_url: str,
    run_id: str,
    tmp_path: Path,
) -> Iterator[ServiceProcesses]:
    """``offpeak serve`` and a control worker (no engine worker yet) on the instant engine."""
    with session_scope(db_url) as session:
        session.execute(delete(WorkerRecord))
    env = {
        **base_env,
        "OFFPEAK_DATABASE_URL": db_url,
        "OFFPEAK_DATA_DIR": str(tmp_path / "data"),
        "OFFPEAK_QUEUE_PREFIX": f"{run_id}-liveness",
        "OFFPEAK_MODELS": json.dumps({MODEL: {"engine": "instant"}}),
        "OFFPEAK_WORKER_ALIVE_SECONDS": str(ALIVE_SECONDS),
        "OFFPEAK_METRICS_TOKEN": OPERATOR_TOKEN,
    }
    services = ServiceProcesses(env, free_port(), tmp_path / "logs", roles=("control",))
    services.start()
    try:
        services.wait_http()
        yield services
    finally:
        services.stop()


def records(url: str, role: str) -> list[WorkerRecord]:
    with session_scope(url) as session:
        return list(session.scalars(select(WorkerRecord).where(WorkerRecord.role == role)))


def test_workers_heartbeat_and_submit_wait_warns_once(
    stack: ServiceProcesses, db_url: str, lv_settings: Settings, tmp_path: Path
) -> None:
    def healthz() -> dict[str, Any]:
        return dict(stack_client.get("/healthz").json())

    import httpx

    stack_client = httpx.Client(base_url=stack.base_url, timeout=10, headers=OPERATOR)
    # The control worker registers and heartbeats (it did not at all before).
    wait_until(
        lambda: any(w["role"] == "control" for w in healthz()["workers"]),
        "the control worker in /healthz",
    )
    assert healthz()["models_without_engine_worker"] == [MODEL]

    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(3)
    ]
    batch_file = tmp_path / "batch.jsonl"
    batch_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    env = {
        **stack.env,
        "OPENAI_BASE_URL": f"{stack.base_url}/v1",
        "OPENAI_API_KEY": new_key(lv_settings),
    }
    stdout_path = tmp_path / "submit.out"
    cli = subprocess.Popen(
        [sys.executable, "-m", "offpeak", "submit", str(batch_file), "--wait"],
        env=env,
        stdout=stdout_path.open("w"),
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr: list[str] = []
    warned = threading.Event()

    def read_stderr() -> None:
        assert cli.stderr is not None
        for text_line in cli.stderr:
            stderr.append(text_line)
            if "no engine worker serving" in text_line:
                warned.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert warned.wait(timeout=90), f"no warning on stderr: {stderr}"
        assert cli.poll() is None, "the warning does not end the wait"
        # An engine worker starts: the batch runs, and the wait ends well.
        stack.start_worker("engine")
        cli.wait(timeout=180)
    finally:
        if cli.poll() is None:
            cli.kill()
    reader.join(timeout=10)
    stdout = stdout_path.read_text()
    assert cli.returncode == 0, "".join(stderr) + stdout
    assert "completed" in stdout
    warnings = [line for line in stderr if "warning:" in line]
    assert len(warnings) == 1, warnings
    assert f"no engine worker serving {MODEL}: none has registered" in warnings[0]

    # The idle engine worker keeps beating: alive past several alive-windows with no work.
    (engine,) = records(db_url, "engine")

    def idle_and_alive() -> dict[str, Any] | None:
        beat = records(db_url, "engine")[0].heartbeat_at
        if beat <= engine.heartbeat_at + 2 * ALIVE_SECONDS:
            return None  # not yet idle long enough to prove the thread beats
        health = healthz()  # eventually, not at once: a loaded machine may delay a beat
        alive = [w["id"] for w in health["workers"] if w["role"] == "engine"]
        return health if alive == [engine.id] else None

    health = wait_until(idle_and_alive, "the idle engine worker to stay alive")
    assert health["models_without_engine_worker"] == []

    # SIGKILL: no goodbye, the heartbeat ages out.
    stack.kill("engine")
    gone = wait_until(
        lambda: (h := healthz())["models_without_engine_worker"] == [MODEL] and h,
        "the killed engine worker to age out",
    )
    assert all(w["role"] != "engine" for w in gone["workers"])
    assert by_model(gone)[MODEL]["message"].startswith(f"no engine worker serving {MODEL} for ")
    assert records(db_url, "engine")[0].ready, "aged out, not retired: it was killed"

    # SIGTERM: a clean stop retires the control worker's record.
    stack.kill("control", signal.SIGTERM)
    assert [r.ready for r in records(db_url, "control")] == [False]


def test_heartbeat_thread_beats_then_retires(lv_settings: Settings, db_url: str) -> None:
    from workers.liveness import WorkerHeartbeat, role_of

    with session_scope(db_url) as session:
        session.execute(delete(WorkerRecord))
    fast = lv_settings.model_copy(update={"worker_alive_seconds": 0.4})  # a beat every 0.1 s
    role, models = role_of(fast, ["x", f"{fast.queue_prefix}.model.{MODEL}"])
    assert (role, models) == ("engine", [MODEL])
    heartbeat = WorkerHeartbeat(fast, "beating-worker", role, models)
    heartbeat.start()
    try:
        (first,) = records(db_url, "engine")
        wait_until(
            lambda: records(db_url, "engine")[0].heartbeat_at > first.heartbeat_at,
            "a second heartbeat",
        )
    finally:
        heartbeat.stop()
    (stopped,) = records(db_url, "engine")
    assert not stopped.ready
    heartbeat.beat()  # a late beat does not revive a retired worker
    assert not records(db_url, "engine")[0].ready


def test_client_health_read_never_fails(sdk: Any) -> None:
    from openai import OpenAI

    from offpeak.cli import client as client_tools

    nobody = OpenAI(base_url=f"http://127.0.0.1:{free_port()}/v1", api_key="k", max_retries=5)
    assert client_tools.health(nobody) is None
    answer = client_tools.health(sdk)  # the in-process API: /healthz next to /v1
    assert answer is not None and answer["database"] == "ok"
    down = {"database": "unavailable", "models": [], "workers": []}
    assert client_tools.liveness_warnings(down, MODEL) == {}
