"""The batch lane's steering for one runner: every ``control_seconds`` the lane's controller
(``workers.lane.controller``) reads the shared real-time server's latencies and sets how many
batch lines may be in flight there; the runner makes that its engine's slots and hands back
the running lines above it (``victims``)."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping

from offpeak.settings import ModelConfig, SchedulerSettings
from workers.lane import lane_metrics as metrics
from workers.lane.controller import LaneController, LaneDecision, victims
from workers.lane.scraper import PrometheusServer, ServerMetrics, metrics_url
from workers.planner import StepModel

log = logging.getLogger(__name__)


class LaneSteering:
    """The lane's controller, the server metrics it reads and its recent decisions."""

    def __init__(
        self,
        controller: LaneController,
        server: ServerMetrics,
        model: str,
        *,
        export_metrics: bool = True,
    ) -> None:
        self.controller = controller
        self.server = server
        self.model = model
        self.export_metrics = export_metrics
        #: Recent decisions, oldest first (the simulation and the bench read them).
        self.decisions: deque[LaneDecision] = deque(maxlen=10_000)
        #: Lines added to the engine so far (the controller takes their first tokens out of TTFT).
        self.lines_sent = 0
        self._next_at = -math.inf

    @classmethod
    def for_model(
        cls,
        policy: SchedulerSettings,
        config: ModelConfig | None,
        max_num_seqs: int,
        step_model: StepModel,
        server: ServerMetrics | None,
        model: str,
        *,
        export_metrics: bool = True,
    ) -> LaneSteering | None:
        """The lane of a remote engine's model (``LaneSettings.enabled`` None) or of any model
        when enabled; ``None`` when off. The model's own targets (``ModelConfig.lane``) go over
        the pool's. Without ``server`` it scrapes the server's
        ``/metrics`` (``metrics_url``) on a thread of its own."""
        lane = policy.lane.with_targets(config.lane if config is not None else None)
        remote = config is not None and config.engine == "remote"
        if not (lane.enabled if lane.enabled is not None else remote):
            return None
        if server is None:
            url = metrics_url(lane, config.url if config else None, policy.prometheus.url)
            server = PrometheusServer(
                url, lane.control_seconds, lane.timeout_seconds, lane.stale_seconds
            )
        controller = LaneController(lane, max_num_seqs, step_model)
        return cls(controller, server, model, export_metrics=export_metrics)

    @property
    def limit(self) -> int:
        """Batch lines the lane allows in flight now."""
        return self.controller.limit

    def resize(self, max_num_seqs: int) -> None:
        """A new engine's room (``Runner.replace_engine``)."""
        self.controller.max_num_seqs = max_num_seqs

    def due(self, now: float) -> bool:
        """Whether a decision is due at monotonic ``now`` (the next one is then scheduled)."""
        if now < self._next_at:
            return False
        self._next_at = now + self.controller.settings.control_seconds
        return True

    def steer(
        self,
        now: float,
        running: Mapping[str, str],
        urgent_held: bool,
        urgent: Callable[[str], bool],
    ) -> tuple[int, list[str]]:
        """One decision at monotonic ``now`` for ``running`` (request id -> batch id) lines:
        ``(limit, request ids to hand back)``, newest first, ``urgent`` batches' last.
        ``urgent_held``: a line of an urgent batch is held (running or queued)."""
        decision = self.controller.update(
            now, self.server.read(), len(running), urgent_held, sent=self.lines_sent
        )
        level = logging.INFO if decision.limit != decision.previous else logging.DEBUG
        log.log(level, "%s: %s", self.model, decision.explain())
        if self.export_metrics:
            metrics.observe_lane(self.model, decision)
        self.decisions.append(decision)
        return decision.limit, victims(running, decision.limit, urgent)
