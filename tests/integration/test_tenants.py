"""The operator's tenant commands and admin API: every tenant's weight, limits and use, and
setting its overrides, on real PostgreSQL."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from typer.testing import CliRunner

from api.app import create_app
from api.services import keys
from offpeak.cli import app
from offpeak.settings import Settings, get_settings
from storage.db import session_scope

ADMIN_KEY = "admin-tenants-test"


@pytest.fixture()
def admin_http(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings.model_copy(update={"admin_api_key": ADMIN_KEY}))) as c:
        yield c


def tenant_with_a_file(http: TestClient, settings: Settings) -> tuple[str, str]:
    """A new tenant's name and key, with one 10-byte file stored."""
    name = f"ops-{secrets.token_hex(4)}"
    with session_scope(settings.resolved_database_url) as session:
        key = keys.create_key(session, name)
    sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
    sdk.files.create(file=("a.jsonl", b"0123456789"), purpose="batch")
    return name, key


def test_the_admin_api_shows_and_sets_a_tenants_limits(
    admin_http: TestClient, settings: Settings
) -> None:
    name, key = tenant_with_a_file(admin_http, settings)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    listed = admin_http.get("/v1/admin/tenants", headers=admin).json()["data"]
    view = next(t for t in listed if t["name"] == name)
    assert view["stored_bytes"] == {"limit": None, "used": 10}
    assert view["weight"] == 1.0 and set(view["overrides"].values()) == {None}

    changed = admin_http.post(
        f"/v1/admin/tenants/{name}",
        json={"weight": 3, "max_batches_in_progress": 2, "requests_per_minute": 600},
        headers=admin,
    )
    assert changed.status_code == 200, changed.text
    shown = admin_http.get(f"/v1/admin/tenants/{view['id']}", headers=admin).json()
    assert shown["weight"] == 3.0
    assert shown["batches_in_progress"] == {"limit": 2, "used": 0}
    assert shown["overrides"]["requests_per_minute"] == 600
    assert shown["overrides"]["max_file_bytes"] is None  # left alone

    back = admin_http.post(
        f"/v1/admin/tenants/{name}", json={"max_batches_in_progress": None}, headers=admin
    )
    assert back.json()["batches_in_progress"]["limit"] is None
    assert back.json()["overrides"]["requests_per_minute"] == 600

    bad = admin_http.post(f"/v1/admin/tenants/{name}", json={"max_file_bytes": -2}, headers=admin)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_file_bytes"
    # -1: no limit for this tenant, whatever the default.
    off = admin_http.post(
        f"/v1/admin/tenants/{name}", json={"batch_creates_per_minute": -1}, headers=admin
    )
    assert off.json()["overrides"]["batch_creates_per_minute"] == -1
    assert off.json()["batch_creates_per_minute"] == {"limit": None}
    assert admin_http.get("/v1/admin/tenants/nobody-here", headers=admin).status_code == 404
    tenant_key = {"Authorization": f"Bearer {key}"}
    assert admin_http.get("/v1/admin/tenants", headers=tenant_key).status_code == 401


def test_the_tenants_commands_show_and_set_overrides(
    http: TestClient,
    settings: Settings,
    base_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name, _key = tenant_with_a_file(http, settings)
    for key, value in base_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("COLUMNS", "200")
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        set_ = runner.invoke(
            app, ["tenants", "set", name, "--weight", "2", "--max-file-bytes", "500"]
        )
        shown = runner.invoke(app, ["tenants", "show", name])
        listed = runner.invoke(app, ["tenants", "list"])
        reset = runner.invoke(app, ["tenants", "set", name, "--max-file-bytes", "default"])
        unlimited = runner.invoke(
            app, ["tenants", "set", name, "--batch-creates-per-minute", "unlimited"]
        )
        unknown = runner.invoke(app, ["tenants", "show", "nobody-here"])
    finally:
        get_settings.cache_clear()
    assert set_.exit_code == 0, set_.output
    assert "weight 2" in shown.output
    assert "max_file_bytes" in shown.output and "500" in shown.output
    assert name in listed.output and "10 / 500" in listed.output
    assert reset.exit_code == 0 and "default" in reset.output
    assert unlimited.exit_code == 0, unlimited.output
    row = next(line for line in unlimited.output.splitlines() if "batch_creates" in line)
    assert row.split()[1:3] == ["unlimited", "none"]  # the override, the limit in force
    assert unknown.exit_code == 1


def test_the_tenants_list_fits_an_80_column_terminal_with_every_cell_whole(
    http: TestClient, settings: Settings, base_env: dict[str, str]
) -> None:
    name, _key = tenant_with_a_file(http, settings)
    with session_scope(settings.resolved_database_url) as session:
        keys.create_key(session, f"a-tenant-with-a-long-name-{secrets.token_hex(8)}")
    # A terminal of 80 columns, as rich sees one (its TTY_COMPATIBLE and COLUMNS variables).
    env = {**os.environ, **base_env, "TTY_COMPATIBLE": "1", "COLUMNS": "80", "NO_COLOR": "1"}
    listed = subprocess.run(
        [str(Path(sys.executable).with_name("offpeak")), "tenants", "list"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    lines = re.sub(r"\x1b\[[0-9;]*m", "", listed.stdout).splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    assert "…" not in listed.stdout, listed.stdout  # nothing cut short
    row = next(line for line in lines if name in line).split()
    assert row[0] == name
    assert any(line.split()[:1] == [name] and "10 / " in line for line in lines), lines
