"""The embedded setup's backup and restore, as ``docs/operations.md`` gives them: its commands
are run as written on a default install holding a file, a key and a webhook endpoint; after the
folder is lost and restored, the file reads back and the webhook's signing secret still opens."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.app import create_app
from offpeak.settings import Settings
from storage import sealing
from storage.db import session_scope
from storage.models import WebhookEndpoint
from tests.support.database import new_key

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
HEADING = "### Backup and restore of the embedded setup"


def _steps() -> tuple[str, str]:
    """The section's two ``bash`` blocks: the backup, then the restore."""
    text = DOC.read_text()
    assert HEADING in text, f"docs/operations.md has no section {HEADING!r}"
    section = text.split(HEADING, 1)[1].split("\n### ", 1)[0]
    backup, restore = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    return backup, restore


def _run(script: str, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OFFPEAK_")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the `offpeak` command
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (script, result.stdout, result.stderr)


def _app(here: Path) -> TestClient:
    sealing._sealer = None  # a new process's keys: those of the (restored) data folder
    settings = Settings(
        data_dir=here / ".offpeak", webhook_allow_private_targets=True, webhook_allow_http=True
    )
    return TestClient(create_app(settings))


def test_the_documented_embedded_backup_restores_files_keys_and_webhook_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sealing, "_sealer", None)  # restored afterwards
    backup, restore = _steps()
    _run("offpeak migrate --create", tmp_path)
    settings = Settings(data_dir=tmp_path / ".offpeak")
    key = new_key(settings)
    with _app(tmp_path) as http:
        sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http)
        file = sdk.files.create(file=("in.jsonl", b'{"a": 1}\n'), purpose="batch")
        hook = http.post(
            "/v1/webhook_endpoints",
            json={"url": "http://127.0.0.1:9/hooks", "event_types": ["batch.completed"]},
            headers={"Authorization": f"Bearer {key}"},
        ).json()

    _run(backup, tmp_path)
    shutil.rmtree(tmp_path / ".offpeak" / "blobs")  # the data lost after the backup
    (tmp_path / ".offpeak" / "offpeak.db").write_bytes(b"not a database")
    today = datetime.date.today().isoformat()
    steps = [line for line in restore.splitlines() if not line.startswith("offpeak up")]
    _run(re.sub(r"\d{4}-\d{2}-\d{2}", today, "\n".join(steps)), tmp_path)

    with _app(tmp_path) as http:
        sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http)
        assert sdk.files.content(file.id).read() == b'{"a": 1}\n'
    with session_scope(settings.resolved_database_url) as session:
        endpoint = session.get(WebhookEndpoint, hook["id"])
        assert endpoint is not None and endpoint.secret == hook["signing_secret"]
