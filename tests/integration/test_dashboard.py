"""The dashboard in headless Chromium (Debian's ``chromium``, driven by Playwright; see
``shared/docs/environment.md``): the page loads without console errors, a running batch's
progress visibly advances, its queue card counts its lines, its chart has data, and the final
state is saved as a screenshot: in the test's temporary folder, or where
``OFFPEAK_DASHBOARD_PNG`` says (``make docs-dashboard`` sets it to ``docs/dashboard.png``, the
README's picture, to regenerate it on purpose)."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from sqlalchemy import delete

from api.app import create_app
from offpeak.settings import ModelConfig, ModelPricing, Settings
from storage.db import session_scope
from storage.models import LoadSample, SchedulerState
from tests.support.batches import line, validate
from tests.support.billing import AcctTenant, end, make, run
from tests.support.engines import SlowEngine
from tests.support.servers import free_port
from workers import worker_metrics

MODEL = "dashboard-model"
SOURCE = "dashboard-test"
CHROMIUM = "/usr/bin/chromium"
#: environment.md's flags for Chromium here (no sandbox as root, nothing fetched in the background).
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "models": {MODEL: ModelConfig(engine="instant")},
            "pricing": {MODEL: ModelPricing(input_per_million=0.10, output_per_million=0.20)},
            "gpu_cost_per_hour": {"cpu": 0.05},
            "flush_seconds": 0.2,
            "metrics_window_seconds": 10.0,
            "metrics_cache_seconds": 0.0,
        }
    )


@pytest.fixture()
def server(settings: Settings) -> Iterator[str]:
    """The API on a real port (a browser cannot reach the in-process test client)."""
    with serving(settings) as url:
        yield url


@contextlib.contextmanager
def serving(settings: Settings) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
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


@pytest.fixture()
def load_signal(settings: Settings) -> Iterator[Iterator[float]]:
    """A load reading the test moves, as the scheduler publishes them (``load:<pool>``), sampled
    into the dashboard's history as the sweep does; removed afterwards."""
    url = settings.resolved_database_url
    key = f"load:{SOURCE}"

    def readings() -> Iterator[float]:
        step = 0
        while True:
            load = round(0.45 + 0.35 * math.sin(step / 4), 3)
            with session_scope(url) as session:
                session.merge(
                    SchedulerState(
                        key=key, value={"load": load, "paused": False}, updated_at=time.time()
                    )
                )
            worker_metrics.sample_load(settings)
            step += 1
            yield load

    yield readings()
    with session_scope(url) as session:
        session.execute(delete(SchedulerState).where(SchedulerState.key == key))
        session.execute(delete(LoadSample).where(LoadSample.source == SOURCE))


@pytest.fixture()
def screenshot(tmp_path: Path) -> Path:
    """Where the final state is saved: never into the checkout unless asked for."""
    configured = os.environ.get("OFFPEAK_DASHBOARD_PNG")
    return Path(configured).resolve() if configured else tmp_path / "dashboard.png"


def test_dashboard_shows_progress_in_chromium(
    settings: Settings, server: str, load_signal: Iterator[float], screenshot: Path
) -> None:
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        message = "Debian's chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    tenant = AcctTenant(settings)
    done = make(settings, tenant, 40, MODEL, prefix="warmup")
    run(settings, MODEL)
    end(settings, done)
    running = make(settings, tenant, 240, MODEL)
    next(load_signal)

    def work() -> None:
        run(settings, MODEL, SlowEngine(MODEL, delay=0.04))
        # At once: the live stack's sweep (same database, other prices) would finalize and bill
        # a finished batch it finds still running.
        end(settings, running)

    worker = threading.Thread(target=work)

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1440, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server}/dashboard#key={tenant.key}&hours=0.02&refresh=0.5")
        row = page.locator(f'tr[data-batch="{running}"]')
        row.wait_for(timeout=15_000)
        assert tenant.key not in page.url, "the key stays out of the address bar"
        assert int(row.get_attribute("data-done") or -1) == 0
        queue_card = page.locator(f'.card[data-queue="{MODEL}"]').inner_text()
        assert "lines ahead" in queue_card and "240" in queue_card
        assert "entitled" in page.locator(".card[data-share]").inner_text()

        worker.start()
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while worker.is_alive() and time.monotonic() < deadline:
            next(load_signal)
            page.wait_for_timeout(700)
            seen.append(int(row.get_attribute("data-done") or 0))
        worker.join(timeout=30)
        assert not worker.is_alive()
        advancing = [b for a, b in zip(seen, seen[1:], strict=False) if b > a]
        assert len(advancing) >= 3, f"progress did not visibly advance: {seen}"
        assert 0 < seen[len(seen) // 2] < 240
        width = row.locator(".bar > div").evaluate("e => e.style.width")
        assert width not in ("", "0.0%")

        next(load_signal)
        page.locator(f'tr[data-batch="{running}"] .badge.completed').wait_for(timeout=10_000)
        assert row.get_attribute("data-done") == "240"
        datasets = page.evaluate("Chart.getChart('chart').data.datasets.map(d => d.label)")
        assert any("tokens/s" in label for label in datasets)
        assert any(SOURCE in label for label in datasets)
        card = page.locator(f'.card[data-model="{MODEL}"]')
        assert "completion tokens/s" in card.inner_text()
        saving = row.locator("td").nth(9).inner_text()
        assert saving.startswith("$") and saving != "$0"
        page.wait_for_timeout(600)  # one more refresh, so the screenshot shows the final chart
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    assert errors == [], f"console errors: {errors}"
    assert screenshot.read_bytes().startswith(b"\x89PNG")


#: A model name as long as real ones get (a quantized build's file name).
LONG_MODEL = "SmolLM2-135M-Instruct-Q8_0-long-context"


def test_the_batch_table_fits_1280_px_and_a_failed_batch_says_why(settings: Settings) -> None:
    """In a 1,280 px window every column of the batch table is visible (the ETA was cut off),
    and a batch that failed validation shows its model and the reason, line number included."""
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        message = "Debian's chromium is not installed (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    models = {**settings.models, LONG_MODEL: ModelConfig(engine="instant")}
    settings = settings.model_copy(update={"models": models})
    tenant = AcctTenant(settings)
    running = make(settings, tenant, 3, LONG_MODEL)
    broken = line("ok", model=LONG_MODEL) + b"\n{not json\n"
    failed, _ = validate(settings, broken, tenant_name=tenant.name)
    assert failed.status == "failed"

    errors: list[str] = []
    with sync_playwright() as playwright, serving(settings) as server:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{server}/dashboard#key={tenant.key}&hours=0.02")
        page.locator(f'tr[data-batch="{running}"]').wait_for(timeout=15_000)
        overflow = page.evaluate(
            "() => ({page: document.documentElement.scrollWidth,"
            " table: document.getElementById('batches').getBoundingClientRect().right,"
            " eta: [...document.querySelectorAll('#batches th')].pop()"
            ".getBoundingClientRect().right,"
            " window: window.innerWidth})"
        )
        assert overflow["page"] <= overflow["window"], overflow
        assert overflow["table"] <= overflow["window"] and overflow["eta"] <= overflow["window"]

        row = page.locator(f'tr[data-batch="{failed.id}"]')
        assert row.locator("td").nth(1).get_attribute("title") == LONG_MODEL
        reason = page.locator(f'tr[data-reason-for="{failed.id}"]')
        text = reason.inner_text()
        assert "line 2" in text and "invalid_json" in text, text
        assert reason.is_visible()
        browser.close()
    assert errors == [], f"console errors: {errors}"
