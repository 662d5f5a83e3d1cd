"""From a claimed chunk to lines ready for the engine: the attempts cap, preparation (a line's
body becomes an engine request, or fails alone) and the order lines join in."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import orjson

from storage.repositories.requests import ClaimedRequest, FinishedLine
from workers import engine_io
from workers.engine.base import Engine, EngineCapabilities, EngineFault, LoraSpec
from workers.engine_io import LineError
from workers.planner import DEFAULT_BLOCK_SIZE
from workers.runner import results
from workers.runner.held import PREFILL_TOKENS_PER_STEP, HeldLine
from workers.scheduler.chunking import common_prefix, prefix_order
from workers.scheduler.prefix_groups import NO_GROUP

log = logging.getLogger(__name__)

#: Engine priority of urgent batches' lines (vLLM: lower runs first; others are 0).
URGENT_PRIORITY = -1
#: KV blocks a prefix must span for its group's first line to prefill alone (``mark_leaders``).
LONG_PREFIX_BLOCKS = 4


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
    adapters: Callable[[str], LoraSpec] | None = None,
) -> PreparedChunk:
    """Prepare ``claimed`` rows for ``engine``. Rows in ``held`` (already running here: our own
    lease had lapsed and the claim took them back) are skipped. A row claimed more than
    ``max_attempts`` times fails with ``engine_failure``; a body the endpoint rejects fails with
    its ``LineError``; a bug in preparation fails that line alone with ``internal_error``.
    Ready lines of ``urgent`` batches get ``URGENT_PRIORITY`` and go first; then prefix group
    by prefix group, as claimed, and within a group lines sharing a prompt prefix are next to
    each other (the prefix cache's hit rate).

    A line whose ``model`` is not the engine's names a LoRA adapter of it: ``adapters`` gives
    the adapter (or raises the ``LineError`` that fails the line alone), and the ready lines are
    grouped by adapter (``adapter_order``).

    On an engine with prefix caching, a line sharing a long prefix with its group's first line
    in the chunk waits for that line's prefill (``mark_leaders``)."""
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
            if prepared.model != engine.model_name:
                if adapters is None:
                    raise LineError(
                        f"The model '{prepared.model}' does not exist.",
                        "model",
                        "model_not_found",
                        status_code=404,
                    )
                prepared.request.lora = adapters(prepared.model)
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
    # Groups in the claim's order: a group the claim cut in two ends this chunk, and the next
    # chunk starts with the rest of it, so its prefix is still cached when they run. Within a
    # group the longest decodes start first, so none holds a slot long after its group ended.
    chunk.ready = prefix_order(
        chunk.ready,
        lambda h: h.prepared.request.prompt_token_ids,
        lambda h: h.row.prefix_group,
        lambda h: h.prepared.request.sampling.max_tokens,
    )
    chunk.ready = adapter_order(chunk.ready)
    if urgent:  # stable: lines sharing a prefix stay together
        chunk.ready.sort(key=lambda h: h.row.batch_id not in urgent)
    long_prefix = long_prefix_tokens(engine.capabilities)
    if long_prefix is not None:
        mark_leaders(chunk.ready, long_prefix)
    return chunk


def long_prefix_tokens(caps: EngineCapabilities) -> int | None:
    """Prompt tokens a line must share with its group's first line to wait for its prefill:
    ``LONG_PREFIX_BLOCKS`` of the engine's KV blocks, and more than one engine step prefills
    (``PREFILL_TOKENS_PER_STEP``); ``None`` (no waits) for an engine without prefix caching, or
    a remote one (its server schedules what it is sent).

    A prefix that one step prefills whole is not waited for: vLLM (v1) registers a prompt's
    blocks as it schedules them, so siblings scheduled in the same step already share them,
    and a wait would only let other groups' first lines reach the engine's queue ahead of the
    siblings, whose prefix the cache may then evict before they run."""
    if not caps.prefix_caching or caps.step_is_poll:
        return None
    return max(
        LONG_PREFIX_BLOCKS * (caps.block_size or DEFAULT_BLOCK_SIZE), PREFILL_TOKENS_PER_STEP
    )


def mark_leaders(lines: list[HeldLine], long_prefix: int) -> None:
    """Set ``leader`` of each line in ``lines`` (a chunk, in its order) that shares at least
    ``long_prefix`` prompt tokens with the first line of its prefix group and LoRA adapter
    before it: ``HeldLines.admit`` then holds it until that line has prefilled alone, so the
    siblings find the prefix in the KV cache instead of all computing it at once: an engine that
    prefills a long prompt over several steps (chunked prefill) registers only the part it
    scheduled, and siblings joining beside it would compute the rest again."""
    first: dict[tuple[int, str | None], HeldLine] = {}
    for line in lines:
        if line.row.prefix_group == NO_GROUP:
            continue
        lora = line.prepared.request.lora
        key = (line.row.prefix_group, lora.name if lora is not None else None)
        leader = first.setdefault(key, line)
        if leader is line:
            continue
        shared = common_prefix(
            leader.prepared.request.prompt_token_ids, line.prepared.request.prompt_token_ids
        )
        if shared >= long_prefix:
            line.leader = leader


def adapter_order(lines: list[HeldLine]) -> list[HeldLine]:
    """``lines`` grouped by LoRA adapter, the base model's first, then each adapter's in the
    order it first appears; stable within a group (the prefix order is kept). A chunk mixing
    many adapters then holds few at a time in the engine's ``max_loras`` slots, rather than
    loading one in and out for every line."""
    first: dict[str | None, int] = {}
    for line in lines:
        lora = line.prepared.request.lora
        first.setdefault(lora.name if lora is not None else None, len(first))
    if len(first) < 2:
        return lines

    def group(line: HeldLine) -> int:
        lora = line.prepared.request.lora
        return -1 if lora is None else first[lora.name]

    return sorted(lines, key=group)
