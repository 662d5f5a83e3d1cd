"""The real-time side of the co-serving benchmark: a load generator of open-loop arrivals of
streaming chat requests, each timed at the client (TTFT, TPOT), and the step and prefill costs of
the server, measured on it (``bench.colocate``)."""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
import numpy as np

from bench.generator import SYSTEM_PROMPT

#: Real-time replies (tokens), uniform, as max_tokens with ignore_eos so lengths are what we ask.
RT_REPLY = (24, 72)
RT_QUESTIONS = (
    "What is the capital of France?",
    "Explain what a hash table is.",
    "Why is the sky blue?",
    "What does a database index do?",
    "Summarize the water cycle.",
    "How does a bicycle stay upright?",
)

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


async def stream_timed(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], record: RtRecord
) -> None:
    """POST the streaming ``body`` to ``path`` and time it into ``record``: TTFT to the first
    chunk with a token, TPOT over the rest; tokens from the usage chunk when the server sends
    one (``stream_options.include_usage``), else one per chunk with a token. A transport or
    HTTP error goes to ``record.error``."""
    sent = time.perf_counter()
    first = last = None
    chunks, usage = 0, None
    try:
        async with client.stream("POST", path, json=body) as response:
            response.raise_for_status()
            async for raw in response.aiter_lines():
                if not raw.startswith("data: ") or raw == "data: [DONE]":
                    continue
                chunk = json.loads(raw[6:])
                choices = chunk.get("choices") or []
                # A completion's chunk is a token; a chat's first chunk only names the role.
                if choices and ("text" in choices[0] or choices[0].get("delta", {}).get("content")):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                if chunk.get("usage"):
                    usage = int(chunk["usage"].get("completion_tokens") or 0)
    except (httpx.HTTPError, ValueError) as exc:
        record.error = repr(exc)
        return
    record.seconds = time.perf_counter() - sent
    record.tokens = chunks if usage is None else usage
    if first is not None:
        record.ttft = first - sent
        if record.tokens > 1 and last is not None:
            record.tpot = (last - first) / (record.tokens - 1)


async def stream_chat(
    client: httpx.AsyncClient, name: str, question: str, max_tokens: int, record: RtRecord
) -> None:
    """A streaming chat request of ``question`` under the benchmark's system prompt, forced to
    ``max_tokens`` tokens, timed into ``record`` (``stream_timed``)."""
    body = {
        "model": name,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                     {"role": "user", "content": question}],
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stream": True,
    }  # fmt: skip
    await stream_timed(client, "/v1/chat/completions", body, record)


class LoadThread:
    """Real-time requests sent at set times from an event loop in a thread of its own:
    ``start(t0)`` (``time.perf_counter`` seconds) is the leg's zero; ``records`` holds one
    ``RtRecord`` per request, in the order sent. Subclasses say what to send (``_run``)."""

    def __init__(self, base: str, name: str) -> None:
        self.base, self.name = base, name
        self.records: list[RtRecord] = []
        self.t0 = 0.0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    async def _run(self) -> None:
        raise NotImplementedError

    async def _arrive(self, at: float) -> RtRecord:
        """Wait until ``at`` seconds after the leg's zero; the new request's record."""
        delay = self.t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = RtRecord(at)
        self.records.append(record)
        return record


class RealtimeLoad(LoadThread):
    """Open-loop Poisson arrivals of streaming chat requests over ``phases`` (``(start, end,
    rate per second, seed)`` in seconds after ``start()``; each phase draws from its own seed,
    so the same phase brings the same requests in every leg)."""

    def __init__(self, base: str, name: str, phases: list[tuple[float, float, float, int]]) -> None:
        super().__init__(base, name)
        self.phases = phases

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
                    record = await self._arrive(at)
                    question = RT_QUESTIONS[len(self.records) % len(RT_QUESTIONS)]
                    reply = int(rng.integers(RT_REPLY[0], RT_REPLY[1] + 1))
                    tasks.append(
                        asyncio.create_task(stream_chat(client, self.name, question, reply, record))
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
                *(stream_chat(client, name, "Count from one to one hundred in words.", 48, r)
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
