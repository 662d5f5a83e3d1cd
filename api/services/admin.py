"""The scheduler's admin switch and view: pause or resume batch work on one worker pool or all,
and see the load, the switches and every running batch's slack.

Workers read the switch every ``load_poll_seconds`` (``workers.scheduler.signals``); a pause
works like high real-time load (running work of non-urgent batches goes back to pending, urgent
batches keep running), a hard pause stops urgent batches too.
"""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from api.schemas import BatchSchedule, PauseSwitch, PoolLoad, SchedulerView
from storage.repositories import scheduler as scheduler_repo

ALL_POOLS = "*"


def _pool_of(key: str) -> str:
    return ALL_POOLS if key == scheduler_repo.PAUSE_ALL else key.split(":", 1)[1]


def pause(
    session: Session, pool: str = ALL_POOLS, *, hard: bool = False, reason: str | None = None
) -> PauseSwitch:
    """Turn the switch of ``pool`` (``"*"``: every pool) on; idempotent (a second call only
    updates ``hard`` and ``reason``)."""
    at = time.time()
    value = {"paused": True, "hard": hard, "reason": reason, "at": at}
    scheduler_repo.put_state(session, scheduler_repo.pause_key(pool), value, at)
    return PauseSwitch(pool=pool or ALL_POOLS, paused=True, hard=hard, reason=reason, updated_at=at)


def resume(session: Session, pool: str = ALL_POOLS) -> PauseSwitch:
    """Turn the switch of ``pool`` off; idempotent. A pool paused by ``"*"`` stays paused until
    ``"*"`` resumes too (the answer says so in ``reason``)."""
    scheduler_repo.delete_state(session, scheduler_repo.pause_key(pool))
    still = None
    if pool not in (ALL_POOLS, "", None):
        everyone = scheduler_repo.get_states(session, [scheduler_repo.PAUSE_ALL])
        if everyone.get(scheduler_repo.PAUSE_ALL, {}).get("paused"):
            still = "every pool is still paused ('*')"
    return PauseSwitch(
        pool=pool or ALL_POOLS,
        paused=still is not None,
        hard=False,
        reason=still,
        updated_at=time.time(),
    )


def view(session: Session) -> SchedulerView:
    """The switches that are on, each pool's last load reading, and the running batches."""
    switches = [
        PauseSwitch(
            pool=_pool_of(key),
            paused=bool(value.get("paused")),
            hard=bool(value.get("hard")),
            reason=value.get("reason"),
            updated_at=updated_at,
        )
        for key, (value, updated_at) in sorted(
            scheduler_repo.states_with_prefix(session, scheduler_repo.PAUSE_ALL).items()
        )
    ]
    pools = [
        PoolLoad(
            pool=key.split(":", 1)[1],
            load=value.get("load"),
            gate_open=value.get("gate_open"),
            paused=bool(value.get("paused")),
            parts=value.get("parts") or {},
            errors=value.get("errors") or {},
            worker=value.get("worker"),
            updated_at=updated_at,
        )
        for key, (value, updated_at) in sorted(
            scheduler_repo.states_with_prefix(session, "load:").items()
        )
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
