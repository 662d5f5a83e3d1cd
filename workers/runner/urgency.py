"""Urgent batches: every ``estimate_seconds`` the slack of each running batch is estimated
(``workers.scheduler.slack``); a batch whose slack fell below its margin is urgent, and runs
whatever the load until it ends."""

from __future__ import annotations

import logging
import math

from offpeak.settings import Settings
from storage.errors import TRANSIENT_DB_ERRORS
from workers.planner import StepModel
from workers.scheduler import scheduler_metrics as metrics
from workers.scheduler.slack import Estimate, refresh_estimates
from workers.scheduler.store import WorkStore

log = logging.getLogger(__name__)


class Urgency:
    """One model's slack estimates and its urgent batches."""

    def __init__(
        self, settings: Settings, store: WorkStore, model: str, *, export_metrics: bool = True
    ) -> None:
        self.settings, self.store, self.model = settings, store, model
        self.export_metrics = export_metrics
        #: Batches that are urgent now (kept until they end, so they do not flap).
        self.urgent: set[str] = set()
        #: Every batch that has been urgent in this process (the simulation reports it).
        self.seen: set[str] = set()
        self.estimates: dict[str, Estimate] = {}
        #: Clock time of the next refresh.
        self.next_at = -math.inf

    def due(self, at: float) -> bool:
        """Whether a refresh is due at clock time ``at`` (the next one is then scheduled)."""
        if at < self.next_at:
            return False
        self.next_at = at + self.settings.scheduler.estimate_seconds
        return True

    def refresh(
        self,
        at: float,
        step_model: StepModel,
        slots: int,
        local_rate: float | None,
        startup_seconds: float,
    ) -> None:
        """Refresh every running batch's estimate at clock time ``at`` (arguments as
        ``refresh_estimates``); a database outage leaves the last ones in place."""
        try:
            estimates = refresh_estimates(
                self.store,
                self.settings,
                self.model,
                at,
                step_model,
                slots,
                local_rate=local_rate,
                startup_seconds=startup_seconds,
            )
        except TRANSIENT_DB_ERRORS as exc:
            log.warning("cannot refresh the slack estimates: %s", exc)
            return
        ended = set(self.estimates) - {e.batch_id for e in estimates}
        self.estimates = {e.batch_id: e for e in estimates}
        self.urgent &= set(self.estimates)
        for e in estimates:
            if e.urgent and e.batch_id not in self.urgent:
                self.urgent.add(e.batch_id)
                self.seen.add(e.batch_id)
                log.warning(
                    "batch %s is urgent: %d lines (~%.0f tokens) left, slack %.0f s < margin "
                    "%.0f s; it runs whatever the load",
                    e.batch_id,
                    e.remaining_lines,
                    e.remaining_tokens,
                    e.slack_seconds,
                    e.margin_seconds,
                )
        if self.export_metrics:
            metrics.observe_estimates(self.model, estimates, ended)
