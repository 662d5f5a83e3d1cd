"""A production request trace as the co-serving benchmark's real-time load.

The format is the Splitwise / Azure LLM inference trace's (``TIMESTAMP,ContextTokens,
GeneratedTokens``; Patel et al., "Splitwise: Efficient generative LLM inference using phase
splitting", ISCA 2024, data CC-BY 4.0 in Azure/AzurePublicDataset). Prompt text is not in it, so
each request is sent as ``ContextTokens`` random token ids (no prefix-cache hit, as between
different users) with ``GeneratedTokens`` forced (``min_tokens`` = ``max_tokens``,
``ignore_eos``). A replay keeps the arrival times, stretched by ``time_scale``, and scales the
token counts: a production GPU fleet's load does not fit a 2-core CPU as it is.
"""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.realtime import LoadThread, RtRecord, stream_timed

#: Fewest reply tokens a replayed request gets: with one token there is no TPOT.
MIN_REPLY = 2


@dataclass(frozen=True)
class TraceRequest:
    """One request: ``at`` seconds after the replay starts, ``prompt`` and ``reply`` tokens."""

    at: float
    prompt: int
    reply: int


def read_trace(path: Path) -> list[TraceRequest]:
    """The trace's requests in arrival order, ``at`` from the first one. Raises ``ValueError``
    for a file without the three columns or with an unreadable row (its line number named)."""
    rows: list[tuple[dt.datetime, int, int]] = []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: no column {', '.join(sorted(missing))}")
        for line, row in enumerate(reader, start=2):
            try:
                # Seven fractional digits in the Azure trace; Python reads at most six.
                stamp = dt.datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                rows.append((stamp, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: {exc}") from exc
    if not rows:
        raise ValueError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    first = rows[0][0]
    return [TraceRequest((t - first).total_seconds(), c, g) for t, c, g in rows]


@dataclass(frozen=True)
class Replay:
    """A slice of a trace, scaled: ``requests`` (``at`` from the slice's start, in replay
    seconds), and how they were made, so a run can be repeated."""

    source: str
    start_s: float
    count: int
    time_scale: float
    token_scale: float
    reply_scale: float
    requests: list[TraceRequest]
    #: Requests whose prompt was cut to fit the context window.
    clipped: int

    @property
    def duration(self) -> float:
        """Replay seconds from the start to the last arrival (a lone request: 1 s)."""
        return max(1.0, self.requests[-1].at) if self.requests else 0.0

    def rate(self) -> float:
        """Mean arrivals per replay second."""
        return len(self.requests) / self.duration if self.requests else 0.0

    def mean_prompt(self) -> float:
        return float(np.mean([r.prompt for r in self.requests])) if self.requests else 0.0

    def mean_reply(self) -> float:
        return float(np.mean([r.reply for r in self.requests])) if self.requests else 0.0

    def params(self) -> dict[str, Any]:
        return {
            "trace": self.source, "start_s": self.start_s, "requests": self.count,
            "time_scale": self.time_scale, "token_scale": self.token_scale,
            "reply_scale": self.reply_scale, "clipped_prompts": self.clipped,
            "replay_seconds": self.duration, "rate_per_s": self.rate(),
            "mean_prompt_tokens": self.mean_prompt(), "mean_reply_tokens": self.mean_reply(),
        }  # fmt: skip


def trace_slice(
    trace: list[TraceRequest], start_s: float = 0.0, count: int | None = None
) -> list[TraceRequest]:
    """The first ``count`` requests (all: ``None``) arriving at or after ``start_s`` trace
    seconds, ``at`` from ``start_s``."""
    chosen = [r for r in trace if r.at >= start_s]
    if count is not None:
        chosen = chosen[:count]
    return [TraceRequest(r.at - start_s, r.prompt, r.reply) for r in chosen]


def slice_rate(requests: list[TraceRequest]) -> float:
    """Arrivals per trace second over a slice (its first to its last arrival)."""
    if len(requests) < 2:
        return 0.0
    return len(requests) / max(1e-9, requests[-1].at - requests[0].at)


def scale(
    requests: list[TraceRequest],
    *,
    source: str,
    start_s: float,
    time_scale: float,
    token_scale: float,
    reply_scale: float,
    max_model_len: int,
) -> Replay:
    """``requests`` (a ``trace_slice``) as a replay: arrival times × ``time_scale``, prompt
    tokens × ``token_scale`` (at least 1), reply tokens × ``reply_scale`` (at least
    ``MIN_REPLY``), rounded; a prompt is cut so that prompt and reply fit ``max_model_len``.
    Raises ``ValueError`` for a non-positive scale or a context too small for ``MIN_REPLY``."""
    if min(time_scale, token_scale, reply_scale) <= 0:
        raise ValueError("scales must be positive")
    if max_model_len <= MIN_REPLY:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for a prompt")
    out, clipped = [], 0
    for r in requests:
        reply = min(max(MIN_REPLY, round(r.reply * reply_scale)), max_model_len - 1)
        prompt = max(1, round(r.prompt * token_scale))
        if prompt + reply > max_model_len:
            prompt, clipped = max_model_len - reply, clipped + 1
        out.append(TraceRequest(r.at * time_scale, prompt, reply))
    return Replay(source, start_s, len(out), time_scale, token_scale, reply_scale, out, clipped)


def default_time_scale(trace_rate: float, capacity_per_s: float, load: float) -> float:
    """The stretch that makes a slice's mean arrival rate ``load ×`` the server's real-time
    capacity (requests/s at the TPOT floor, for the replay's scaled tokens). Raises
    ``ValueError`` when either rate is not positive."""
    if trace_rate <= 0 or capacity_per_s <= 0 or load <= 0:
        raise ValueError("the trace rate, the capacity and the load must be positive")
    return trace_rate / (load * capacity_per_s)


# --- The load -----------------------------------------------------------------------------------


async def _stream_completion(
    client: httpx.AsyncClient, name: str, prompt: list[int], reply: int, record: RtRecord
) -> None:
    body = {
        "model": name, "prompt": prompt, "max_tokens": reply, "min_tokens": reply,
        "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    await stream_timed(client, "/v1/completions", body, record)


def prompt_ids(seed: int, index: int, length: int) -> list[int]:
    """``length`` token ids for request ``index`` of a leg seeded ``seed``: the same request
    gets other ids in another leg, so no leg finds an earlier leg's prompts in the prefix
    cache."""
    rng = np.random.default_rng([seed, index])
    return [int(t) for t in rng.integers(1000, 40000, size=length)]


class ReplayLoad(LoadThread):
    """Streaming completions at a replay's arrival times (seconds after ``start``'s zero,
    shifted by ``offset``), each timed at the client; the same interface as
    ``bench.realtime.RealtimeLoad``."""

    def __init__(
        self,
        base: str,
        name: str,
        requests: list[TraceRequest],
        seed: int,
        offset: float = 0.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(base, name)
        self.requests, self.seed, self.offset, self.transport = requests, seed, offset, transport

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            base_url=self.base, timeout=300, limits=limits, transport=self.transport
        ) as client:
            tasks = []
            for i, r in enumerate(self.requests):
                record = await self._arrive(r.at + self.offset)
                ids = prompt_ids(self.seed, i, r.prompt)
                tasks.append(
                    asyncio.create_task(_stream_completion(client, self.name, ids, r.reply, record))
                )
            if tasks:
                await asyncio.wait(tasks, timeout=120)
