"""Reading a vLLM server's Prometheus ``/metrics``: gauges, token counters and latency histograms.

The one place that knows vLLM's metric names and how to read them. The load signal
(``workers.scheduler.signals``), the batch lane (``workers.lane.controller``) and the remote
engine's server meter (``workers.engine.remote_meter``) all read through it. Parsing is
``prometheus_client``'s; a name exposed with several label sets (several engines or models behind
one endpoint) is summed, since they all share the server's time.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

#: Latency histograms, first match wins: vLLM >= 0.32's name, then the older servers'.
TPOT_HISTOGRAMS = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
TTFT_HISTOGRAMS = ("vllm:time_to_first_token_seconds",)
#: Each finished request's own TPOT (vLLM >= 0.10): what the users' TPOT p95 target is about.
REQUEST_TPOT_HISTOGRAMS = ("vllm:request_time_per_output_token_seconds",)
#: Request gauges.
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
#: Token counters (``vllm.v1.metrics.loggers``): prompt tokens (cached included), cached prompt
#: tokens, generated tokens.
PROMPT_TOKENS = "vllm:prompt_tokens_total"
CACHED_TOKENS = "vllm:prompt_tokens_cached_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
TOKEN_COUNTERS = (PROMPT_TOKENS, CACHED_TOKENS, GENERATION_TOKENS)


def fetch_text(url: str, timeout_seconds: float) -> str:
    """The text at ``url`` (a ``/metrics`` page). Raises ``OSError`` when it cannot be read
    (``URLError`` and ``HTTPError`` are ``OSError``s)."""
    # urllib rather than httpx: httpx logs every request at INFO, and this runs every second.
    with urllib.request.urlopen(url, timeout=timeout_seconds) as response:
        text: str = response.read().decode("utf-8", errors="replace")
    return text


# --- Gauges and counters ----------------------------------------------------------------------


def parse_metrics(text: str, names: Iterable[str]) -> dict[str, float]:
    """Values of the named samples in Prometheus text exposition ``text``.

    Several label sets of a name are summed, except percentages (``*_perc``), whose largest
    sample is taken: the fullest KV cache is the one that decides whether batch work would crowd
    real-time requests. NaN samples and names absent from ``text`` are absent from the result.
    Raises ``ValueError`` for text that does not parse.
    """
    wanted = set(names)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in wanted or math.isnan(sample.value):
                continue
            if sample.name.endswith("_perc"):
                values[sample.name] = max(values.get(sample.name, 0.0), sample.value)
            else:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


@dataclass(frozen=True)
class ServerTokens:
    """Token counters of a vLLM server (or their difference over a period): prompt tokens (cached
    included), cached prompt tokens, generated tokens."""

    prompt: float = 0.0
    cached: float = 0.0
    generation: float = 0.0

    def since(self, earlier: ServerTokens) -> ServerTokens:
        """Tokens counted after ``earlier``; a counter that went down (the server restarted and
        counts from 0 again) counts all of its current value, as Prometheus' ``increase`` does."""

        def delta(now: float, before: float) -> float:
            return now - before if now >= before else now

        return ServerTokens(
            delta(self.prompt, earlier.prompt),
            delta(self.cached, earlier.cached),
            delta(self.generation, earlier.generation),
        )

    def plus(self, other: ServerTokens) -> ServerTokens:
        return ServerTokens(
            self.prompt + other.prompt,
            self.cached + other.cached,
            self.generation + other.generation,
        )


def parse_server_tokens(text: str) -> ServerTokens:
    """The token counters in a vLLM ``/metrics`` page, summed over its label sets. Raises
    ``ValueError`` when the page has no ``vllm:prompt_tokens_total`` or
    ``vllm:generation_tokens_total``."""
    # Only the counters' lines are parsed: the meter reads the whole page every interval.
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(TOKEN_COUNTERS))
    values = parse_metrics(wanted + "\n", TOKEN_COUNTERS)
    if PROMPT_TOKENS not in values or GENERATION_TOKENS not in values:
        raise ValueError(f"no {PROMPT_TOKENS} / {GENERATION_TOKENS} in the server's metrics")
    return ServerTokens(
        values[PROMPT_TOKENS], values.get(CACHED_TOKENS, 0.0), values[GENERATION_TOKENS]
    )


# --- Histograms -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    """A cumulative Prometheus histogram: ``counts[i]`` observations ≤ ``bounds[i]`` (seconds),
    the last bound ``inf``; summed over label sets."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    #: The observations' sum (seconds), the ``_sum`` sample.
    total: float = 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """Observations since ``earlier`` (a counter reset, e.g. a server restart, gives
        everything since the restart)."""
        if earlier is None or earlier.bounds != self.bounds or earlier.count > self.count:
            return self
        return Histogram(
            self.bounds,
            tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True)),
            self.total - earlier.total,
        )

    def plus(self, other: Histogram) -> Histogram:
        """Both sets of observations (same ``bounds``)."""
        counts = tuple(a + b for a, b in zip(self.counts, other.counts, strict=True))
        return Histogram(self.bounds, counts, self.total + other.total)

    def quantile(self, q: float, drop_top: float = 0.0) -> float | None:
        """The ``q`` quantile in seconds, linear inside its bucket (PromQL's
        ``histogram_quantile``); the highest finite bound when it falls in ``+Inf``; ``None``
        with no observations. ``drop_top``: the quantile of the observations but the largest
        ``drop_top`` (``None`` when that leaves none)."""
        total = self.count - drop_top
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return lower_bound
                if count == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                    count - lower_count
                )
            lower_bound, lower_count = bound, count
        return lower_bound


@dataclass(frozen=True)
class ServerSnapshot:
    """One scrape of the real-time server: ``at`` (monotonic seconds), the TPOT and TTFT
    histograms (``None`` when not exposed) and the running/waiting gauges (requests)."""

    at: float
    tpot: Histogram | None
    ttft: Histogram | None
    running: float
    waiting: float
    #: Per-request TPOT (``None`` when the server does not expose it).
    request_tpot: Histogram | None = None


def parse_snapshot(text: str, at: float) -> ServerSnapshot:
    """A ``ServerSnapshot`` taken at monotonic ``at`` from Prometheus text exposition. Raises
    ``ValueError`` for text that does not parse or exposes none of ``TPOT_HISTOGRAMS``."""
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                base = sample.name.removesuffix("_bucket")
                le = float(sample.labels.get("le", "inf"))
                per = buckets.setdefault(base, {})
                per[le] = per.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                base = sample.name.removesuffix("_sum")
                sums[base] = sums.get(base, 0.0) + sample.value
            elif sample.name in (WAITING, RUNNING) and not math.isnan(sample.value):
                gauges[sample.name] = gauges.get(sample.name, 0.0) + sample.value

    def histogram(names: tuple[str, ...]) -> Histogram | None:
        for name in names:
            if name in buckets:
                items = sorted(buckets[name].items())
                return Histogram(
                    tuple(b for b, _ in items), tuple(c for _, c in items), sums.get(name, 0.0)
                )
        return None

    tpot = histogram(TPOT_HISTOGRAMS)
    if tpot is None:
        raise ValueError(f"the metrics expose none of {', '.join(TPOT_HISTOGRAMS)}")
    return ServerSnapshot(
        at,
        tpot,
        histogram(TTFT_HISTOGRAMS),
        gauges.get(RUNNING, 0.0),
        gauges.get(WAITING, 0.0),
        histogram(REQUEST_TPOT_HISTOGRAMS),
    )
