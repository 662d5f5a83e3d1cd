"""The batch lanes of a fleet (``workers.engine.fleet``): one lane controller per replica, fed
from that replica's own ``/metrics`` and judged on the lines that replica runs; the fleet sends
each line to the replica with room under its own limit. To the runner it is one lane: its limit
is the replicas' limits added up, its victims each replica's own above its limit."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from offpeak.settings import ModelConfig, SchedulerSettings
from workers.lane.controller import LaneController, LaneDecision, victims
from workers.lane.scraper import PrometheusServer, ServerMetrics
from workers.lane.steering import LaneSteering
from workers.planner import StepModel

log = logging.getLogger(__name__)


class FleetSteering:
    """``LaneSteering``'s interface over the replicas of ``fleet()`` (the runner's current
    engine), a lane each, made when a replica joins and dropped when it leaves. ``scraper``
    builds a replica's metrics reader from its ``/metrics`` URL (tests give fakes)."""

    def __init__(
        self,
        fleet: Callable[[], Any],
        policy: SchedulerSettings,
        config: ModelConfig,
        step_model: StepModel,
        model: str,
        scraper: Callable[[str], ServerMetrics] | None = None,
    ) -> None:
        self.fleet = fleet
        self.settings = policy.lane.with_targets(config.lane)
        self.step_model = step_model
        self.model = model
        self._scraper = scraper or (
            lambda url: PrometheusServer(
                url,
                self.settings.control_seconds,
                self.settings.timeout_seconds,
                self.settings.stale_seconds,
            )
        )
        self.lanes: dict[str, LaneSteering] = {}
        self.decisions: deque[LaneDecision] = deque(maxlen=10_000)
        #: The runner counts lines it added; the fleet counts them per replica (``sent_to``).
        self.lines_sent = 0
        #: What the runner closes when it is done (``Runner.lane_metrics``): every replica's reader.
        self.server = self
        self._next_at = -math.inf

    # The runner's view -----------------------------------------------------------------------

    @property
    def limit(self) -> int:
        return sum(lane.limit for lane in self.lanes.values())

    def resize(self, max_num_seqs: int) -> None:
        """A new fleet (after every replica went away): the lanes follow it at the next steer."""

    def due(self, now: float) -> bool:
        """Whether a decision is due at monotonic ``now`` (the next one is then scheduled)."""
        if now < self._next_at:
            return False
        self._next_at = now + self.settings.control_seconds
        return True

    def close(self) -> None:
        for lane in self.lanes.values():
            _close(lane.server)

    def steer(
        self,
        now: float,
        running: Mapping[str, str],
        urgent_held: bool,
        urgent: Callable[[str], bool],
    ) -> tuple[int, list[str]]:
        """Each replica's decision on its own lines; ``(the limits added up, every replica's
        victims)``. The fleet gets each replica's limit."""
        fleet = self.fleet()
        self._follow(fleet)
        limits, doomed = {}, []
        for url, lane in self.lanes.items():
            mine = {rid: b for rid, b in running.items() if fleet.replica_of(rid) == url}
            lane.lines_sent = fleet.sent_to.get(url, 0)
            decision = lane.controller.update(
                now, lane.server.read(), len(mine), urgent_held, sent=lane.lines_sent
            )
            level = logging.INFO if decision.limit != decision.previous else logging.DEBUG
            log.log(level, "%s @ %s: %s", self.model, url, decision.explain())
            lane.decisions.append(decision)
            self.decisions.append(decision)
            limits[url] = decision.limit
            doomed += victims(mine, decision.limit, urgent)
        fleet.set_replica_limits(limits)
        return sum(limits.values()), doomed

    def _follow(self, fleet: Any) -> None:
        urls = set(fleet.replica_urls())
        for url in [u for u in self.lanes if u not in urls]:
            _close(self.lanes.pop(url).server)
        for url in urls - set(self.lanes):
            controller = LaneController(self.settings, fleet.replica_room, self.step_model)
            server = self._scraper(f"{url}/metrics")
            self.lanes[url] = LaneSteering(controller, server, self.model, export_metrics=False)


def _close(server: Any) -> None:
    if hasattr(server, "close"):
        server.close()


def steering_for(
    engine: Any,
    fleet: Callable[[], Any],
    policy: SchedulerSettings,
    config: ModelConfig | None,
    max_num_seqs: int,
    step_model: StepModel,
    server: ServerMetrics | None,
    model: str,
    *,
    export_metrics: bool = True,
) -> LaneSteering | FleetSteering | None:
    """A fleet's lanes for a ``FleetEngine`` (lane not switched off), else
    ``LaneSteering.for_model``."""
    if hasattr(engine, "set_replica_limits") and config is not None:
        if policy.lane.enabled is False:
            return None
        return FleetSteering(fleet, policy, config, step_model, model)
    return LaneSteering.for_model(
        policy, config, max_num_seqs, step_model, server, model, export_metrics=export_metrics
    )
