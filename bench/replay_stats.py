"""Figures of a trace replay's legs: p95 TTFT and TPOT with bootstrap 95% intervals, batch
tokens/s and harvest against the step model's bound, over the whole replay and per window (of
equal request counts), and the verdict (``met``) of leg (c) against the targets.

The interval is the percentile bootstrap (Efron & Tibshirani, "An Introduction to the
Bootstrap", 1993, ch. 13): the p95 of ``resamples`` samples drawn with replacement, its 2.5th and
97.5th percentiles. A p95 of fewer than ``MIN_REQUESTS`` requests is reported, and said to be
one of too few.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bench.realtime import RtRecord
from bench.trace import TraceRequest

#: Real-time requests a leg needs for its p95 to be a p95 (20 in its top 10%).
MIN_REQUESTS = 200
#: Share of windows leg (c) must be inside its targets in.
WINDOW_SHARE = 0.9
TARGET_HARVEST = 0.70


def p95_interval(
    values: Sequence[float], rng: np.random.Generator, resamples: int = 1000
) -> dict[str, float | int | None]:
    """``{"p95", "lo", "hi", "n"}`` (``None``s without values): the p95 and its percentile
    bootstrap 95% interval."""
    data = np.asarray([v for v in values if v is not None], dtype=float)
    if data.size == 0:
        return {"p95": None, "lo": None, "hi": None, "n": 0}
    draws = rng.choice(data, size=(resamples, data.size), replace=True)
    p95s = np.percentile(draws, 95, axis=1)
    return {
        "p95": float(np.percentile(data, 95)),
        "lo": float(np.percentile(p95s, 2.5)),
        "hi": float(np.percentile(p95s, 97.5)),
        "n": int(data.size),
    }


def windows(duration: float, count: int) -> list[tuple[float, float]]:
    """``count`` equal windows over ``[0, duration)``; the last one closed at the end."""
    if count < 1 or duration <= 0:
        raise ValueError("need a positive duration and at least one window")
    edges = np.linspace(0.0, duration, count + 1)
    return [(float(a), float(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def windows_by_requests(
    arrivals: Sequence[float], duration: float, count: int
) -> list[tuple[float, float]]:
    """``count`` windows over ``[0, duration)`` with as equal a number of ``arrivals`` (seconds)
    each as they allow, each edge halfway between the arrivals it separates: a bursty replay's
    quiet stretches and bursts are each judged on as many requests. Fewer windows when there are
    fewer arrivals; the last one closed at the end."""
    if count < 1 or duration <= 0:
        raise ValueError("need a positive duration and at least one window")
    at = sorted(arrivals)
    count = max(1, min(count, len(at)))
    edges = [0.0]
    for k in range(1, count):
        i = round(k * len(at) / count)
        edges.append((at[i - 1] + at[i]) / 2)
    edges.append(duration)
    return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def _inside(at: float, start: float, end: float, last: bool) -> bool:
    return start <= at < end or (last and at == end)


def leg_figures(
    records: list[RtRecord],
    finished: list[tuple[float, int]],
    spans: list[tuple[float, float]],
    seed: int,
) -> dict[str, Any]:
    """One leg's figures, ``{"whole": row, "windows": [row, …]}``: per span the requests sent,
    served and failed, TTFT and TPOT p95 with their intervals, and batch output tokens/s
    (``finished``: ``(seconds, tokens)`` of each batch line)."""
    rng = np.random.default_rng(seed)

    def row(start: float, end: float, last: bool) -> dict[str, Any]:
        done = [r for r in records if _inside(r.at, start, end, last)]
        ok = [r for r in done if r.error is None and r.ttft is not None]
        tokens = sum(t for at, t in finished if _inside(at, start, end, last))
        return {
            "start": start, "end": end, "requests_sent": len(done),
            "requests_served": len(ok), "errors": len(done) - len(ok),
            "ttft": p95_interval([r.ttft for r in ok if r.ttft is not None], rng),
            "tpot": p95_interval([r.tpot for r in ok if r.tpot is not None], rng),
            "batch_output_tokens_per_s": tokens / (end - start),
        }  # fmt: skip

    whole = row(spans[0][0], spans[-1][1], True)
    parts = [row(a, b, i == len(spans) - 1) for i, (a, b) in enumerate(spans)]
    return {"whole": whole, "windows": parts}


def add_bounds(
    figures: dict[str, Any],
    requests: list[TraceRequest],
    bound: Callable[[float, float, float], float],
) -> None:
    """Each row of ``figures`` gets ``bound_tokens_per_s`` (``bound(rate, mean prompt, mean
    reply)`` of the real-time requests arriving in it; the whole replay's is the windows'
    time-weighted mean, as the arrivals vary) and ``harvest`` (its batch tokens/s over it)."""
    total = 0.0
    parts = figures["windows"]
    for i, part in enumerate(parts):
        start, end = part["start"], part["end"]
        inside = [r for r in requests if _inside(r.at, start, end, i == len(parts) - 1)]
        rate = len(inside) / (end - start)
        prompt = float(np.mean([r.prompt for r in inside])) if inside else 0.0
        reply = float(np.mean([r.reply for r in inside])) if inside else 1.0
        part["bound_tokens_per_s"] = bound(rate, prompt, reply)
        total += part["bound_tokens_per_s"] * (end - start)
    whole = figures["whole"]
    whole["bound_tokens_per_s"] = total / (whole["end"] - whole["start"])
    for r in (whole, *parts):
        b = r["bound_tokens_per_s"]
        r["harvest"] = r["batch_output_tokens_per_s"] / b if b > 0 else None


def _within(row: dict[str, Any], targets: dict[str, float | None]) -> bool:
    for kind in ("ttft", "tpot"):
        p95, target = row[kind]["p95"], targets.get(kind)
        if p95 is not None and (target is None or p95 > target):
            return False
    return row["ttft"]["p95"] is not None


def window_targets(slo: Any, alone: dict[str, Any]) -> list[dict[str, float | None]]:
    """Per window of leg (a) (``alone``), the targets its users hold leg (c) to: an absolute
    target as it is, a ratio × that window's p95 with no batch work."""
    return [
        {k: slo.target(k, part[k]["p95"]) for k in ("ttft", "tpot")} for part in alone["windows"]
    ]


def verdict(
    slo: Any, alone: dict[str, Any], lane: dict[str, Any], batch_alone_tps: float | None = None
) -> dict[str, Any]:
    """``met``: leg (c) (``lane``) inside the targets over the whole replay and in at least
    ``WINDOW_SHARE`` of the windows (a window where (a) or (c) served nobody is skipped), its
    harvest ≥ ``TARGET_HARVEST`` of the bound, and ≥ ``MIN_REQUESTS`` real-time requests
    served in (a) and (c)."""
    whole_targets = {k: slo.target(k, alone["whole"][k]["p95"]) for k in ("ttft", "tpot")}
    judged = [
        _within(part, t)
        for part, t, a in zip(
            lane["windows"], window_targets(slo, alone), alone["windows"], strict=True
        )  # fmt: skip
        if part["requests_served"] and a["requests_served"]
    ]
    share = sum(judged) / len(judged) if judged else 0.0
    harvest = lane["whole"].get("harvest")
    served = min(alone["whole"]["requests_served"], lane["whole"]["requests_served"])
    met = {
        "c_inside_targets_whole_replay": _within(lane["whole"], whole_targets),
        "c_inside_targets_ge_90pct_windows": share >= WINDOW_SHARE,
        "c_harvest_ge_70pct": bool(harvest is not None and harvest >= TARGET_HARVEST),
        "ge_200_requests_per_leg": served >= MIN_REQUESTS,
    }
    return {
        "targets_whole_s": whole_targets, "windows_inside_share": share,
        "windows_judged": len(judged), "harvest_c": harvest, "served_min": served,
        "batch_alone_tokens_per_s": batch_alone_tps, "met": met,
    }  # fmt: skip
