"""Reading vLLM's Prometheus text (``workers.vllm_metrics``): pure parsing, no server.

Pages are written by ``prometheus_client`` itself, under vLLM's metric names, so the reader is
checked against the exposition format a real server produces (HELP/TYPE lines, label sets,
``_created`` samples).
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client import Histogram as PromHistogram

from workers.vllm_metrics import (
    CACHED_TOKENS,
    GENERATION_TOKENS,
    PROMPT_TOKENS,
    Histogram,
    ServerTokens,
    parse_metrics,
    parse_server_tokens,
    parse_snapshot,
)

BOUNDS = (0.01, 0.02, 0.04, 0.08, math.inf)


def page(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def token_page(prompt: dict[str, float], generation: dict[str, float], cached: bool) -> str:
    """A ``/metrics`` page with vLLM's token counters per engine, amid other metrics."""
    registry = CollectorRegistry()
    gauge = Gauge("vllm:num_requests_running", "", ["engine"], registry=registry)
    # prometheus_client appends ``_total`` to a counter's samples.
    p = Counter(PROMPT_TOKENS.removesuffix("_total"), "", ["engine"], registry=registry)
    g = Counter(GENERATION_TOKENS.removesuffix("_total"), "", ["engine"], registry=registry)
    c = Counter(CACHED_TOKENS.removesuffix("_total"), "", ["engine"], registry=registry)
    for engine, value in prompt.items():
        gauge.labels(engine).set(1)
        p.labels(engine).inc(value)
        if cached:
            c.labels(engine).inc(value / 2)
    for engine, value in generation.items():
        g.labels(engine).inc(value)
    return page(registry)


# --- Gauges and counters ----------------------------------------------------------------------


def test_parse_metrics_sums_label_sets_and_takes_the_fullest_cache() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} 3\n'
        'vllm:num_requests_running{engine="1"} 4\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1"} 0.75\n'
        'vllm:num_requests_waiting{engine="0"} NaN\n'
    )
    wanted = ["vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"]
    assert parse_metrics(text, wanted) == {
        "vllm:num_requests_running": 7,
        "vllm:kv_cache_usage_perc": 0.75,
    }
    assert parse_metrics(text, ["vllm:absent"]) == {}


def test_parse_metrics_refuses_text_that_is_not_prometheus() -> None:
    with pytest.raises(ValueError):
        parse_metrics("<html>not metrics</html>\n", ["vllm:num_requests_running"])


def test_server_tokens_sum_every_engine() -> None:
    text = token_page({"0": 100, "1": 50}, {"0": 7, "1": 3}, cached=True)
    assert parse_server_tokens(text) == ServerTokens(prompt=150, cached=75, generation=10)


def test_server_tokens_without_the_cached_counter_count_none_cached() -> None:
    text = token_page({"0": 100}, {"0": 7}, cached=False)
    assert parse_server_tokens(text) == ServerTokens(prompt=100, cached=0, generation=7)


def test_a_page_without_the_token_counters_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt_tokens_total"):
        parse_server_tokens(token_page({}, {"0": 7}, cached=False))
    with pytest.raises(ValueError, match="generation_tokens_total"):
        parse_server_tokens("vllm:num_requests_running 1\n")


def test_token_deltas_count_a_restarted_counter_from_zero() -> None:
    before, after = ServerTokens(100, 10, 50), ServerTokens(130, 10, 20)
    # Prompt grew by 30; generation went down (a restart): all of its 20 since then count.
    assert after.since(before) == ServerTokens(30, 0, 20)
    assert before.plus(after) == ServerTokens(230, 20, 70)


# --- Histograms -------------------------------------------------------------------------------


def cumulative(*per_bucket: float, total: float = 0.0) -> Histogram:
    counts, running = [], 0.0
    for c in per_bucket:
        running += c
        counts.append(running)
    return Histogram(BOUNDS, tuple(counts), total)


def test_quantiles_are_promql_histogram_quantile() -> None:
    h = cumulative(0, 100, 0, 0, 0)
    assert h.quantile(0.5) == pytest.approx(0.015)  # linear inside (10 ms, 20 ms]
    assert cumulative(0, 0, 0, 0, 5).quantile(0.95) == 0.08  # +Inf: the highest finite bound
    assert cumulative(0, 0, 0, 0, 0).quantile(0.95) is None
    slow_tail = cumulative(0, 90, 0, 10, 0)
    assert slow_tail.quantile(0.95, drop_top=10) <= 0.02 < slow_tail.quantile(0.95)
    assert slow_tail.quantile(0.5, drop_top=100) is None


def test_window_deltas_sums_and_means() -> None:
    earlier = cumulative(10, 0, 0, 0, 0, total=0.05)
    later = cumulative(10, 0, 4, 0, 0, total=0.17)
    window = later.minus(earlier)
    assert window.counts == (0, 0, 4, 4, 4) and window.total == pytest.approx(0.12)
    assert window.mean == pytest.approx(0.03)
    assert later.minus(None) == later
    assert earlier.minus(later) == earlier  # a counter reset: everything since the restart
    other_bounds = Histogram((0.5, math.inf), (1, 1))
    assert later.minus(other_bounds) == later
    assert earlier.plus(window) == later
    assert Histogram(BOUNDS, (0,) * 5).mean is None


def test_snapshot_reads_every_engine_and_the_older_tpot_name() -> None:
    registry = CollectorRegistry()

    def histogram(name: str) -> PromHistogram:
        return PromHistogram(name, "", ["engine"], buckets=BOUNDS[:-1], registry=registry)

    tpot = histogram("vllm:time_per_output_token_seconds")  # servers before vLLM 0.32
    ttft = histogram("vllm:time_to_first_token_seconds")
    request_tpot = histogram("vllm:request_time_per_output_token_seconds")
    running = Gauge("vllm:num_requests_running", "", ["engine"], registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "", ["engine"], registry=registry)
    for engine in ("0", "1"):
        for _ in range(5):
            tpot.labels(engine).observe(0.03)
        ttft.labels(engine).observe(0.05)
        request_tpot.labels(engine).observe(0.015)
        running.labels(engine).set(2)
        waiting.labels(engine).set(1)
    snap = parse_snapshot(page(registry), at=7.0)
    assert (snap.at, snap.running, snap.waiting) == (7.0, 4, 2)
    assert snap.tpot is not None and snap.tpot.bounds == BOUNDS
    assert snap.tpot.count == 10 and snap.tpot.mean == pytest.approx(0.03)
    assert snap.ttft is not None and snap.ttft.count == 2
    assert snap.request_tpot is not None and snap.request_tpot.quantile(0.5) == pytest.approx(0.015)


def test_snapshot_prefers_the_current_tpot_name_and_leaves_the_rest_unmeasured() -> None:
    registry = CollectorRegistry()
    new = PromHistogram(
        "vllm:inter_token_latency_seconds", "", buckets=BOUNDS[:-1], registry=registry
    )
    old = PromHistogram(
        "vllm:time_per_output_token_seconds", "", buckets=BOUNDS[:-1], registry=registry
    )
    new.observe(0.015)
    old.observe(0.07)
    old.observe(0.07)
    snap = parse_snapshot(page(registry), at=0.0)
    assert snap.tpot is not None and snap.tpot.count == 1
    assert snap.ttft is None and snap.request_tpot is None
    assert (snap.running, snap.waiting) == (0.0, 0.0)


def test_a_snapshot_without_a_tpot_histogram_is_refused() -> None:
    with pytest.raises(ValueError, match="inter_token_latency"):
        parse_snapshot("vllm:num_requests_running 1\n", at=0.0)
