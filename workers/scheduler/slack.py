"""Slack and urgency: will each batch finish inside its window if batch work keeps running?

Batches of a model run earliest deadline first, so a batch finishes only after every batch due
before it. Its estimated completion time is therefore ``now + (tokens left in it and in every
batch due no later) / throughput``, and its slack is ``expires_at`` minus that. A batch whose
slack falls below its margin is urgent: it runs even while real-time load is high.

- Tokens left = lines left × completion tokens per line. Lines that finish first are the short
  ones, so a batch's own average starts low; it is blended with the model's average over
  ``throughput_window_seconds`` (or ``expected_completion_tokens`` before there is one) in
  proportion to the share of the batch still to run.
- Throughput = tokens generated per second of engine stepping: the runner's own measurement
  (one token per running sequence per step, decayed over about five minutes of stepping) when
  it has one, else completion tokens per busy second of the model's engine chunks, else the
  calibrated (or the default) step model at the engine's batch size; times the live workers.
- Startup: an engine released while the gate was closed (``workers.engine.release``) needs its
  reload seconds before its first token; they are added to every batch's completion time, so a
  batch turns urgent early enough to pay for the reload.
- Replicas (the autoscaling hint, ``offpeak_replicas_needed{model}``): the engines that finish
  every batch, at one engine's throughput, before its deadline minus its margin (so none turns
  urgent), from the same earliest-deadline-first sums (``replicas_needed``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from offpeak.model_config import GPU_MAX_NUM_SEQS
from offpeak.settings import SchedulerSettings, Settings
from storage.repositories.scheduler import BatchBacklog, EngineHistory
from workers.planner import StepModel
from workers.scheduler.store import DbStore, WorkStore

log = logging.getLogger(__name__)

#: Lines of a batch that must have finished before its own tokens per line are trusted.
OWN_AVERAGE_AFTER = 5
#: Completion tokens of recent engine work needed before a measured rate replaces the model.
MEASURED_AFTER_TOKENS = 2000


@dataclass(frozen=True)
class Estimate:
    """One batch's estimate at ``at`` (unix seconds)."""

    batch_id: str
    at: float
    expires_at: float
    remaining_lines: int
    remaining_tokens: float
    estimated_completion_at: float
    margin_seconds: float

    @property
    def slack_seconds(self) -> float:
        """Seconds between the estimated completion and ``expires_at``; negative: late."""
        return self.expires_at - self.estimated_completion_at

    @property
    def urgent(self) -> bool:
        return self.slack_seconds < self.margin_seconds


def margin_seconds(window_seconds: float, settings: SchedulerSettings) -> float:
    """A batch's safety margin in seconds: ``urgent_margin_fraction × window +
    urgent_margin_seconds``, for a window of ``window_seconds`` (``Batch.window_seconds``)."""
    return settings.urgent_margin_fraction * window_seconds + settings.urgent_margin_seconds


def tokens_per_second(
    history: EngineHistory,
    fallback: StepModel,
    slots: int,
    workers: int = 1,
    local: float | None = None,
) -> float:
    """Completion tokens per second the model's workers achieve together.

    ``local`` (tokens/s this runner measured) first; else measured over ``history`` once it
    covers ``MEASURED_AFTER_TOKENS``; else ``fallback`` at ``slots`` sequences per step.
    ``workers`` below 1 counts as 1 (the work waits for one).
    """
    if local is not None and local > 0:
        per_engine = local
    elif history.completion_tokens >= MEASURED_AFTER_TOKENS and history.busy_seconds > 0:
        per_engine = history.completion_tokens / history.busy_seconds
    else:
        per_engine = fallback.total_tokens_per_s(max(1, slots))
    return per_engine * max(1, workers)


def tokens_per_line(history: EngineHistory, default: int) -> float:
    """The model's completion tokens per finished line over ``history``, or ``default``."""
    if history.requests >= OWN_AVERAGE_AFTER:
        return history.completion_tokens / history.requests
    return float(default)


def batch_tokens_per_line(batch: BatchBacklog, model_tokens_per_line: float) -> float:
    """The batch's own average weighted by its finished share, the model's by the rest."""
    if batch.completed < OWN_AVERAGE_AFTER or batch.total <= 0:
        return model_tokens_per_line
    done = min(1.0, (batch.completed + batch.failed) / batch.total)
    own = batch.output_tokens / batch.completed
    return done * own + (1 - done) * model_tokens_per_line


@dataclass(frozen=True)
class Queued:
    """A batch in earliest-deadline-first order: its remaining tokens, and the tokens and lines
    left in it and in every batch due no later (what an engine runs before it is done)."""

    batch: BatchBacklog
    tokens: float
    tokens_through: float
    lines_through: int
    margin_seconds: float


def earliest_deadline_first(
    backlog: Sequence[BatchBacklog], model_tokens_per_line: float, settings: SchedulerSettings
) -> list[Queued]:
    """``backlog`` (any order) as the runner serves it, earliest deadline first."""
    queued = []
    tokens_through, lines_through = 0.0, 0
    for batch in sorted(backlog, key=lambda b: (b.expires_at, b.batch_id)):
        tokens = batch.remaining * batch_tokens_per_line(batch, model_tokens_per_line)
        tokens_through += tokens
        lines_through += batch.remaining
        queued.append(
            Queued(
                batch,
                tokens,
                tokens_through,
                lines_through,
                margin_seconds(batch.window_seconds, settings),
            )
        )
    return queued


def estimate(
    backlog: Sequence[BatchBacklog],
    at: float,
    throughput: float,
    model_tokens_per_line: float,
    settings: SchedulerSettings,
    startup_seconds: float = 0.0,
) -> list[Estimate]:
    """Estimates for ``backlog`` (any order; computed earliest deadline first).

    ``throughput`` is completion tokens per second (``tokens_per_second``); raises
    ``ValueError`` when it is not positive. ``startup_seconds`` pass before the first token
    (a released engine's reload).
    """
    if throughput <= 0:
        raise ValueError("throughput must be positive tokens/s")
    return [
        Estimate(
            batch_id=q.batch.batch_id,
            at=at,
            expires_at=float(q.batch.expires_at),
            remaining_lines=q.batch.remaining,
            remaining_tokens=q.tokens,
            estimated_completion_at=at + startup_seconds + q.tokens_through / throughput,
            margin_seconds=q.margin_seconds,
        )
        for q in earliest_deadline_first(backlog, model_tokens_per_line, settings)
    ]


def replicas_needed(
    backlog: Sequence[BatchBacklog],
    at: float,
    engine_throughput: float,
    model_tokens_per_line: float,
    settings: SchedulerSettings,
    slots: int,
    startup_seconds: float = 0.0,
) -> int:
    """Engines needed so every batch of ``backlog`` finishes by ``expires_at - margin``.

    With ``N`` engines of ``engine_throughput`` completion tokens/s each, the batch due ``i``-th
    is done ``startup_seconds + T_i / (N × engine_throughput)`` from ``at``, ``T_i`` being the
    tokens left in it and every batch due before it; so ``N = max_i ceil(T_i /
    (engine_throughput × (expires_at_i - margin_i - at - startup_seconds)))``. More engines than
    ``ceil(L_i / slots)`` (``L_i`` lines left through batch ``i``; an engine runs ``slots``
    sequences at once) cannot help, so that caps each term, and is the answer for a batch with
    no time left. 0 when nothing is left; raises ``ValueError`` for a throughput that is not
    positive.
    """
    if engine_throughput <= 0:
        raise ValueError("throughput must be positive tokens/s")
    needed = 0
    for q in earliest_deadline_first(backlog, model_tokens_per_line, settings):
        if q.lines_through <= 0:
            continue
        most = math.ceil(q.lines_through / max(1, slots))
        left = q.batch.expires_at - q.margin_seconds - at - startup_seconds
        wanted = most if left <= 0 else math.ceil(q.tokens_through / (engine_throughput * left))
        needed = max(needed, min(most, max(1, wanted)))
    return needed


@dataclass(frozen=True)
class Plan:
    """A model's estimates and the replicas its backlog needs (``refresh_plan``)."""

    estimates: list[Estimate]
    replicas: int = 0
    remaining_tokens: float = 0.0
    #: One engine's completion tokens/s, and the live engine workers of the model.
    engine_tokens_per_second: float = 0.0
    workers: int = 0

    def replicas_json(self, at: float) -> dict[str, Any]:
        """The ``replicas:<model>`` value (``offpeak.scheduler_state``)."""
        return {
            "replicas": self.replicas,
            "remaining_tokens": round(self.remaining_tokens, 1),
            "engine_tokens_per_second": round(self.engine_tokens_per_second, 3),
            "workers": self.workers,
            "at": at,
        }


def refresh_estimates(
    store: WorkStore,
    settings: Settings,
    model: str,
    at: float,
    step_model: StepModel,
    slots: int,
    local_rate: float | None = None,
    startup_seconds: float = 0.0,
) -> list[Estimate]:
    """Estimate every running batch of ``model`` at ``at`` and store the estimated completion
    times (the API shows them). Used by the runner (with its own measured ``local_rate``,
    tokens/s, and ``startup_seconds`` while its engine is released) and by the control
    worker's sweep."""
    return refresh_plan(
        store, settings, model, at, step_model, slots, local_rate, startup_seconds
    ).estimates


def refresh_plan(
    store: WorkStore,
    settings: Settings,
    model: str,
    at: float,
    step_model: StepModel,
    slots: int,
    local_rate: float | None = None,
    startup_seconds: float = 0.0,
) -> Plan:
    """``refresh_estimates``, plus the replicas the backlog needs (``replicas_needed``, a new
    replica taking ``scheduler.replica_startup_seconds`` to start)."""
    policy = settings.scheduler
    backlog = store.backlog(model)
    if not backlog:
        return Plan([])
    history = store.engine_history(model, at - policy.throughput_window_seconds)
    workers = store.live_workers(
        model, at - max(3 * settings.flush_seconds, settings.lease_seconds)
    )
    per_engine = tokens_per_second(history, step_model, slots, 1, local_rate)
    throughput = tokens_per_second(history, step_model, slots, workers, local_rate)
    per_line = tokens_per_line(history, policy.expected_completion_tokens)
    estimates = estimate(backlog, at, throughput, per_line, policy, startup_seconds)
    store.save_estimates({e.batch_id: e.estimated_completion_at for e in estimates})
    replicas = replicas_needed(
        backlog, at, per_engine, per_line, policy, slots, policy.replica_startup_seconds
    )
    return Plan(
        estimates, replicas, sum(e.remaining_tokens for e in estimates), per_engine, workers
    )


def sweep_estimates(settings: Settings, models: Iterable[str], at: float) -> None:
    """Refresh the estimates of every running batch of ``models`` (the control worker's sweep,
    so slack keeps moving while no engine worker runs a model), and store each model's replicas
    needed (``replicas:<model>``, read by the API's ``/metrics``; 0 for a model with nothing
    left). Never raises: a failure is logged and the next sweep tries again."""
    store = DbStore(settings.resolved_database_url)
    for model in models:
        try:
            since = at - settings.scheduler.throughput_window_seconds
            device = store.engine_history(model, since).device or "cpu"
            # The model's engine's sequence limit: its setting, else the device's default
            # (unset is the default, and ``max(1, None)`` failed every sweep of such a model).
            config = settings.models.get(model)
            slots = config.max_num_seqs_on(device == "cpu") if config else GPU_MAX_NUM_SEQS
            plan = refresh_plan(
                store, settings, model, at, calibrated(settings, model, device), slots
            )
            store.publish_replicas(model, plan.replicas_json(at), at)
        except Exception:
            log.exception("cannot refresh the estimates of %s", model)


def calibrated(settings: Settings, model: str, device: str) -> StepModel:
    """The step model ``offpeak calibrate`` stored for this model and device, else the default."""
    from workers.calibration import load_calibration

    try:
        found = load_calibration(model, device, settings.model_cache_dir)
    except (OSError, ValueError) as exc:
        log.warning("ignoring the calibration file: %s", exc)
        found = None
    return found or StepModel()
