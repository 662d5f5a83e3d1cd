"""Replaying a request trace as real-time load: reading the Splitwise/Azure CSV, slicing and
scaling it, the requests the replay sends, and the figures and verdict of its legs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.colocate_trace import plan
from bench.realtime import RtRecord
from bench.replay_stats import (
    add_bounds,
    leg_figures,
    p95_interval,
    verdict,
    windows,
    windows_by_requests,
)
from bench.slo import Slo
from bench.trace import (
    MIN_REPLY,
    ReplayLoad,
    TraceRequest,
    default_time_scale,
    read_trace,
    scale,
    slice_rate,
    trace_slice,
)

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:04.0000000,100,10
2023-11-16 18:17:03.9799600,4808,1
2023-11-16 18:17:05.5000000,60,40
2023-11-16 18:17:07.0000000,3000,3000
"""


@pytest.fixture
def trace_csv(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(CSV)
    return path


def test_reads_the_azure_format_in_arrival_order(trace_csv: Path) -> None:
    trace = read_trace(trace_csv)
    assert [r.prompt for r in trace] == [4808, 100, 60, 3000]
    assert trace[0].at == 0.0 and trace[1].at == pytest.approx(0.02004)
    assert trace[3].at == pytest.approx(3.02004)


def test_a_file_without_the_columns_or_with_a_bad_row_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="ContextTokens"):
        read_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04,x,3\n")
    with pytest.raises(ValueError, match=":2:"):
        read_trace(bad)


def test_slices_and_scales_time_and_tokens(trace_csv: Path) -> None:
    chosen = trace_slice(read_trace(trace_csv), start_s=0.01, count=2)
    assert [r.prompt for r in chosen] == [100, 60]
    assert chosen[0].at == pytest.approx(0.01004)
    replay = scale(chosen, source="t", start_s=0.01, time_scale=4.0, token_scale=0.05,
                   reply_scale=0.5, max_model_len=2048)  # fmt: skip
    assert [(r.prompt, r.reply) for r in replay.requests] == [(5, 5), (3, 20)]
    assert replay.requests[1].at == pytest.approx(4 * (1.52004 - 0.01))
    assert replay.params()["time_scale"] == 4.0 and replay.clipped == 0


def test_scaling_keeps_a_tpot_and_the_context_window(trace_csv: Path) -> None:
    replay = scale(read_trace(trace_csv), source="t", start_s=0.0, time_scale=1.0,
                   token_scale=1.0, reply_scale=1.0, max_model_len=2048)  # fmt: skip
    by_prompt = {r.prompt: r.reply for r in replay.requests}
    assert by_prompt[2046] == MIN_REPLY  # 4,808 + 1 tokens: the reply at MIN_REPLY, prompt cut
    assert max(r.prompt + r.reply for r in replay.requests) <= 2048
    assert replay.clipped == 2
    with pytest.raises(ValueError):
        scale([], source="t", start_s=0, time_scale=0, token_scale=1, reply_scale=1,
              max_model_len=10)  # fmt: skip


def test_default_time_scale_puts_the_mean_rate_at_the_load(trace_csv: Path) -> None:
    chosen = read_trace(trace_csv)
    assert slice_rate(chosen) == pytest.approx(4 / 3.02004)
    # 4 requests in 3.02 s against a capacity of 2 requests/s at half load: stretch to 1/s.
    assert default_time_scale(slice_rate(chosen), 2.0, 0.5) == pytest.approx(4 / 3.02004)
    replay = plan(trace_csv, 4, 0.0, 0.05, 1.0, None, lambda prompt, reply: 2.0, load=0.5)
    assert replay.rate() == pytest.approx(4 / (3.02004 * replay.time_scale))
    assert replay.requests[-1].at == pytest.approx(3.02004 * replay.time_scale)
    with pytest.raises(ValueError):
        default_time_scale(1.0, 0.0, 0.5)


def test_the_replay_sends_each_request_at_its_time_with_its_token_counts() -> None:
    bodies: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        bodies.append(body)
        chunks = [{"choices": [{"text": "x"}]} for _ in range(body["max_tokens"])]
        chunks.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    requests = [TraceRequest(0.0, 7, 3), TraceRequest(0.02, 2, 5)]
    load = ReplayLoad("http://rt", "m", requests, seed=1, offset=0.01,
                      transport=httpx.MockTransport(answer))  # fmt: skip
    load.start(0.0)
    load.join(30)
    assert [r.at for r in load.records] == [0.01, 0.03]
    assert [len(b["prompt"]) for b in bodies] == [7, 2]  # type: ignore[arg-type]
    assert all(b["min_tokens"] == b["max_tokens"] and b["ignore_eos"] for b in bodies)
    assert [r.tokens for r in load.records] == [3, 5]
    assert all(r.ttft is not None and r.tpot is not None for r in load.records)
    other = ReplayLoad("http://rt", "m", requests, seed=2, transport=httpx.MockTransport(answer))
    other.start(0.0)
    other.join(30)
    assert bodies[2]["prompt"] != bodies[0]["prompt"]  # another leg: no prefix-cache hit


def _records(ttfts: list[float], at_step: float) -> list[RtRecord]:
    return [RtRecord(i * at_step, ttft=t, tpot=t / 10) for i, t in enumerate(ttfts)]


def test_p95_interval_brackets_the_p95() -> None:
    values = list(np.linspace(0.1, 1.0, 200))
    cell = p95_interval(values, np.random.default_rng(0))
    assert cell["lo"] <= cell["p95"] <= cell["hi"] and cell["n"] == 200  # type: ignore[operator]
    assert p95_interval([], np.random.default_rng(0))["p95"] is None


def test_figures_per_window_bounds_and_verdict() -> None:
    spans = windows(10.0, 2)
    assert spans == [(0.0, 5.0), (5.0, 10.0)]
    alone = leg_figures(_records([0.1] * 10, 1.0), [], spans, seed=0)
    # With batch work: the first window 1.2x as slow, the second 2x.
    lane_records = _records([0.12] * 5 + [0.2] * 5, 1.0)
    lane = leg_figures(lane_records, [(1.0, 50), (6.0, 30), (10.0, 20)], spans, seed=0)
    assert [w["requests_served"] for w in lane["windows"]] == [5, 5]
    assert lane["windows"][1]["batch_output_tokens_per_s"] == pytest.approx(10.0)
    assert lane["whole"]["batch_output_tokens_per_s"] == pytest.approx(10.0)
    plan_ = [TraceRequest(float(i), 10, 20) for i in range(10)]
    add_bounds(lane, plan_, lambda rate, prompt, reply: 20.0 if rate else 0.0)
    assert lane["whole"]["bound_tokens_per_s"] == pytest.approx(20.0)
    assert lane["whole"]["harvest"] == pytest.approx(0.5)
    judged = verdict(Slo(1.5, 1.5), alone, lane)
    assert judged["windows_inside_share"] == 0.5
    assert judged["met"] == {
        "c_inside_targets_whole_replay": False, "c_inside_targets_ge_90pct_windows": False,
        "c_harvest_ge_70pct": False, "ge_200_requests_per_leg": False,
    }  # fmt: skip
    loose = verdict(Slo(2.5, 2.5), alone, lane)["met"]
    assert loose["c_inside_targets_whole_replay"] and loose["c_inside_targets_ge_90pct_windows"]


def test_gpu_projection_scales_the_bound_by_the_measured_harvest() -> None:
    from bench.trace_projection import project

    low, high = project(2.6, 2048, 28, 1.5, 0.8), project(2.6, 2048, 28, 2.4, None)
    step = low["step_model_s"]
    # Llama 3.1 8B bf16 on 3.35 TB/s at 75%: 16 GB of weights read in 6.4 ms a step.
    assert step["base_s"] == pytest.approx(2 * 8.03e9 / (3.35e12 * 0.75))
    assert 0 < low["realtime_load_fraction"] < 1
    assert low["projected_batch_tokens_per_s"] == pytest.approx(
        0.8 * low["bound_batch_tokens_per_s"]
    )
    assert high["bound_batch_tokens_per_s"] > low["bound_batch_tokens_per_s"] > 0
    assert high["projected_batch_tokens_per_s"] is None


def test_windows_by_requests_split_a_burst_and_a_quiet_stretch_evenly() -> None:
    # Four requests spread over 80 s, then eight in a 2 s burst.
    arrivals = [0.0, 20.0, 40.0, 60.0] + [100 + 0.25 * i for i in range(8)]
    spans = windows_by_requests(arrivals, 110.0, 3)
    counts = [sum(a <= t < b for t in arrivals) for a, b in spans]
    assert counts == [4, 4, 4]
    assert spans[0][0] == 0.0 and spans[-1][1] == 110.0
    assert spans[0][1] == pytest.approx(80.0)  # halfway between 60 and 100
    # Never more windows than requests.
    assert len(windows_by_requests([1.0, 2.0], 3.0, 10)) == 2
