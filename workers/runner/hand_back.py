"""The loop's exits: every held line handed back to pending after a fault (``give_back``) or
on a stop (``hand_back_all``), what finished written first."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from workers import lifecycle
from workers.engine.base import Engine
from workers.runner import results
from workers.runner.held import HeldLines
from workers.runner.write_back import ResultWriter

log = logging.getLogger(__name__)

#: Seconds a stopping runner leaves before its stop's deadline for the engine to close and the
#: process to exit, when it keeps retrying a write-back (``hand_back_all``).
STOP_MARGIN_SECONDS = 5.0


def abort_quietly(engine: Engine, request_ids: list[str]) -> None:
    """``engine.abort``, logging rather than raising: a dead engine holds nothing any more."""
    if not request_ids:
        return
    try:
        engine.abort(request_ids)
    except Exception as exc:
        log.warning("engine abort failed (%r); handing the lines back anyway", exc)


def give_back(
    engine: Engine,
    held: HeldLines,
    writer: ResultWriter,
    flush: Callable[[], None],
    *,
    count_attempt: bool = True,
) -> None:
    """The loop raised (the engine failed, a bug, the database refused a write): write what
    finished (``flush``) and hand the rest back so it runs again (here or elsewhere) without
    waiting for the lease. Lines that were inside the engine keep the attempt their claim
    counted: one of them may be the cause (``workers.runner.held.SUSPECT_ATTEMPTS``); queued
    lines do not, nor does any line with ``count_attempt=False`` (a blameless engine fault)."""
    running = held.take_running(lambda _h: True)
    queued = held.take_queued(lambda _h: True)
    abort_quietly(engine, [h.request_id for h in running])
    unwritable: list[results.Finished] = []
    try:
        flush()
    except Exception:
        # Not an outage (the writer keeps results through those): the database refuses
        # these results and would refuse them again. Their lines run again instead.
        log.exception("the database refused %d results; their lines go back", len(writer.pending))
        unwritable = writer.drop_pending()
    finally:
        writer.release([h.row for h in running], count_attempt=count_attempt)
        writer.release([h.row for h in queued], count_attempt=False)
        writer.release_ids(
            [r.id for r in unwritable], {r.batch_id for r in unwritable}, count_attempt=True
        )


def hand_back_all(
    engine: Engine,
    held: HeldLines,
    writer: ResultWriter,
    flush: Callable[[], None],
    flush_seconds: float,
) -> None:
    """The worker is stopping: abort what runs, write what finished, and hand every held line
    back to pending without counting an attempt (nothing went wrong with them).

    The finished lines' results are the only copy: while the database is unreachable the
    write-back is tried again every ``flush_seconds`` until ``STOP_MARGIN_SECONDS`` before the
    stop's deadline (``lifecycle.stop_deadline``) rather than left to run again once their
    leases run out."""
    running = held.take_running(lambda _h: True)
    queued = held.take_queued(lambda _h: True)
    abort_quietly(engine, [h.request_id for h in running])
    flush()
    deadline = lifecycle.stop_deadline()
    while writer.pending and deadline is not None:
        if time.monotonic() + flush_seconds + STOP_MARGIN_SECONDS > deadline:
            log.warning(
                "stopping with %d results unwritten (the database is unreachable): their "
                "lines run again once their leases run out",
                len(writer.pending),
            )
            break
        time.sleep(flush_seconds)
        flush()
    writer.release([h.row for h in (*running, *queued)], count_attempt=False)
    if running or queued:
        log.info("stopping: %d lines handed back to pending", len(running) + len(queued))
