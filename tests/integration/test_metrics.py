"""``/metrics`` on the API and on a worker: every series the issue names is exposed, with values
that match the database (queue, batches, throughput, busy fraction, cost, completion share, the
scheduler's load and pause switch)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import delete

from offpeak.settings import ModelConfig, ModelPricing, Settings
from storage.db import session_scope
from storage.models import LoadSample, SchedulerState
from storage.repositories import fleet_stats
from tests.support.billing import AcctTenant, end, make, run
from tests.support.servers import free_port
from workers import worker_metrics

MODEL, QUEUED = "metrics-model", "metrics-queued"
SOURCE = "metrics-test"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "models": {MODEL: ModelConfig(engine="instant"), QUEUED: ModelConfig(engine="instant")},
            "pricing": {MODEL: ModelPricing(input_per_million=1.0, output_per_million=2.0)},
            "gpu_cost_per_hour": {"cpu": 3.6},
            "flush_seconds": 0.05,
            "metrics_cache_seconds": 0.0,
        }
    )


@contextmanager
def scheduler_state(settings: Settings) -> Iterator[None]:
    """The scheduler's shared state as it writes it (``storage.repositories.scheduler``): a pool
    paused by the admin switch, and that pool's load reading. Removed on exit, since a pause
    would hold up every other test's batches."""
    keys = (f"paused:{SOURCE}", f"load:{SOURCE}")
    with session_scope(settings.resolved_database_url) as session:
        session.execute(delete(SchedulerState).where(SchedulerState.key.in_(keys)))
        at = time.time()
        pause = {"paused": True, "hard": False, "reason": "test", "at": at}
        session.add(SchedulerState(key=keys[0], value=pause, updated_at=at))
        reading = {"load": 0.42, "paused": True, "gate_open": False}
        session.add(SchedulerState(key=keys[1], value=reading, updated_at=at))
    try:
        yield
    finally:
        with session_scope(settings.resolved_database_url) as session:
            session.execute(delete(SchedulerState).where(SchedulerState.key.in_(keys)))


#: The scraper's token: ``/metrics`` answers nobody else (a tenant's key included).
METRICS_TOKEN = "metrics-test-token"


def scrape(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``sample name → [(labels, value)]``."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(
    samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str
) -> float:
    matches = [v for lab, v in samples.get(name, []) if labels.items() <= lab.items()]
    assert matches, f"{name}{labels} not exposed; have {sorted(samples)}"
    return matches[0]


def test_api_metrics_expose_every_series(settings: Settings) -> None:
    settings = settings.model_copy(update={"metrics_token": METRICS_TOKEN})
    tenant = AcctTenant(settings)
    done = make(settings, tenant, 6, MODEL)
    run(settings, MODEL)
    end(settings, done)
    make(settings, tenant, 7, QUEUED)  # never runs: its lines stay queued
    with scheduler_state(settings):
        assert tenant.http.get("/metrics").status_code == 401  # a tenant's key is not enough
        response = tenant.http.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = scrape(response.text)

    assert value(samples, "offpeak_queue_requests", model=QUEUED, status="pending") >= 7
    assert value(samples, "offpeak_queue_tokens", model=QUEUED) > 7 * 10
    assert value(samples, "offpeak_queue_wait_seconds_bucket", model=QUEUED, le="+Inf") >= 7
    assert value(samples, "offpeak_queue_wait_seconds_gcount", model=QUEUED) >= 7
    assert value(samples, "offpeak_queue_oldest_wait_seconds", model=QUEUED) >= 0
    assert value(samples, "offpeak_batches", status="completed") >= 1
    assert value(samples, "offpeak_batches", status="in_progress") >= 1
    assert value(samples, "offpeak_batches", status="cancelled") >= 0  # every status, even at 0
    assert value(samples, "offpeak_prompt_tokens_per_second", model=MODEL) > 0
    # 6 answers of 2 tokens finished within the window.
    window = settings.metrics_window_seconds
    assert value(samples, "offpeak_completion_tokens_per_second", model=MODEL) >= 12 / window
    busy = value(samples, "offpeak_engine_busy_ratio", model=MODEL, worker="acct", device="cpu")
    assert 0 < busy <= 1
    assert value(samples, "offpeak_cost_per_million_tokens", model=MODEL) > 0
    assert value(samples, "offpeak_batch_completion_window_share_count") >= 1
    assert value(samples, "offpeak_batch_completion_window_share_bucket", le="1.0") >= 1
    p50 = value(samples, "offpeak_batch_completion_window_share_quantile", quantile="0.5")
    p99 = value(samples, "offpeak_batch_completion_window_share_quantile", quantile="0.99")
    assert 0 <= p50 <= p99
    assert value(samples, "offpeak_billed_tokens_total", model=MODEL) >= 6 * 2
    assert value(samples, "offpeak_billed_price_dollars_total", model=MODEL) > 0
    assert value(samples, "offpeak_billed_cost_dollars_total", model=MODEL) > 0
    assert value(samples, "offpeak_billed_gpu_seconds_total", model=MODEL) > 0
    assert value(samples, "offpeak_load", source=SOURCE) == pytest.approx(0.42)
    assert value(samples, "offpeak_batch_work_paused", pool=SOURCE) == 1.0
    assert value(samples, "offpeak_batch_work_paused", pool="*") in (0.0, 1.0)
    assert "process_cpu_seconds_total" in samples


def test_metrics_answers_are_cached(settings: Settings) -> None:
    from api.services import fleet_metrics

    cached = settings.model_copy(update={"metrics_cache_seconds": 60.0})
    first = fleet_metrics.exposition(cached)
    assert fleet_metrics.exposition(cached) is first


def test_worker_metrics_endpoint(settings: Settings) -> None:
    tenant = AcctTenant(settings)
    batch_id = make(settings, tenant, 5, MODEL)
    run(settings, MODEL, owner="metrics-worker")
    end(settings, batch_id)  # bills it in this process: the billing counters move

    registry = CollectorRegistry()
    registry.register(worker_metrics.EngineCollector(settings, "metrics-worker"))
    own = scrape(generate_latest(registry).decode())
    assert 0 < value(own, "offpeak_worker_engine_busy_ratio", model=MODEL) <= 1
    assert value(own, "offpeak_worker_completion_tokens_per_second", model=MODEL) > 0
    assert value(own, "offpeak_worker_prompt_tokens_per_second", model=MODEL) > 0

    worker_metrics.observe_flush(MODEL, 0.5, 2, 30, 10, 4)
    worker_metrics.observe_queue_wait(MODEL, [1.5, 20.0])
    port = free_port()
    served = settings.model_copy(update={"metrics_port": port})
    assert worker_metrics.start_server(served, "engine", "metrics-worker") == port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    scraped = scrape(text)
    assert value(scraped, "offpeak_worker_batches_billed_total", status="completed") >= 1
    assert value(scraped, "offpeak_worker_batch_completion_window_share_count") >= 1
    assert value(scraped, "offpeak_worker_engine_busy_ratio", model=MODEL) > 0
    assert value(scraped, "offpeak_worker_tokens_total", model=MODEL, kind="completion") >= 4
    assert value(scraped, "offpeak_worker_request_queue_wait_seconds_count", model=MODEL) >= 2
    assert "offpeak_worker_billing_failures_total" in scraped


def test_load_samples_follow_the_scheduler_state(settings: Settings) -> None:
    at = time.time()
    with session_scope(settings.resolved_database_url) as session:
        session.execute(delete(LoadSample).where(LoadSample.source == SOURCE))
        session.add(LoadSample(at=at - 30 * 3600, source=SOURCE, load=0.9, paused=False))
    with scheduler_state(settings):
        assert worker_metrics.sample_load(settings, at=at) >= 1
    with session_scope(settings.resolved_database_url) as session:
        series = [s for s in fleet_stats.load_series(session, at - 48 * 3600) if s[1] == SOURCE]
    # The 30-hour-old sample was pruned (24 h of history kept); the new one is paused at 0.42.
    assert series == [(pytest.approx(at), SOURCE, pytest.approx(0.42), True)]
