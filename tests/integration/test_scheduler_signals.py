"""The pause switch through the admin API and the CLI, stored in the database."""

from __future__ import annotations

import os
import subprocess
import sys

from fastapi.testclient import TestClient

from api.app import create_app
from offpeak.scheduler_state import PauseState
from offpeak.settings import Settings
from workers.scheduler.store import DbStore


def test_pause_switch_through_the_admin_api(settings: Settings) -> None:
    admin = settings.model_copy(update={"admin_api_key": "admin-secret"})
    store = DbStore(settings.resolved_database_url)
    with TestClient(create_app(admin)) as client:
        auth = {"Authorization": "Bearer admin-secret"}
        assert client.post("/v1/admin/scheduler/pause", json={}).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        assert client.get("/v1/admin/scheduler", headers=wrong).status_code == 401
        paused = client.post(
            "/v1/admin/scheduler/pause",
            json={"pool": "api-pool", "reason": "deploying"},
            headers=auth,
        )
        assert paused.status_code == 200, paused.text
        assert paused.json()["paused"] and paused.json()["pool"] == "api-pool"
        assert store.pause_state("api-pool") == PauseState(True, False, "deploying")
        assert store.pause_state("other-pool") == PauseState()
        view = client.get("/v1/admin/scheduler", headers=auth).json()
        [switch] = [s for s in view["switches"] if s["pool"] == "api-pool"]
        assert switch["paused"] and switch["reason"] == "deploying"
        resumed = client.post("/v1/admin/scheduler/resume", json={"pool": "api-pool"}, headers=auth)
        assert resumed.json()["paused"] is False
    assert store.pause_state("api-pool") == PauseState()
    with TestClient(create_app(settings)) as client:  # no admin key configured: the API is off
        response = client.get("/v1/admin/scheduler", headers={"Authorization": "Bearer x"})
        assert response.status_code == 401 and "OFFPEAK_ADMIN_API_KEY" in response.text


def test_offpeak_pause_and_resume_commands(base_env: dict[str, str], settings: Settings) -> None:
    env = {**os.environ, **base_env}
    store = DbStore(settings.resolved_database_url)

    def offpeak(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "offpeak", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert "hard-paused" in offpeak("pause", "--pool", "cli-pool", "--hard", "--reason", "GPU swap")
    assert store.pause_state("cli-pool") == PauseState(True, True, "GPU swap")
    assert store.pause_state("another") == PauseState()
    offpeak("pause")  # every pool
    assert store.pause_state("another").paused
    assert "still paused" in offpeak("resume", "--pool", "cli-pool")
    offpeak("resume")
    assert store.pause_state("cli-pool") == PauseState()
    assert store.pause_state("another") == PauseState()
