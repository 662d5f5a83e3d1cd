"""From a claimed chunk to lines ready for the engine: the attempts cap, preparation (a line's
body becomes an engine request, or fails alone) and the order lines join in."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

import orjson

from storage.repositories.requests import ClaimedRequest, FinishedLine
from workers import engine_io
from workers.engine.base import Engine, EngineFault
from workers.engine_io import LineError
from workers.runner import results
from workers.runner.held import HeldLine
from workers.scheduler.chunking import prefix_order

log = logging.getLogger(__name__)

#: Engine priority of urgent batches' lines (vLLM: lower runs first; others are 0).
URGENT_PRIORITY = -1


@dataclass
class PreparedChunk:
    """What a claimed chunk became: ``ready`` lines in the order they should join the engine,
    lines that ``failed`` alone, and ``poison`` rows failed for killing the engine."""

    ready: list[HeldLine] = field(default_factory=list)
    failed: list[FinishedLine] = field(default_factory=list)
    poison: list[ClaimedRequest] = field(default_factory=list)


def prepare_chunk(
    claimed: list[ClaimedRequest],
    engine: Engine,
    *,
    held: Collection[int],
    urgent: Collection[str],
    max_attempts: int,
    at: float,
) -> PreparedChunk:
    """Prepare ``claimed`` rows for ``engine``. Rows in ``held`` (already running here: our own
    lease had lapsed and the claim took them back) are skipped. A row claimed more than
    ``max_attempts`` times fails with ``engine_failure``; a body the endpoint rejects fails with
    its ``LineError``; a bug in preparation fails that line alone with ``internal_error``.
    Ready lines of ``urgent`` batches get ``URGENT_PRIORITY`` and go first; within each group,
    lines sharing a prompt prefix are next to each other (the prefix cache's hit rate)."""
    chunk = PreparedChunk()
    for row in claimed:
        if row.id in held:
            continue
        if row.attempts > max_attempts:
            # It was inside a dying engine or worker every time it ran (and alone among
            # suspects since the first): this line is the cause; it fails alone.
            chunk.failed.append(results.failed(row, results.crashed_engine(row.attempts - 1), at))
            chunk.poison.append(row)
            log.error(
                "line %s of %s (custom_id %r) was running in %d engine failures: failed",
                row.id,
                row.batch_id,
                row.custom_id,
                row.attempts - 1,
            )
            continue
        try:
            line = orjson.loads(row.line_json)
            prepared = engine_io.prepare(str(row.id), line["url"], line["body"], engine)
        except LineError as exc:
            chunk.failed.append(results.failed(row, exc, at))
            continue
        except EngineFault:
            raise  # the engine cannot tokenize (a remote server away): no line's fault
        except Exception:  # our bug, not the client's: fail this line alone, keep the chunk
            log.exception("cannot prepare line %s of %s", row.id, row.batch_id)
            chunk.failed.append(results.failed(row, results.internal_error(), at))
            continue
        if row.batch_id in urgent:
            prepared.request.priority = URGENT_PRIORITY
        chunk.ready.append(HeldLine(row, prepared))
    chunk.ready = prefix_order(chunk.ready, lambda h: h.prepared.request.prompt_token_ids)
    if urgent:  # stable: lines sharing a prefix stay together
        chunk.ready.sort(key=lambda h: h.row.batch_id not in urgent)
    return chunk
