"""The scheduler's admin switch and view: pause or resume batch work on one worker pool or all,
and see the load, the switches and every running batch's slack.

Workers read the switch every ``load_poll_seconds`` (``workers.scheduler.signals``); a pause
works like high real-time load (running work of non-urgent batches goes back to pending, urgent
batches keep running), a hard pause stops urgent batches too.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from sqlalchemy.orm import Session

from api.schemas.admin import BatchSchedule, PauseSwitch, PoolLoad, SchedulerView
from offpeak import scheduler_state
from offpeak.scheduler_state import ALL_POOLS
from storage.repositories import scheduler as scheduler_repo


def _schema(switch: scheduler_state.PauseSwitch) -> PauseSwitch:
    return PauseSwitch(**asdict(switch))


def pause(
    session: Session, pool: str = ALL_POOLS, *, hard: bool = False, reason: str | None = None
) -> PauseSwitch:
    """Turn the switch of ``pool`` (``"*"``: every pool) on (``scheduler_repo.pause``)."""
    return _schema(scheduler_repo.pause(session, pool, hard=hard, reason=reason, at=time.time()))


def resume(session: Session, pool: str = ALL_POOLS) -> PauseSwitch:
    """Turn the switch of ``pool`` off (``scheduler_repo.resume``)."""
    return _schema(scheduler_repo.resume(session, pool, at=time.time()))


def view(session: Session) -> SchedulerView:
    """The switches that are on, each pool's last load reading, and the running batches."""
    switches = [_schema(switch) for switch in scheduler_repo.switches(session)]
    pools = [
        PoolLoad(
            pool=pool,
            load=value.get("load"),
            gate_open=value.get("gate_open"),
            paused=bool(value.get("paused")),
            parts=value.get("parts") or {},
            errors=value.get("errors") or {},
            worker=value.get("worker"),
            updated_at=updated_at,
        )
        for pool, value, updated_at in scheduler_repo.load_readings(session)
    ]
    batches = [
        BatchSchedule(
            id=b.batch_id,
            model=b.model,
            expires_at=b.expires_at,
            estimated_completion_at=None
            if b.estimated_completion_at is None
            else int(b.estimated_completion_at),
            slack_seconds=None
            if b.estimated_completion_at is None
            else round(b.expires_at - b.estimated_completion_at, 1),
            remaining=max(0, b.total - b.completed - b.failed),
        )
        for b in scheduler_repo.running_batches(session)
    ]
    return SchedulerView(switches=switches, pools=pools, batches=batches)
