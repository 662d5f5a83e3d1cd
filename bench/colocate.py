"""Benchmark: co-serving batch work through a real-time vLLM server.

One real ``vllm serve`` (CPU, the default model, float32, ``--scheduling-policy priority``) is
the real-time server. A load generator of our own sends it open-loop Poisson arrivals of
*streaming* chat requests and measures each one's TTFT and TPOT at the client, in three phases:
quiet, busy (near the server's real-time capacity), quiet. Four legs in one run:

(a) real-time alone;
(b) real-time + an Offpeak remote engine with the lane controller off (``max_num_seqs`` batch
    requests in flight: what a naive setup does);
(c) real-time + Offpeak with the lane controller at its defaults;
(d) batch alone: the server's batch capacity.

The step model is measured on the same server at the start: a decode step of ``base +
per_seq × batch`` ms (concurrent streaming requests, client-measured TPOT,
``workers.calibration.fit_step_model``) and a prefill cost per prompt token (the latency of
one-token completions of uncached prompts of two lengths). On this CPU prefill is what a
request costs the others (measured: 60 ms + 2.7 ms per sequence a decode step, about 2 ms per
prompt token of prefill), so both enter the yardsticks (``SharedStep``): the real-time capacity
(the arrival rate at which the mean step reaches the TPOT floor) and, per phase, the bound: the
batch tokens/s the model allows beside that phase's real-time arrivals while the mean step stays
at the lane's TPOT target, each batch line bringing its measured uncached prompt and reply.

Targets (the defaults of ``LaneSettings``): TTFT p95 and TPOT p95 at most ``ratio ×`` leg (a)'s
quiet-phase p95 (the real-time latency with no batch work); in (c) inside them in every phase
and batch tokens/s ≥ 70% of the bound.

The Offpeak side is the real runner (``workers.runner.Runner``) with the real remote engine
(``workers.engine.remote``) on a scratch PostgreSQL database, its batch submitted through the
API and validated by the control worker; the runner runs in this process rather than as a
Celery engine worker so that one clock times the batch tokens, the lane's decisions and the
real-time requests (the code is the engine worker's; only the process differs).
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench import harness
from bench.generator import chat_requests, write_jsonl
from bench.realtime import (
    RT_REPLY,
    RealtimeLoad,
    RtRecord,
    calibrate_server,
    measure_prefill,
    prompt_tokens,
)
from bench.servers import VllmServe, free_port
from bench.slo import Slo
from offpeak.lane_settings import LaneSettings
from offpeak.settings import DEFAULT_MODEL, ModelConfig, SchedulerSettings, Settings

#: The server's sequence limit: the naive leg (b) keeps this many batch requests in flight. On
#: this 2-core CPU a step with 32 sequences already takes several times a single one's.
MAX_NUM_SEQS = 32
#: Finer histogram buckets than vLLM's defaults around CPU step times (10-500 ms), so the lane's
#: windowed p95s are not rounded to a 50 ms-wide bucket.
ITL_BUCKETS = [
    *(x / 1000 for x in range(10, 200, 10)),
    *(x / 1000 for x in range(200, 600, 25)),
    0.75, 1.0, 2.5, 5.0,
]  # fmt: skip
TTFT_BUCKETS = [*(x / 1000 for x in range(25, 500, 25)), *(x / 10 for x in range(5, 30, 2)), 5.0]
#: ``vllm serve``'s arguments beyond the shared ones (``bench.servers.VllmServe``).
SERVE_ARGS = (
    "--max-num-seqs", str(MAX_NUM_SEQS),
    "--custom-histogram-buckets",
    json.dumps({"inter_token_latency": ITL_BUCKETS, "time_to_first_token": TTFT_BUCKETS}),
)  # fmt: skip
#: Real-time rates as fractions of the measured real-time capacity.
QUIET, BUSY = 0.2, 0.75
TARGET_HARVEST = 0.70
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SharedStep:
    """The bench's yardstick for a server whose steps every sequence shares: a decode step of
    ``base_s + per_seq_s × running`` seconds plus ``prefill_s_per_token`` for each prompt token
    prefilled, prefill mixed into the same steps (vLLM's scheduler). The mean step ``s`` with
    real-time arrivals ``rate``/s (``prompt`` tokens, ``reply`` tokens each) and ``batch`` batch
    lines in flight (``batch_prompt`` uncached prompt tokens, ``batch_reply`` tokens each) solves
    ``s = base + per_seq × (rate × reply × s + batch) + prefill × (rate × prompt × s + batch ×
    batch_prompt / batch_reply)`` (Little's law: a request holds a sequence for ``reply`` steps;
    a batch line is replaced every ``batch_reply`` steps). With ``prefill_s_per_token`` 0 it is
    ``workers.lane.controller``'s decode-only model."""

    base_s: float
    per_seq_s: float
    prefill_s_per_token: float

    def _load(self, rate: float, prompt: float, reply: float) -> float:
        return rate * (self.per_seq_s * reply + self.prefill_s_per_token * prompt)

    def mean_step(self, rate: float, prompt: float, reply: float, batch: float = 0.0,
                  batch_prompt: float = 0.0, batch_reply: float = 1.0) -> float:  # fmt: skip
        """Seconds; ``inf`` when the real-time arrivals alone saturate the server."""
        free = 1.0 - self._load(rate, prompt, reply)
        if free <= 0:
            return math.inf
        per_line = self.per_seq_s + self.prefill_s_per_token * batch_prompt / batch_reply
        return (self.base_s + batch * per_line) / free

    def capacity(self, target: float, prompt: float, reply: float) -> float:
        """Real-time requests/s at which the mean step reaches ``target`` seconds."""
        return (1.0 - self.base_s / target) / (
            self.per_seq_s * reply + self.prefill_s_per_token * prompt
        )

    def bound(self, target: float, rate: float, prompt: float, reply: float,
              batch_prompt: float, batch_reply: float) -> tuple[float, float]:  # fmt: skip
        """``(batch lines, batch tokens/s)`` the model allows beside the arrivals with the mean
        step at ``target`` seconds: each line makes one token per step."""
        per_line = self.per_seq_s + self.prefill_s_per_token * batch_prompt / batch_reply
        lines = (target * (1.0 - self._load(rate, prompt, reply)) - self.base_s) / per_line
        lines = max(0.0, lines)
        return lines, lines / target


def lane_tpot_model(lane: LaneSettings, alone_step: float) -> float:
    """Seconds: the lane's TPOT target on its own reading (the mean step), modelled: the
    absolute target, else ``ratio ×`` the mean step of real-time work alone (what the lane
    measures as its baseline)."""
    if lane.tpot_p95_ms is not None:
        return lane.tpot_p95_ms / 1000
    return lane.tpot_ratio * alone_step


# --- Offpeak's side ---------------------------------------------------------------------------


class CountingEngine:
    """Wraps the remote engine, timing each finished line's completion tokens."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.finished: list[tuple[float, int]] = []
        #: Per finished line: (uncached prompt tokens, completion tokens).
        self.lines: list[tuple[int, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> list[Any]:
        results = self._engine.step()
        now = time.perf_counter()
        for r in results:
            tokens = sum(len(c.token_ids) for c in r.completions)
            self.finished.append((now, tokens))
            self.lines.append((r.prompt_tokens - r.cached_tokens, tokens))
        return results


def run_batch_side(
    settings: Settings, engine: CountingEngine, stop_at: float, step_model: Any
) -> tuple[Any, list[Any], str | None]:
    """The runner against the scratch database until ``stop_at`` (perf_counter), then stopped
    (its lines go back to pending); returns its stats, its lane decisions and any error."""
    from workers import lifecycle
    from workers.runner import Runner

    runner = Runner(settings, engine, "bench-colocate", device="cpu", step_model=step_model)
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["stats"] = runner.run(until=lambda: time.perf_counter() >= stop_at)
        except Exception as exc:  # reported in the result, the leg's numbers still count
            box["error"] = repr(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    while thread.is_alive() and time.perf_counter() < stop_at:
        time.sleep(0.2)
    lifecycle.request_stop()
    thread.join(60)
    lifecycle.reset()
    if runner.lane_metrics is not None and hasattr(runner.lane_metrics, "close"):
        runner.lane_metrics.close()
    return box.get("stats"), list(runner.lane_decisions), box.get("error")


# --- Legs and phases ----------------------------------------------------------------------------


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 95, 99)}


@dataclass
class Leg:
    name: str
    records: list[RtRecord] = field(default_factory=list)
    finished: list[tuple[float, int]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    #: Per finished batch line: (uncached prompt tokens, completion tokens).
    lines: list[tuple[int, int]] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0


def phase_load(
    base: str, model: str, phases: list[tuple[float, float, float]], seed: int, pre_roll: float
) -> tuple[RealtimeLoad, float]:
    """Poisson phases as a leg's real-time load, shifted by ``pre_roll`` seconds of the first
    phase's rate; ``(load, seconds until its last arrival)``."""
    seeded = [(s + pre_roll, e + pre_roll, r, seed + i) for i, (s, e, r) in enumerate(phases)]
    if pre_roll:
        seeded.insert(0, (0.0, pre_roll, phases[0][2], seed + 1000))
    horizon = max(end for _, end, _, _ in seeded)
    return RealtimeLoad(base, model, [p for p in seeded if p[2] > 0]), horizon


def run_leg(
    name: str,
    load: Any,
    horizon: float,
    batch_settings: Settings | None,
    engine: Any | None,
    step_model: Any,
    pre_roll: float = 0.0,
) -> Leg:
    """One leg: the real-time ``load`` (``start(t0)``, ``join``, ``records``) for ``horizon``
    seconds beside the batch side (none without ``batch_settings``). With ``pre_roll`` seconds,
    the batch side starts that long before the measured part, beside real-time traffic (the lane
    learns its baselines once per deployment, not per phase); times are reported from the
    measured part's start (the pre-roll negative)."""
    leg = Leg(name)
    t0 = time.perf_counter()
    load.start(t0)
    if batch_settings is not None and engine is not None:
        counting = CountingEngine(engine)
        _stats, decisions, leg.error = run_batch_side(
            batch_settings, counting, t0 + horizon, step_model
        )
        leg.finished = [(at - t0, tokens) for at, tokens in counting.finished]
        leg.lines = counting.lines
        leg.decisions = [
            {**{k: getattr(d, k) for k in (
                "limit", "action", "reason", "in_flight", "realtime_running", "waiting",
                "tpot_p95", "ttft_p95", "tpot_target", "ttft_target", "request_tpot_p95",
                "request_tpot_target")}}
            for d in decisions
        ]  # fmt: skip
    else:
        time.sleep(max(0.0, t0 + horizon - time.perf_counter()))
    load.join(90)
    for record in load.records:
        record.at -= pre_roll
    leg.finished = [(at - pre_roll, tokens) for at, tokens in leg.finished]
    leg.records = [r for r in load.records if r.at >= 0]
    leg.seconds = time.perf_counter() - t0
    return leg


def summarize(leg: Leg, phases: list[tuple[str, float, float]]) -> list[dict[str, Any]]:
    rows = []
    for label, start, end in phases:
        done = [r for r in leg.records if start <= r.at < end]
        ok = [r for r in done if r.error is None and r.ttft is not None]
        tokens = sum(t for at, t in leg.finished if start <= at < end)
        busy = sum(r.seconds for r in ok)
        rows.append({
            "phase": label, "seconds": end - start, "requests_sent": len(done),
            "requests_served": len(ok), "errors": len(done) - len(ok),
            "ttft": _pcts([r.ttft for r in ok if r.ttft is not None]),
            "tpot": _pcts([r.tpot for r in ok if r.tpot is not None]),
            "realtime_running_mean": busy / (end - start),
            "batch_output_tokens_per_s": tokens / (end - start),
        })  # fmt: skip
    return rows


def _wait_idle(base: str, timeout: float = 120) -> None:
    """Until the server runs and queues nothing (the last leg's aborted requests have gone)."""
    from workers.lane.scraper import PrometheusServer

    scraper = PrometheusServer(f"{base}/metrics", 1.0, 2.0, 10.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = scraper.scrape()
        if snap.running == 0 and snap.waiting == 0:
            return
        time.sleep(0.5)


@dataclass
class CoServing:
    """What every leg of a co-serving run shares: the real-time server at ``base``, its step
    model measured at the start, the scratch service holding the batch, the remote engine and
    the lane settings of leg (c)."""

    base: str
    name: str
    step: Any
    shared: SharedStep
    calibration: dict[str, Any]
    rt_prompt: int
    start_s: float
    machine: dict[str, Any]
    lane: LaneSettings
    service: Any = None
    engine: Any = None
    remote: ModelConfig | None = None

    def batch_settings(self, lane_on: bool) -> Settings:
        """The runner's settings: the scratch service's, the lane on (leg (c)) or off."""
        lane = self.lane.model_copy(update={"enabled": lane_on})
        service = self.service
        return Settings(
            database_url=service.database_url,
            broker_url=service.env["OFFPEAK_BROKER_URL"],
            data_dir=service.data_dir,
            queue_prefix=service.env["OFFPEAK_QUEUE_PREFIX"],
            models={self.name: self.remote},
            scheduler=SchedulerSettings(lane=lane),
            flush_seconds=1.0,
        )

    def plan(self, a: Any, c: Any) -> tuple[tuple[str, Any, Settings | None, float], ...]:
        """The four legs: name, real-time load (``a`` for (a)-(c), ``c`` nothing for (d)), the
        runner's settings, pre-roll seconds (the lane learns its baselines, then slow-starts)."""
        return (
            ("a", a, None, 0.0),
            ("b", a, self.batch_settings(False), 0.0),
            ("c", a, self.batch_settings(True), self.lane.learn_seconds + 10),
            ("d", c, self.batch_settings(False), 0.0),
        )


@contextlib.contextmanager
def co_serving(
    quick: bool, seed: int, server_url: str | None, lane: LaneSettings, lines: int
) -> Iterator[CoServing]:
    """The real-time server (started here unless ``server_url``), its step model, and a
    scratch service running a batch of ``lines`` chat lines, with the remote engine loaded."""
    from workers.engine import registry
    from workers.model_store import ensure_model
    from workers.planner import StepModel

    name = DEFAULT_MODEL
    settings = Settings()
    config = settings.models[name]
    model_dir = ensure_model(name, config, settings.model_cache_dir)
    machine = harness.machine()
    port = free_port()
    base = (server_url or f"http://127.0.0.1:{port}").rstrip("/")
    with tempfile.TemporaryDirectory(prefix="offpeak-colocate-") as tmp:
        folder = Path(tmp)
        log_path = folder / "vllm-serve.log"
        server = None if server_url else VllmServe(model_dir, name, port, log_path, SERVE_ARGS)
        if server is not None:
            server.start()
        try:
            harness.console.print(f"vllm serve on {base} …")
            start_s = server.wait_ready() if server is not None else 0.0
            harness.console.print("step model on the server …")
            calibration = calibrate_server(base, name, (1, 8) if quick else (1, 4, 8, 16))
            calibration["prefill"] = measure_prefill(base, name)
            calibration["realtime_prompt_tokens"] = rt_prompt = prompt_tokens(base, name)
            step = StepModel(calibration["base_ms"], calibration["per_seq_ms"])
            shared = SharedStep(step.base_ms / 1000, step.per_seq_ms / 1000,
                                calibration["prefill"]["prefill_s_per_token"])  # fmt: skip
            bench = CoServing(base, name, step, shared, calibration, rt_prompt, start_s, machine,
                              lane)  # fmt: skip
            batch_file = folder / "batch.jsonl"
            write_jsonl(chat_requests(lines, model=name, max_tokens=64, seed=seed), batch_file)
            bench.remote = ModelConfig(
                engine="remote", url=base, source=config.source, max_num_seqs=MAX_NUM_SEQS,
                max_model_len=2048,
            )  # fmt: skip
            with harness.scratch_service(
                {name: bench.remote.model_dump()}, roles=("control",)
            ) as service:
                bench.service = service
                batch = harness.create(service.client, harness.upload(service.client, batch_file))
                batch = harness.wait_status(
                    service.client, batch.id, ("in_progress",), stack=service.stack
                )
                if batch.status != "in_progress":
                    raise RuntimeError(f"the batch did not start: {batch.status} {batch.errors}")
                bench.engine = registry.load(bench.batch_settings(False), name)
                try:
                    yield bench
                finally:
                    registry.close_all()
        finally:
            if server is not None:
                server.stop()


def run(
    quick: bool = False,
    phase_seconds: float | None = None,
    out_dir: Path | None = None,
    plot: Path | None = Path("docs/colocate.png"),
    seed: int = 0,
    server_url: str | None = None,
    lane: LaneSettings | None = None,
) -> dict[str, Any]:
    """The four legs on one server; prints the table, writes ``colocate.json`` and the plot.
    ``server_url``: an already running server (started with ``--max-num-seqs 32
    --scheduling-policy priority``) instead of one started here. ``lane``: leg (c)'s lane
    settings and the targets (``bench.slo.bench_lane``; default: the environment's)."""
    from workers.planner import largest_batch

    phase = phase_seconds or (15.0 if quick else 60.0)
    lane = lane or Settings().scheduler.lane
    with co_serving(quick, seed, server_url, lane, 300 if quick else 3000) as bench:
        step, shared, rt_prompt = bench.step, bench.shared, bench.rt_prompt
        tpot_floor = lane_tpot_model(lane, step.step_seconds(1))
        floor_batch = largest_batch(step, 1.0 / tpot_floor, memory_limit=MAX_NUM_SEQS)
        mean_reply = sum(RT_REPLY) / 2
        # Prefill included: the decode-only model put it at 4.4 requests/s, where real-time
        # work alone queued for 30 s (measured).
        capacity = shared.capacity(tpot_floor, rt_prompt, mean_reply)
        labels = ("quiet", "busy", "quiet again")
        rates = (QUIET * capacity, BUSY * capacity, QUIET * capacity)
        phases = [(i * phase, (i + 1) * phase, r) for i, r in enumerate(rates)]
        named = [(lab, s, e) for lab, (s, e, _) in zip(labels, phases, strict=True)]
        harness.console.print(
            f"step {step.base_ms:.1f} ms + {step.per_seq_ms:.2f} ms/seq, prefill "
            f"{1000 * shared.prefill_s_per_token:.2f} ms/token ({rt_prompt} per real-time "
            f"prompt); TPOT floor {1000 * tpot_floor:.0f} ms; real-time capacity "
            f"{capacity:.2f} req/s"
        )
        legs: dict[str, Leg] = {}
        for leg_name, leg_phases, leg_settings, pre in bench.plan(phases, [(0.0, phase, 0.0)]):
            _wait_idle(bench.base)
            harness.console.print(f"leg ({leg_name}) …")
            load, horizon = phase_load(bench.base, bench.name, leg_phases, seed, pre)
            legs[leg_name] = run_leg(
                leg_name, load, horizon, leg_settings,
                bench.engine if leg_settings else None, step, pre,
            )  # fmt: skip
    yardstick = (shared, rt_prompt, mean_reply, rates)
    result = _result(legs, named, phase, step, bench.calibration, floor_batch, capacity,
                     bench.machine, bench.start_s, quick, yardstick, lane)  # fmt: skip
    _print(result)
    path = harness.write_result("colocate", result, out_dir)
    harness.console.print(f"wrote {path}")
    if plot is not None:
        from bench.plot import draw_colocate

        draw_colocate(result, plot)
        harness.console.print(f"wrote {plot}")
    return result


def _result(legs, named, phase, step, calibration, floor_batch, capacity, machine, start_s,
            quick, yardstick, lane):  # type: ignore[no-untyped-def]  # fmt: skip
    tables = {k: summarize(v, named if k != "d" else [("batch alone", 0.0, phase)])
              for k, v in legs.items()}  # fmt: skip
    quiet_a = tables["a"][0]
    base_tpot, base_ttft = quiet_a["tpot"]["p95"], quiet_a["ttft"]["p95"]
    shared, rt_prompt, reply, rates = yardstick
    # The batch lines as they ran alone (d): uncached prompt and reply tokens per line.
    ran = legs["d"].lines or legs["b"].lines
    batch_prompt = statistics.mean(p for p, _ in ran) if ran else 0.0
    batch_reply = max(1.0, statistics.mean(t for _, t in ran)) if ran else 1.0
    # The lane's TPOT target, modelled: ratio × the mean step of real-time work alone in the
    # quiet phase (what the lane measures as its baseline).
    quiet_step = shared.mean_step(rates[0], rt_prompt, reply)
    slo = Slo.of(lane)
    targets = {
        "slo": slo.as_dict(),
        "tpot_p95_s": slo.target("tpot", base_tpot),
        "ttft_p95_s": slo.target("ttft", base_ttft),
        "tpot_floor_step_model_s": lane_tpot_model(lane, step.step_seconds(1)),
        "lane_tpot_mean_step_model_s": lane_tpot_model(lane, quiet_step),
    }
    model_check = [
        {"phase": label, "rate_per_s": rate,
         "mean_step_model_s": shared.mean_step(rate, rt_prompt, reply),
         "tpot_p50_measured_s": tables["a"][i]["tpot"]["p50"]}
        for i, ((label, _, _), rate) in enumerate(zip(named, rates, strict=True))
    ]  # fmt: skip
    for i, row in enumerate(tables["c"]):
        lines, bound = shared.bound(targets["lane_tpot_mean_step_model_s"], rates[i], rt_prompt,
                                    reply, batch_prompt, batch_reply)  # fmt: skip
        row["bound_lines"], row["bound_tokens_per_s"] = lines, bound
        row["harvest"] = (row["batch_output_tokens_per_s"] / row["bound_tokens_per_s"]
                          if row["bound_tokens_per_s"] else None)  # fmt: skip
        row["inside_targets"] = bool(
            targets["tpot_p95_s"] and targets["ttft_p95_s"]
            and row["tpot"]["p95"] is not None and row["ttft"]["p95"] is not None
            and row["tpot"]["p95"] <= targets["tpot_p95_s"]
            and row["ttft"]["p95"] <= targets["ttft_p95_s"]
        )  # fmt: skip
    total_bound = sum(r["bound_tokens_per_s"] for r in tables["c"])
    total_c = sum(r["batch_output_tokens_per_s"] for r in tables["c"])
    timelines = {
        k: {
            "realtime": [[r.at, r.ttft, r.tpot] for r in v.records if r.ttft is not None],
            "batch_tokens": [[at, t] for at, t in v.finished],
            "lane": v.decisions,
        }
        for k, v in legs.items()
    }
    return {
        "benchmark": "colocate",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {
            "quick": quick,
            "phase_seconds": phase,
            "max_num_seqs": MAX_NUM_SEQS,
            "rt_reply_tokens": RT_REPLY,
            "quiet": QUIET,
            "busy": BUSY,
            "server_start_s": start_s,
            "lane": lane.model_dump(),
        },  # fmt: skip
        "step_model": calibration,
        "batch_line_tokens": {"uncached_prompt": batch_prompt, "reply": batch_reply},
        "model_check": model_check,
        "floor_batch": floor_batch,
        "realtime_capacity_per_s": capacity,
        "targets": targets,
        "legs": tables,
        "errors": {k: v.error for k, v in legs.items() if v.error},
        "harvest_c": total_c / total_bound if total_bound else None,
        "met": {
            "c_inside_targets_every_phase": all(r["inside_targets"] for r in tables["c"]),
            "c_harvest_ge_70pct": bool(total_bound and total_c / total_bound >= TARGET_HARVEST),
        },
        "timelines": timelines,
    }


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1000 * x:.0f}"


def _print(result: dict[str, Any]) -> None:
    rows = []
    for leg, table in result["legs"].items():
        for r in table:
            rows.append([
                f"({leg}) {r['phase']}", r["requests_served"],
                _ms(r["ttft"]["p50"]), _ms(r["ttft"]["p95"]), _ms(r["ttft"]["p99"]),
                _ms(r["tpot"]["p50"]), _ms(r["tpot"]["p95"]), _ms(r["tpot"]["p99"]),
                r["batch_output_tokens_per_s"], r.get("bound_tokens_per_s", ""),
            ])  # fmt: skip
    t = result["targets"]
    harness.print_table(
        f"co-serving on one vllm serve (targets: TTFT p95 ≤ {_ms(t['ttft_p95_s'])} ms, TPOT p95 "
        f"≤ {_ms(t['tpot_p95_s'])} ms; load {result['machine']['load_average']})",
        ["leg / phase", "served", "TTFT p50", "p95", "p99", "TPOT p50", "p95", "p99",
         "batch tok/s", "bound tok/s"],
        rows,
    )  # fmt: skip
    harness.console.print(f"harvest (c) = {result['harvest_c']}, met: {result['met']}")
