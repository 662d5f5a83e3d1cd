"""The dashboard in headless Chromium shows "no engine worker serving X for …" for a configured
model whose only engine worker stopped beating, and nothing for a served model."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from sqlalchemy import delete

from api.app import create_app
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import WorkerRecord
from tests.integration.test_liveness import MODEL, OTHER, db_url, last_heard, lv_settings, register
from tests.support.database import new_key
from tests.support.servers import free_port

__all__ = ["db_url", "lv_settings"]  # fixtures shared with test_liveness

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture()
def server(lv_settings: Settings) -> Iterator[str]:
    """The API on a real port (a browser cannot reach the in-process test client)."""
    port = free_port()
    config = uvicorn.Config(
        create_app(lv_settings), host="127.0.0.1", port=port, log_level="warning"
    )
    api = uvicorn.Server(config)
    thread = threading.Thread(target=api.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not api.started:
        assert time.monotonic() < deadline, "the API did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    api.should_exit = True
    thread.join(timeout=10)


def test_dashboard_shows_models_without_engine_worker(
    lv_settings: Settings, db_url: str, server: str
) -> None:
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        message = "Debian's chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with session_scope(db_url) as session:
        session.execute(delete(WorkerRecord))
    register(db_url, "engine-serving", [OTHER])
    register(db_url, "engine-silent", [MODEL])
    register(db_url, "control-up", [], role="control")
    last_heard(db_url, "engine-silent", 3 * 3600)
    key = new_key(lv_settings)

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server}/dashboard#key={key}&refresh=0.5")
        alert = page.locator(f'#alerts .alert[data-model="{MODEL}"]')
        alert.wait_for(timeout=15_000)
        text = alert.inner_text()
        assert re.fullmatch(rf"no engine worker serving {MODEL} for 3 h( \d+ min)?", text), text
        assert page.locator(f'#alerts .alert[data-model="{OTHER}"]').count() == 0
        assert page.locator("#alerts .alert").count() == 1, "the control worker is alive"

        register(db_url, "engine-back", [MODEL])  # a worker comes back: the warning goes
        page.locator("#alerts").wait_for(state="hidden", timeout=15_000)
        browser.close()
    assert errors == [], f"console errors: {errors}"
