"""``offpeak bench colocate --trace FILE``: the co-serving benchmark with a production trace as
the real-time load instead of Poisson phases (``bench.trace``).

The legs are ``bench.colocate``'s (real-time alone, + batch with the lane off, + the lane,
batch alone), each on the same replay (other prompt token ids per leg, so no leg hits another's
prefix cache). Scaling: prompts × ``token_scale`` (default ``TOKEN_SCALE``), replies ×
``reply_scale``, and, unless given, a ``time_scale`` that puts the slice's mean arrival rate at
``load ×`` the real-time capacity the step model measured on this server gives for those token
counts. Figures per leg over the whole replay and per window (``bench.replay_stats``): p95 TTFT
and TPOT with bootstrap 95% intervals, batch tokens/s, harvest against the step model's bound
at the lane's TPOT target; ``met`` holds leg (c) to the targets (``bench.slo``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from bench import harness, trace_projection
from bench.colocate import (
    MAX_NUM_SEQS,
    Leg,
    _wait_idle,
    co_serving,
    lane_tpot_model,
    run_leg,
)
from bench.replay_stats import MIN_REQUESTS, add_bounds, leg_figures, verdict, windows_by_requests
from bench.slo import Slo
from bench.trace import (
    Replay,
    ReplayLoad,
    default_time_scale,
    read_trace,
    scale,
    slice_rate,
    trace_slice,
)
from offpeak.lane_settings import LaneSettings
from offpeak.settings import Settings

#: Prompt tokens × this: the Azure code trace's mean prompt (2,048 tokens) becomes about 100,
#: its longest (7,437) 372; on this CPU a prefill costs about 2.4 ms per token, so a
#: 2,048-token one would hold every real-time user for 5 s.
TOKEN_SCALE = 0.05
#: The slice's mean arrival rate as a fraction of the real-time capacity (default time scale).
LOAD = 0.5
#: The server's context window (``bench.servers.VllmServe``).
MAX_MODEL_LEN = 2048


def plan(
    trace_path: Path,
    requests: int,
    start_s: float,
    token_scale: float,
    reply_scale: float,
    time_scale: float | None,
    capacity: Any,
    load: float = LOAD,
) -> Replay:
    """The replay: ``requests`` of the trace from ``start_s``, scaled; without ``time_scale``,
    the one that puts its mean rate at ``load × capacity(mean prompt, mean reply)`` (the
    server's real-time requests/s for those token counts)."""
    chosen = trace_slice(read_trace(trace_path), start_s, requests)
    if len(chosen) < 2:
        raise ValueError(f"{trace_path}: fewer than two requests from {start_s} s")
    if time_scale is None:
        shaped = scale(chosen, source=str(trace_path), start_s=start_s, time_scale=1.0,
                       token_scale=token_scale, reply_scale=reply_scale,
                       max_model_len=MAX_MODEL_LEN)  # fmt: skip
        cap = capacity(shaped.mean_prompt(), shaped.mean_reply())
        time_scale = default_time_scale(slice_rate(chosen), cap, load)
    return scale(chosen, source=str(trace_path), start_s=start_s, time_scale=time_scale,
                 token_scale=token_scale, reply_scale=reply_scale,
                 max_model_len=MAX_MODEL_LEN)  # fmt: skip


def run(
    trace_path: Path,
    *,
    requests: int = 250,
    start_s: float = 0.0,
    time_scale: float | None = None,
    token_scale: float = TOKEN_SCALE,
    reply_scale: float = 1.0,
    window_count: int = 10,
    load: float = LOAD,
    lane: LaneSettings | None = None,
    out_dir: Path | None = None,
    plot: Path | None = Path("docs/colocate-trace.png"),
    seed: int = 0,
    server_url: str | None = None,
    quick: bool = False,
) -> dict[str, Any]:
    """The four legs on one replay; prints the table, writes ``colocate-trace.json`` and the
    timeline plot (skipped, with a message, without matplotlib). ``quick``: two calibration
    sizes and 300 batch lines (a smoke test; pass few ``requests`` too)."""
    lane = lane or Settings().scheduler.lane
    # Enough lines that legs (b), (c) and (d) never run out of batch work.
    with co_serving(quick, seed, server_url, lane, 300 if quick else 6000) as bench:
        shared, step = bench.shared, bench.step
        floor = lane_tpot_model(lane, step.step_seconds(1))
        replay = plan(trace_path, requests, start_s, token_scale, reply_scale, time_scale,
                      lambda p, r: shared.capacity(floor, p, r), load)  # fmt: skip
        harness.console.print(
            f"replay: {replay.count} requests of {trace_path.name} from {start_s:g} s, time × "
            f"{replay.time_scale:.3g}, prompts × {token_scale:g}, replies × {reply_scale:g}: "
            f"{replay.duration:.0f} s, {replay.rate():.2f} req/s, {replay.mean_prompt():.0f} + "
            f"{replay.mean_reply():.0f} tokens each ({replay.clipped} prompts clipped)"
        )
        if replay.count < MIN_REQUESTS:
            harness.console.print(
                f"[yellow]{replay.count} real-time requests per leg: fewer than {MIN_REQUESTS}, "
                "so a p95 is a few requests' latency[/yellow]"
            )
        legs: dict[str, Leg] = {}
        alone_s = batch_alone_seconds(replay)
        for name, leg_load, leg_settings, pre in bench.plan("replay", None):
            _wait_idle(bench.base)
            harness.console.print(f"leg ({name}) …")
            if leg_load is None:  # (d) batch alone, a tenth of the replay
                load_, horizon = _NoLoad(), alone_s
            else:
                # The pre-roll replays the slice's start (other ids) while the lane learns.
                head = [r for r in replay.requests if r.at < pre]
                load_ = _Chain(
                    ReplayLoad(bench.base, bench.name, head, seed + 1000 + ord(name)),
                    ReplayLoad(bench.base, bench.name, replay.requests, seed + ord(name), pre),
                )
                horizon = pre + replay.duration
            legs[name] = run_leg(name, load_, horizon, leg_settings,
                                 bench.engine if leg_settings else None, step, pre)  # fmt: skip
    result = _result(bench, replay, legs, lane, window_count, seed)
    whole = read_trace(trace_path)
    result["gpu_projection"] = trace_projection.project(
        slice_rate(whole),
        sum(r.prompt for r in whole) / len(whole),
        sum(r.reply for r in whole) / len(whole),
        lane.tpot_ratio,
        result["harvest_c"],
    )
    _print(result)
    path = harness.write_result("colocate-trace", result, out_dir)
    harness.console.print(f"wrote {path}")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        harness.console.print("no timeline plot: matplotlib is not installed (the JSON has it)")
    elif plot is not None:
        from bench.plot import draw_colocate_trace

        draw_colocate_trace(result, plot)
        harness.console.print(f"wrote {plot}")
    return result


def batch_alone_seconds(replay: Replay) -> float:
    """Leg (d)'s length: a tenth of the replay, at least 30 s."""
    return max(30.0, replay.duration / 10)


class _NoLoad:
    records: list[Any] = []

    def start(self, t0: float) -> None:
        pass

    def join(self, timeout: float) -> None:
        pass


class _Chain:
    """Two loads started together (each keeps its own arrival times); their records joined."""

    def __init__(self, *loads: ReplayLoad) -> None:
        self.loads = loads

    def start(self, t0: float) -> None:
        for load in self.loads:
            load.start(t0)

    def join(self, timeout: float) -> None:
        for load in self.loads:
            load.join(timeout)

    @property
    def records(self) -> list[Any]:
        return [r for load in self.loads for r in load.records]


def _result(bench: Any, replay: Replay, legs: dict[str, Leg], lane: LaneSettings,
            window_count: int, seed: int) -> dict[str, Any]:  # fmt: skip
    shared = bench.shared
    spans = windows_by_requests([r.at for r in replay.requests], replay.duration, window_count)
    figures = {
        k: leg_figures(
            v.records, v.finished, spans if k != "d" else [(0.0, batch_alone_seconds(replay))], seed
        )
        for k, v in legs.items()
    }
    ran = legs["d"].lines or legs["b"].lines
    batch_prompt = sum(p for p, _ in ran) / len(ran) if ran else 0.0
    batch_reply = max(1.0, sum(t for _, t in ran) / len(ran)) if ran else 1.0
    alone_step = shared.mean_step(replay.rate(), replay.mean_prompt(), replay.mean_reply())
    lane_target = lane_tpot_model(lane, alone_step)

    def bound(rate: float, prompt: float, reply: float) -> float:
        return shared.bound(lane_target, rate, prompt, reply, batch_prompt, batch_reply)[1]

    add_bounds(figures["c"], replay.requests, bound)
    slo = Slo.of(lane)
    judged = verdict(slo, figures["a"], figures["c"],
                     figures["d"]["whole"]["batch_output_tokens_per_s"])  # fmt: skip
    return {
        "benchmark": "colocate-trace",
        "machine": bench.machine,
        "load_average_end": harness.load_average(),
        "params": {
            **replay.params(),
            "windows": window_count,
            "max_num_seqs": MAX_NUM_SEQS,
            "server_start_s": bench.start_s,
            "lane": lane.model_dump(),
            "slo": slo.as_dict(),
            "seed": seed,
        },  # fmt: skip
        "step_model": bench.calibration,
        "batch_line_tokens": {"uncached_prompt": batch_prompt, "reply": batch_reply},
        "lane_tpot_target_model_s": lane_target,
        "legs": figures,
        "errors": {k: v.error for k, v in legs.items() if v.error},
        **judged,
        "timelines": {
            k: {
                "realtime": [[r.at, r.ttft, r.tpot] for r in v.records if r.ttft is not None],
                "batch_tokens": [[at, t] for at, t in v.finished],
                "lane": v.decisions,
            }
            for k, v in legs.items()
        },
    }


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1000 * x:,.0f}"


def _p95(cell: dict[str, Any]) -> str:
    if cell["p95"] is None:
        return "n/a"
    return f"{_ms(cell['p95'])} [{_ms(cell['lo'])}–{_ms(cell['hi'])}]"


def _print(result: dict[str, Any]) -> None:
    rows = []
    for leg, figures in result["legs"].items():
        for label, r in [("whole", figures["whole"])] + [
            (f"w{i + 1}", w) for i, w in enumerate(figures["windows"] if leg != "d" else [])
        ]:
            rows.append([
                f"({leg}) {label}", r["requests_served"], _p95(r["ttft"]), _p95(r["tpot"]),
                f"{r['batch_output_tokens_per_s']:.1f}",
                f"{r['bound_tokens_per_s']:.1f}" if "bound_tokens_per_s" in r else "",
            ])  # fmt: skip
    t = result["targets_whole_s"]
    harness.print_table(
        f"co-serving on a trace replay ({Slo(**result['params']['slo']).describe()}: TTFT p95 ≤ "
        f"{_ms(t['ttft'])} ms, TPOT p95 ≤ {_ms(t['tpot'])} ms; load "
        f"{result['machine']['load_average']})",
        ["leg / window", "served", "TTFT p95 ms [95% CI]", "TPOT p95 ms [95% CI]",
         "batch tok/s", "bound tok/s"],
        rows,
    )  # fmt: skip
    g = result.get("gpu_projection")
    if g:
        harness.console.print(
            f"on paper, {g['model']} on one {g['gpu']['name']}, the whole trace unscaled "
            f"({g['trace']['rate_per_s']:.2f} req/s): real-time load "
            f"{g['realtime_load_fraction']:.0%}, step {1000 * g['mean_step_alone_s']:.1f} ms "
            f"alone, lane target {1000 * g['lane_tpot_target_s']:.1f} ms, bound "
            f"{g['bound_batch_tokens_per_s']:,.0f} batch tokens/s, × measured harvest: "
            f"{g['projected_batch_tokens_per_s'] or 0:,.0f}"
        )
    harness.console.print(
        f"harvest (c) = {result['harvest_c']}, windows inside "
        f"{result['windows_inside_share']:.0%} of {result['windows_judged']}, met: {result['met']}"
    )
