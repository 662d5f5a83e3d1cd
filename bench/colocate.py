"""Benchmark: co-serving batch work through a real-time vLLM server (issue 11, part 6).

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

import asyncio
import json
import math
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench import harness
from bench.generator import SYSTEM_PROMPT, chat_requests, write_jsonl
from bench.servers import VllmServe, free_port
from offpeak.settings import DEFAULT_MODEL, LaneSettings, ModelConfig, SchedulerSettings, Settings

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
#: Real-time replies (tokens), uniform, as max_tokens with ignore_eos so lengths are what we ask.
RT_REPLY = (24, 72)
#: Real-time rates as fractions of the measured real-time capacity.
QUIET, BUSY = 0.2, 0.75
TARGET_HARVEST = 0.70
RT_QUESTIONS = (
    "What is the capital of France?",
    "Explain what a hash table is.",
    "Why is the sky blue?",
    "What does a database index do?",
    "Summarize the water cycle.",
    "How does a bicycle stay upright?",
)
ROOT = Path(__file__).resolve().parents[1]


# --- The real-time server -----------------------------------------------------------------------


# --- Real-time load -----------------------------------------------------------------------------


@dataclass
class RtRecord:
    """One real-time request: sent ``at`` seconds after the leg started; seconds."""

    at: float
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    error: str | None = None


async def _stream_chat(
    client: httpx.AsyncClient, name: str, question: str, max_tokens: int, record: RtRecord
) -> None:
    body = {
        "model": name,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                     {"role": "user", "content": question}],
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
    }  # fmt: skip
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.aiter_lines():
                if not raw.startswith("data: ") or raw == "data: [DONE]":
                    continue
                chunk = json.loads(raw[6:])
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    tokens += 1
    except (httpx.HTTPError, ValueError) as exc:
        record.error = repr(exc)
        return
    record.seconds = time.perf_counter() - sent
    record.tokens = tokens
    if first is not None:
        record.ttft = first - sent
        if tokens > 1 and last is not None:
            record.tpot = (last - first) / (tokens - 1)


class RealtimeLoad:
    """Open-loop Poisson arrivals of streaming chat requests over ``phases`` (``(start, end,
    rate per second, seed)`` in seconds after ``start()``; each phase draws from its own seed,
    so the same phase brings the same requests in every leg), on an event loop in a thread of
    its own."""

    def __init__(self, base: str, name: str, phases: list[tuple[float, float, float, int]]) -> None:
        self.base, self.name, self.phases = base, name, phases
        self.records: list[RtRecord] = []
        self.t0 = 0.0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=self.base, timeout=120, limits=limits) as client:
            tasks = []
            for start, end, rate, seed in self.phases:
                rng = np.random.default_rng(seed)
                at = start
                while rate > 0:
                    at += float(rng.exponential(1 / rate))
                    if at >= end:
                        break
                    delay = self.t0 + at - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    record = RtRecord(at)
                    self.records.append(record)
                    question = RT_QUESTIONS[len(self.records) % len(RT_QUESTIONS)]
                    reply = int(rng.integers(RT_REPLY[0], RT_REPLY[1] + 1))
                    tasks.append(
                        asyncio.create_task(
                            _stream_chat(client, self.name, question, reply, record)
                        )
                    )
            end = self.phases[-1][1] if self.phases else 0.0
            await asyncio.sleep(max(0.0, self.t0 + end - time.perf_counter()))
            if tasks:
                await asyncio.wait(tasks, timeout=60)


# --- The step model, measured on the server ------------------------------------------------------


def calibrate_server(base: str, name: str, sizes: tuple[int, ...]) -> dict[str, Any]:
    """``base_ms + per_seq_ms × batch`` fitted to the median client TPOT of ``size`` concurrent
    streaming requests (48 tokens each) at each size."""
    from workers.calibration import CalibrationPoint, fit_step_model

    async def level(size: int) -> float:
        records = [RtRecord(0.0) for _ in range(size)]
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            await asyncio.gather(
                *(_stream_chat(client, name, "Count from one to one hundred in words.", 48, r)
                  for r in records)
            )  # fmt: skip
        values = [r.tpot for r in records if r.tpot is not None]
        if not values:
            raise RuntimeError(f"no TPOT measured at {size} sequences: {records[0].error}")
        return statistics.median(values)

    asyncio.run(level(2))  # warm-up
    points = [CalibrationPoint(size, 1000 * asyncio.run(level(size)), 48) for size in sizes]
    model = fit_step_model(points)
    return {"base_ms": model.base_ms, "per_seq_ms": model.per_seq_ms,
            "points": [asdict(p) for p in points]}  # fmt: skip


def measure_prefill(base: str, name: str, lengths: tuple[int, int] = (64, 512)) -> dict[str, Any]:
    """Seconds per prompt token of prefill: the least-squares slope of one-token completion
    latency against prompt length (random token ids, so the prefix cache never hits), median of
    three per length, on an idle server."""
    rng = np.random.default_rng(7)
    medians = []
    with httpx.Client(base_url=base, timeout=120) as client:
        for length in lengths:
            times = []
            for _ in range(3):
                prompt = [int(t) for t in rng.integers(1000, 40000, size=length)]
                body = {"model": name, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
                started = time.perf_counter()
                client.post("/v1/completions", json=body).raise_for_status()
                times.append(time.perf_counter() - started)
            medians.append(statistics.median(times))
    slope = (medians[1] - medians[0]) / (lengths[1] - lengths[0])
    return {"prefill_s_per_token": max(slope, 0.0), "lengths": list(lengths),
            "latency_s": medians}  # fmt: skip


def prompt_tokens(base: str, name: str) -> int:
    """Prompt tokens of a real-time request (the system prompt and a question, templated)."""
    body = {
        "model": name, "max_tokens": 1,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                     {"role": "user", "content": RT_QUESTIONS[0]}],
    }  # fmt: skip
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    return int(response.json()["usage"]["prompt_tokens"])


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
    ``workers.scheduler.lane``'s decode-only model."""

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


def run_leg(
    name: str,
    base: str,
    model: str,
    phases: list[tuple[float, float, float]],
    batch_settings: Settings | None,
    engine: Any | None,
    step_model: Any,
    seed: int,
    pre_roll: float = 0.0,
) -> Leg:
    """One leg; with ``pre_roll`` seconds, the batch side starts that long before the phases,
    beside real-time traffic at the first phase's rate (the lane learns its baselines once per
    deployment, not per phase); times are reported from the first phase's start (the pre-roll
    negative)."""
    leg = Leg(name)
    seeded = [(s + pre_roll, e + pre_roll, r, seed + i) for i, (s, e, r) in enumerate(phases)]
    if pre_roll:
        seeded.insert(0, (0.0, pre_roll, phases[0][2], seed + 1000))
    t0 = time.perf_counter()
    horizon = max(end for _, end, _, _ in seeded)
    load = RealtimeLoad(base, model, [p for p in seeded if p[2] > 0])
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
    leg.records = load.records
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
    from workers.scheduler.lane_scraper import PrometheusServer

    scraper = PrometheusServer(f"{base}/metrics", 1.0, 2.0, 10.0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        snap = scraper.scrape()
        if snap.running == 0 and snap.waiting == 0:
            return
        time.sleep(0.5)


def run(
    quick: bool = False,
    phase_seconds: float | None = None,
    out_dir: Path | None = None,
    plot: Path | None = Path("docs/colocate.png"),
    seed: int = 0,
    server_url: str | None = None,
) -> dict[str, Any]:
    """The four legs on one server; prints the table, writes ``colocate.json`` and the plot.
    ``server_url``: an already running server (started with ``--max-num-seqs 32
    --scheduling-policy priority``) instead of one started here."""
    from workers.engine import registry
    from workers.model_store import ensure_model
    from workers.planner import StepModel, largest_batch

    phase = phase_seconds or (15.0 if quick else 60.0)
    name = DEFAULT_MODEL
    settings = Settings()
    config = settings.models[name]
    model_dir = ensure_model(name, config, settings.model_cache_dir)
    machine = harness.machine()
    lane_defaults = LaneSettings()
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
            tpot_floor = lane_defaults.tpot_ratio * step.step_seconds(1)
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
            lines = 300 if quick else 3000
            batch_file = folder / "batch.jsonl"
            write_jsonl(chat_requests(lines, model=name, max_tokens=64, seed=seed), batch_file)
            remote = ModelConfig(
                engine="remote", url=base, source=config.source, max_num_seqs=MAX_NUM_SEQS,
                max_model_len=2048,
            )  # fmt: skip
            with harness.scratch_service(
                {name: remote.model_dump()}, roles=("control",)
            ) as service:
                batch = harness.create(service.client, harness.upload(service.client, batch_file))
                batch = harness.wait_status(
                    service.client, batch.id, ("in_progress",), stack=service.stack
                )
                if batch.status != "in_progress":
                    raise RuntimeError(f"the batch did not start: {batch.status} {batch.errors}")

                def batch_settings(enabled: bool) -> Settings:
                    policy = SchedulerSettings(lane=LaneSettings(enabled=enabled))
                    return Settings(
                        database_url=service.database_url,
                        broker_url=service.env["OFFPEAK_BROKER_URL"],
                        data_dir=service.data_dir,
                        queue_prefix=service.env["OFFPEAK_QUEUE_PREFIX"],
                        models={name: remote},
                        scheduler=policy,
                        flush_seconds=1.0,
                    )

                engine = registry.load(batch_settings(False), name)
                legs: dict[str, Leg] = {}
                plan = (
                    ("a", phases, None),
                    ("b", phases, batch_settings(False)),
                    ("c", phases, batch_settings(True)),
                    ("d", [(0.0, phase, 0.0)], batch_settings(False)),
                )
                for leg_name, leg_phases, leg_settings in plan:
                    _wait_idle(base)
                    harness.console.print(f"leg ({leg_name}) …")
                    # The lane learns its baselines, then slow-starts, before the phases.
                    pre = lane_defaults.learn_seconds + 10 if leg_name == "c" else 0.0
                    legs[leg_name] = run_leg(
                        leg_name, base, name, leg_phases, leg_settings,
                        engine if leg_settings else None, step, seed, pre,
                    )  # fmt: skip
                registry.close_all()
        finally:
            if server is not None:
                server.stop()
    yardstick = (shared, rt_prompt, mean_reply, rates)
    result = _result(legs, named, phase, step, calibration, floor_batch, capacity, machine,
                      start_s, quick, yardstick, lane_defaults)  # fmt: skip
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
    targets = {
        "tpot_p95_s": lane.tpot_ratio * base_tpot if base_tpot else None,
        "ttft_p95_s": lane.ttft_ratio * base_ttft if base_ttft else None,
        "tpot_floor_step_model_s": lane.tpot_ratio * step.step_seconds(1),
        "lane_tpot_mean_step_model_s": lane.tpot_ratio * quiet_step,
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
            "lane_defaults": lane.model_dump(),
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
