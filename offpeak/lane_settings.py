"""The batch lane's settings (``workers.lane.controller``, ``docs/sharing-a-gpu.md``): the
controller's defaults for every co-served model (``OFFPEAK_SCHEDULER__LANE__…``) and a model's
own latency targets (``ModelConfig.lane``), as a team states its SLO: absolute p95s in
milliseconds, or ratios to the real-time latency measured without batch work."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class LaneSettings(BaseModel):
    """The batch lane's controller (``workers.lane.controller``, ``docs/sharing-a-gpu.md``): how
    many batch requests are in flight at a real-time server the batch lines run through.

    Targets are real-time p95s. Unset, each is ``ratio × baseline``, the baseline being the
    real-time latency with no batch work, measured by the controller in its first
    ``learn_seconds`` with the lane empty (TPOT falls back to the step model's one-sequence step
    until measured)."""

    enabled: bool | None = Field(
        default=None,
        description=(
            "``None``: on for remote engines (``engine: remote``), off for in-process ones; "
            "``False`` is the off switch (the runner then feeds the engine ``max_num_seqs`` "
            "lines, as before)."
        ),
    )
    metrics_url: str | None = Field(
        default=None,
        description=(
            "The real-time server's Prometheus endpoint; ``None``: the remote engine's "
            "``<url>/metrics``."
        ),
    )
    control_seconds: float = Field(
        default=2.0, gt=0, description="Seconds between decisions (and scrapes)."
    )
    window_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Seconds of histogram deltas a p95 is computed over (never across the last change)."
        ),
    )
    tpot_ratio: float = Field(
        default=2.4,
        gt=1,
        description=(
            "A per-user floor of 40 tokens/s as a slowdown (``docs/planning.md``): a 25 ms "
            "step where one user alone gets 10.4 ms (10 ms + 0.4 ms per sequence), "
            "25 / 10.4 = 2.4. TTFT gets the same ratio: a prefill runs inside a step every "
            "decoding sequence shares."
        ),
    )
    ttft_ratio: float = Field(
        default=2.4,
        gt=1,
        description=(
            "The TTFT target as a slowdown of the real-time baseline: the same 2.4 as "
            "``tpot_ratio``, since a prefill runs inside a step every decoding sequence "
            "shares."
        ),
    )
    tpot_statistic: Literal["mean", "p95"] = Field(
        default="mean",
        description=(
            "The TPOT reading of a window: ``mean`` inter-token latency (what a request's "
            "TPOT averages), or the ``p95`` of single gaps (prefill stalls dominate it "
            "without chunked prefill, far above what clients see as TPOT)."
        ),
    )
    request_tpot: bool = Field(
        default=False,
        description=(
            "Also hold finished requests' own TPOT p95 "
            "(``vllm:request_time_per_output_token_seconds``, vLLM >= 0.10) to ``tpot_ratio "
            "×`` its baseline (or ``tpot_p95_ms``): the window's mean step can sit at its "
            "target while the users' TPOT p95 is above theirs. Off by default: ``offpeak "
            "bench colocate`` meets every target on the mean reading alone."
        ),
    )
    tpot_p95_ms: float | None = Field(
        default=None,
        gt=0,
        description="TPOT p95 target in milliseconds, overriding ``tpot_ratio × baseline``.",
    )
    ttft_p95_ms: float | None = Field(
        default=None,
        gt=0,
        description=(
            "Absolute TTFT p95 target in milliseconds, overriding ``ttft_ratio × baseline``."
        ),
    )
    baseline_tpot_ms: float | None = Field(
        default=None,
        gt=0,
        description="TPOT baseline in milliseconds, overriding the controller's own measurement.",
    )
    baseline_ttft_ms: float | None = Field(
        default=None,
        gt=0,
        description="TTFT baseline in milliseconds, overriding the controller's own measurement.",
    )
    learn_seconds: float = Field(
        default=20.0,
        ge=0,
        description=(
            "Seconds the lane stays empty at start to measure the baselines (ends early "
            "once measured)."
        ),
    )
    max_waiting: float = Field(
        default=0.0,
        ge=0,
        description=(
            "Real-time requests waiting at the server tolerated (more at two readings in a "
            "row: decrease; one reading may be a request between its arrival and the next "
            "step)."
        ),
    )
    additive_increase: int = Field(
        default=1,
        ge=1,
        description="AIMD: lines added to the limit per interval inside the targets.",
    )
    decrease_factor: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="AIMD: the factor the lane's limit is multiplied by on a breach of a target.",
    )
    hold_band: float = Field(
        default=0.2,
        ge=0,
        lt=1,
        description=(
            "Readings within this fraction below a target neither raise nor lower the "
            "limit. A phase's p95 includes the windows right after each increase: with 0.2 "
            "the sawtooth's top stays under the target (``offpeak simulate colocate``: 0.1 "
            "let TTFT p95 pass it by 3%)."
        ),
    )
    min_tokens: int = Field(
        default=20,
        ge=1,
        description="Fewest tokens (TPOT) in a window for its p95 to count.",
    )
    min_requests: int = Field(
        default=3, ge=1, description="Fewest first tokens (TTFT) in a window for its p95 to count."
    )
    urgent_min: int = Field(
        default=1,
        ge=0,
        description=(
            "Batch lines of urgent batches (deadline guard) kept in flight whatever the readings."
        ),
    )
    stale_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Seconds an unreadable server holds the limit before it drops to the urgent minimum."
        ),
    )
    timeout_seconds: float = Field(
        default=2.0,
        gt=0,
        description="Seconds a scrape of the real-time server's ``/metrics`` may take.",
    )

    def with_targets(self, targets: LaneTargets | None) -> LaneSettings:
        """These settings with a model's own targets over them. A target the model states
        wins whichever way it is stated: its ratio clears a pool-wide absolute target of the
        same kind, its absolute target overrides the pool's ratio."""
        if targets is None:
            return self
        update: dict[str, float | None] = {}
        for kind in ("tpot", "ttft"):
            absolute = getattr(targets, f"{kind}_p95_ms")
            ratio = getattr(targets, f"{kind}_ratio")
            if absolute is not None:
                update[f"{kind}_p95_ms"] = absolute
            elif ratio is not None:
                update[f"{kind}_ratio"] = ratio
                update[f"{kind}_p95_ms"] = None
            baseline = getattr(targets, f"baseline_{kind}_ms")
            if baseline is not None:
                update[f"baseline_{kind}_ms"] = baseline
        return self.model_copy(update=update)


class LaneTargets(BaseModel):
    """One model's latency targets for the real-time users of its server (``ModelConfig.lane``),
    over the pool's ``LaneSettings``: each p95 as an absolute ``…_p95_ms`` ("TTFT ≤ 800 ms") or
    as a ``…_ratio`` to the real-time latency without batch work ("at most 1.5× what users get
    alone"); unset fields keep the pool's. Baselines pin what the ratio multiplies."""

    tpot_ratio: float | None = Field(
        default=None,
        gt=1,
        description=(
            "This model's TPOT p95 target as a ratio to its real-time TPOT without batch "
            "work; clears a pool-wide absolute TPOT target."
        ),
    )
    ttft_ratio: float | None = Field(
        default=None,
        gt=1,
        description=(
            "This model's TTFT p95 target as a ratio to its real-time TTFT without batch "
            "work; clears a pool-wide absolute TTFT target."
        ),
    )
    tpot_p95_ms: float | None = Field(
        default=None,
        gt=0,
        description="This model's TPOT p95 target in milliseconds, over the pool's ratio.",
    )
    ttft_p95_ms: float | None = Field(
        default=None,
        gt=0,
        description="This model's TTFT p95 target in milliseconds, over the pool's ratio.",
    )
    baseline_tpot_ms: float | None = Field(
        default=None,
        gt=0,
        description=(
            "The real-time TPOT in milliseconds the ratio multiplies, instead of the "
            "controller's measurement."
        ),
    )
    baseline_ttft_ms: float | None = Field(
        default=None,
        gt=0,
        description=(
            "The real-time TTFT in milliseconds the ratio multiplies, instead of the "
            "controller's measurement."
        ),
    )
