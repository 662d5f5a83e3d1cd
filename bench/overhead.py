"""Benchmark: the runner's overhead at GPU step rates.

This CPU's engine steps take tens to hundreds of milliseconds, which hides any per-step cost of
Offpeak's loop; a GPU steps every 10–40 ms. ``SteppedEngine`` is a benchmark engine that
behaves like one: each ``step`` sleeps ``base_ms + per_seq_ms × running`` (running ≤
``max_num_seqs``) and gives every running sequence one token; a request of ``max_tokens`` N
finishes after N steps. It is not selectable by settings (it is no engine to serve with): the
benchmark hands it to the runner itself.

Two legs in one run on the same request lengths:

- **ideal**: the fake driven directly in a tight loop with every request added up front, so
  requests are always waiting; its tokens/s is the most any runner can get from it.
- **offpeak**: the same lines uploaded and validated by a scratch service (API + control
  worker on its own PostgreSQL database and Redis prefix), then run by the real
  ``workers.runner.Runner`` in this process on the fake: claims with leases, write-backs of
  results and engine chunks (the accounting), the lease heartbeat thread, batch statuses, all
  on the real database. In-process rather than an engine worker: the runner's loop is the same
  code, the Celery task around it runs once per drain (not per step), and it lets the engine be
  handed over without making a benchmark engine selectable in ``ModelConfig.engine``. The drain
  is timed; the batch is then finalized by the control worker and its counts checked.

Target: Offpeak's tokens/s ≥ 0.97 × the ideal on 20,000 lines.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench import harness
from workers.engine.base import Completion, EngineCapabilities, EngineRequest, EngineResult

MODEL = "bench-model"
TARGET_RATIO = 0.97
CHAT_URL = "/v1/chat/completions"


@dataclass(frozen=True)
class StepCost:
    """A GPU-like step: ``base_ms`` plus ``per_seq_ms`` per running sequence (decode of an
    8B model at batch 256 on an H100 is ≈ 35–40 ms a step)."""

    base_ms: float = 10.0
    per_seq_ms: float = 0.1
    max_num_seqs: int = 256

    def seconds(self, running: int) -> float:
        return (self.base_ms + self.per_seq_ms * running) / 1000.0


class SteppedEngine:
    """Implements ``workers.engine.base.Engine`` with sleeps for steps (a benchmark engine).

    Tokens of prompts are UTF-8 bytes; every generated token is id 120 (``x``). Requests wait
    in FIFO order (priority ignored) until one of ``max_num_seqs`` slots is free."""

    def __init__(self, cost: StepCost, model_name: str = MODEL, max_model_len: int = 8192) -> None:
        self.cost = cost
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = cost.max_num_seqs
        self.capabilities = EngineCapabilities(max_num_seqs=cost.max_num_seqs)
        self.server_meter = None
        self._waiting: deque[EngineRequest] = deque()
        #: request id → [request, tokens still to generate]
        self._running: dict[str, list[Any]] = {}
        self.steps = 0
        self.tokens = 0

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return list("".join(f"<{m['role']}>{m['content']}\n" for m in messages).encode())

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode())

    def add(self, request: EngineRequest) -> None:
        self._waiting.append(request)

    def step(self) -> list[EngineResult]:
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting.popleft()
            self._running[request.request_id] = [request, max(1, request.sampling.max_tokens)]
        if not self._running:
            return []
        time.sleep(self.cost.seconds(len(self._running)))
        self.steps += 1
        self.tokens += len(self._running)
        finished = []
        for request_id, entry in self._running.items():
            entry[1] -= 1
            if entry[1] == 0:
                finished.append(request_id)
        results = []
        for request_id in finished:
            request = self._running.pop(request_id)[0]
            n = max(1, request.sampling.max_tokens)
            completion = Completion("x" * n, [120] * n, "length")
            results.append(
                EngineResult(
                    request_id,
                    len(request.prompt_token_ids),
                    0,
                    [completion] * request.sampling.n,
                )
            )
        return results

    def abort(self, request_ids: list[str]) -> None:
        doomed = set(request_ids)
        for request_id in doomed:
            self._running.pop(request_id, None)
        self._waiting = deque(r for r in self._waiting if r.request_id not in doomed)

    def num_unfinished(self) -> int:
        return len(self._waiting) + len(self._running)

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()


def lengths(lines: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[int]:
    """Each line's ``max_tokens`` (uniform between the two, inclusive)."""
    rng = random.Random(seed)
    return [rng.randint(min_tokens, max_tokens) for _ in range(lines)]


def write_lines(path: Path, tokens: list[int]) -> None:
    """Short chat requests (a sentence each) asking for ``tokens[i]`` tokens."""
    with path.open("wb") as out:
        for i, n in enumerate(tokens):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Question {i}: say x {n} times."}],
                "max_tokens": n,
            }
            record = {"custom_id": f"req-{i:07d}", "method": "POST", "url": CHAT_URL, "body": body}
            out.write(orjson.dumps(record) + b"\n")


def ideal(cost: StepCost, tokens: list[int]) -> dict[str, Any]:
    """The fake alone: every request added up front (always waiting), stepped until empty."""
    from offpeak.endpoints.base import SamplingSpec

    engine = SteppedEngine(cost)
    for i, n in enumerate(tokens):
        engine.add(EngineRequest(f"r{i}", [1] * 16, SamplingSpec(max_tokens=n)))
    started = time.perf_counter()
    done = 0
    while engine.num_unfinished():
        done += len(engine.step())
    seconds = time.perf_counter() - started
    assert done == len(tokens)
    return {
        "requests": done,
        "tokens": engine.tokens,
        "steps": engine.steps,
        "seconds": seconds,
        "tokens_per_s": engine.tokens / seconds,
        "mean_step_ms": 1000 * seconds / engine.steps,
    }


def offpeak_leg(
    service: harness.Service, folder: Path, cost: StepCost, tokens: list[int]
) -> dict[str, Any]:
    """Upload and validate the lines through the service, then drain them with the real
    runner in this process on the fake; the batch is finalized afterwards and checked."""
    from offpeak.settings import get_settings
    from storage import task_messages
    from storage.db import get_engine
    from workers.runner.loop import Runner

    path = folder / "overhead.jsonl"
    write_lines(path, tokens)
    batch = harness.create(service.client, harness.upload(service.client, path))
    batch = harness.wait_status(
        service.client, batch.id, ("in_progress",), stack=service.stack, timeout=600
    )
    if batch.status != "in_progress":
        raise RuntimeError(f"batch is {batch.status}: {batch.errors}")
    saved = dict(os.environ)
    os.environ.update(service.env)
    get_settings.cache_clear()
    get_engine.cache_clear()
    try:
        settings = get_settings()
        engine = SteppedEngine(cost)
        runner = Runner(settings, engine, f"overhead-{os.getpid()}", device="bench")
        load = harness.load_average()
        started = time.perf_counter()
        stats = runner.drain()
        seconds = time.perf_counter() - started
        for batch_id in stats.touched:
            task_messages.send_finalize(settings, batch_id)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        get_settings.cache_clear()
    done = harness.wait_status(service.client, batch.id, stack=service.stack, timeout=600)
    counts = done.request_counts
    if done.status != "completed" or counts is None or counts.completed != len(tokens):
        raise RuntimeError(f"batch ended {done.status} with {counts}")
    return {
        "requests": stats.requests,
        "tokens": stats.completion_tokens,
        "steps": engine.steps,
        "chunks": stats.chunks,
        "seconds": seconds,
        "busy_seconds": stats.busy_seconds,
        "tokens_per_s": stats.completion_tokens / seconds,
        "mean_step_ms": 1000 * seconds / max(engine.steps, 1),
        "load_average": load,
    }


def run(
    lines: int = 20_000,
    min_tokens: int = 8,
    max_tokens: int = 24,
    cost: StepCost | None = None,
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Both legs (ideal, Offpeak, ideal again: the better ideal counts); prints the table and
    writes ``overhead.json``."""
    cost = cost or StepCost()
    machine = harness.machine()
    tokens = lengths(lines, min_tokens, max_tokens)
    first = ideal(cost, tokens)
    with (
        tempfile.TemporaryDirectory(prefix="offpeak-overhead-") as tmp,
        harness.scratch_service({MODEL: {"engine": "instant"}}, roles=("control",)) as service,
    ):
        leg = offpeak_leg(service, Path(tmp), cost, tokens)
    second = ideal(cost, tokens)
    best = max(first, second, key=lambda r: r["tokens_per_s"])
    ratio = leg["tokens_per_s"] / best["tokens_per_s"]
    result = {
        "benchmark": "overhead",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {
            "lines": lines,
            "min_tokens": min_tokens,
            "max_tokens": max_tokens,
            "step_base_ms": cost.base_ms,
            "step_per_seq_ms": cost.per_seq_ms,
            "max_num_seqs": cost.max_num_seqs,
        },
        "ideal": [first, second],
        "offpeak": leg,
        "ratio": ratio,
        "overhead_fraction": 1 - ratio,
        "targets": {"ratio": TARGET_RATIO},
        "met": {"ratio": ratio >= TARGET_RATIO},
    }
    harness.print_table(
        f"runner overhead: GPU-like fake steps ({cost.base_ms} ms + {cost.per_seq_ms} ms × "
        f"running, ≤ {cost.max_num_seqs}), {lines:,} lines (load {machine['load_average']})",
        ["leg", "requests", "tokens", "steps", "mean step ms", "seconds", "tokens/s", "× ideal"],
        [
            ["ideal (first)", first["requests"], first["tokens"], first["steps"],
             first["mean_step_ms"], first["seconds"], first["tokens_per_s"],
             first["tokens_per_s"] / best["tokens_per_s"]],
            ["offpeak", leg["requests"], leg["tokens"], leg["steps"], leg["mean_step_ms"],
             leg["seconds"], leg["tokens_per_s"], ratio],
            ["ideal (again)", second["requests"], second["tokens"], second["steps"],
             second["mean_step_ms"], second["seconds"], second["tokens_per_s"],
             second["tokens_per_s"] / best["tokens_per_s"]],
        ],
    )  # fmt: skip
    path = harness.write_result("overhead", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
