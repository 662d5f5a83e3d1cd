"""``offpeak keys create|list|revoke --admin-url``: an operator manages keys through the admin
API with the admin key, never the database; the key made works at once, and is refused once
revoked. The CLI's HTTP client is pointed at the in-process API."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from api.app import create_app
from offpeak import cli
from offpeak.cli import exit_codes
from offpeak.cli import keys as keys_cli
from offpeak.settings import Settings

ADMIN_KEY = "adm-keys-test"
URL = "http://testserver"


@pytest.fixture()
def api(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    app = create_app(settings.model_copy(update={"admin_api_key": ADMIN_KEY}))
    with TestClient(app) as client:

        def through_app(base_url: str, headers: dict[str, str], timeout: float) -> TestClient:
            # As httpx.Client does: a redirect is an answer, not followed.
            return TestClient(app, base_url=base_url, headers=headers, follow_redirects=False)

        monkeypatch.setattr(keys_cli.httpx, "Client", through_app)
        monkeypatch.setenv("OFFPEAK_ADMIN_KEY", ADMIN_KEY)
        yield client


def keys(*args: str) -> tuple[int, str]:
    # Wide, so a row of the table is one line.
    result = CliRunner().invoke(
        cli.app, ["keys", *args, "--admin-url", URL], env={"COLUMNS": "200"}
    )
    return result.exit_code, result.output


def test_keys_are_created_listed_and_revoked_through_the_admin_api(
    api: TestClient, run_id: str
) -> None:
    tenant = f"admin-keys-{run_id}"
    code, output = keys("create", "--tenant", tenant, "--name", "ci")
    assert code == 0, output
    key = output.strip()
    assert key.startswith("sk-offpeak-")
    as_tenant = {"Authorization": f"Bearer {key}"}
    assert api.get("/v1/batches", headers=as_tenant).status_code == 200

    code, output = keys("list", "--tenant", tenant)
    assert code == 0, output
    [row] = [line for line in output.splitlines() if tenant in line]
    key_id = row.split()[0]
    assert key_id.startswith("key_") and "ci" in row and key[:15] in row

    code, output = keys("revoke", key_id)
    assert code == 0 and f"key {key_id}" in output and "revoked" in output
    assert api.get("/v1/batches", headers=as_tenant).status_code == 401


def test_a_wrong_admin_key_and_an_unknown_id_exit_1_in_one_line(
    api: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, output = keys("revoke", "key_nonexistent")
    assert code == exit_codes.ERROR and "error 404" in output
    monkeypatch.setenv("OFFPEAK_ADMIN_KEY", "wrong")
    code, output = keys("list")
    assert code == exit_codes.ERROR and "error 401" in output


def test_the_admin_routes_refuse_a_tenants_key(api: TestClient, api_key: str) -> None:
    answer = api.get("/v1/admin/keys", headers={"Authorization": f"Bearer {api_key}"})
    assert answer.status_code == 401 and answer.json()["error"]["message"]
