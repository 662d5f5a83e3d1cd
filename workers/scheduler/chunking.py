"""Chunking: how much to claim, how many sequences the engine runs, and the order a chunk
joins it in.

The engine's room is its sequence limit (``max_num_seqs``) and its KV cache, as the engine
declares them. How many sequences of *these* requests fit is
``workers.planner.choose_engine_limits`` (paged KV cache, each request counted at
``prompt + max_tokens`` so none is preempted). The runner keeps ``slots`` sequences running
and about as many waiting in its own queue, and claims the difference: large chunks while the
engine runs, so it never waits for a claim round trip.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from offpeak.settings import GPU_MAX_NUM_SEQS, ModelConfig
from workers.engine.base import Engine
from workers.planner import DEFAULT_BLOCK_SIZE, choose_engine_limits

T = TypeVar("T")

#: Prompt tokens compared when grouping a chunk by shared prefix: enough to cover a long system
#: prompt; requests that agree this far share what prefix caching can reuse.
PREFIX_KEY_TOKENS = 1024


@dataclass(frozen=True)
class EngineRoom:
    """What an engine can hold: ``max_num_seqs`` sequences and, when known, a KV cache of
    ``kv_cache_tokens`` tokens at ``kv_bytes_per_token`` bytes each in blocks of ``block_size``."""

    max_num_seqs: int
    kv_cache_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE


def engine_room(engine: Engine, config: ModelConfig | None) -> EngineRoom:
    """The room ``engine`` declares (``Engine.capabilities``); an unknown ``max_num_seqs`` is
    the model's configured one for a GPU, and an unknown KV cache leaves the room at
    ``max_num_seqs`` alone."""
    caps = engine.capabilities
    max_num_seqs = caps.max_num_seqs or (
        config.max_num_seqs_on(on_cpu=False) if config else GPU_MAX_NUM_SEQS
    )
    return EngineRoom(
        max_num_seqs=max(1, int(max_num_seqs)),
        kv_cache_tokens=int(caps.kv_cache_tokens) if caps.kv_cache_tokens else None,
        kv_bytes_per_token=int(caps.kv_bytes_per_token) if caps.kv_bytes_per_token else None,
        block_size=int(caps.block_size or DEFAULT_BLOCK_SIZE),
    )


@dataclass(frozen=True)
class Sizing:
    """How many sequences of a working set run at once, and the planner's explanation."""

    slots: int
    explanation: str


def size_for(needs: Sequence[tuple[int, int]], room: EngineRoom, model_max_len: int) -> Sizing:
    """Slots for requests of ``(prompt_tokens, max_tokens)`` (one entry per sequence).

    With a known KV cache, ``choose_engine_limits`` decides; its cap at the list's length is
    lifted (a working set smaller than the engine's room says nothing about the next claim), so
    ``slots`` is what fits, at most ``room.max_num_seqs``. Raises ``ValueError`` for no needs.
    """
    if not needs:
        raise ValueError("nothing to size")
    if room.kv_cache_tokens is None or room.kv_bytes_per_token is None:
        return Sizing(
            room.max_num_seqs,
            f"{len(needs):,} sequences held; KV cache size unknown -> max_num_seqs "
            f"{room.max_num_seqs:,}",
        )
    prompts = [p for p, _ in needs]
    replies = [m for _, m in needs]
    budget = room.kv_cache_tokens * room.kv_bytes_per_token
    # Repeating the list (same average need) shows how many would fit beyond its own length.
    repeat = max(1, math.ceil(room.max_num_seqs / len(needs)))
    fit, _, _ = choose_engine_limits(
        prompts * repeat,
        replies * repeat,
        room.kv_bytes_per_token,
        budget,
        model_max_len,
        room.block_size,
        room.max_num_seqs,
    )
    _, _, explanation = choose_engine_limits(
        prompts,
        replies,
        room.kv_bytes_per_token,
        budget,
        model_max_len,
        room.block_size,
        room.max_num_seqs,
    )
    return Sizing(fit, f"{explanation}; engine slots {fit:,} (max_num_seqs {room.max_num_seqs:,})")


def claim_size(slots: int, held: int, queue_depth: float, chunk_size: int, min_claim: int) -> int:
    """Lines to claim now: enough to hold ``slots × queue_depth``, at most ``chunk_size``.

    While lines are held, nothing is claimed until at least half the slots' worth (and
    ``min_claim``) is missing: the engine still has its slots full and a queue behind them, and
    the claim that refills the queue is a large one rather than a round trip per finished line.
    """
    want = max(1, math.ceil(slots * max(1.0, queue_depth))) - held
    if want <= 0 or (held and want < max(min_claim, slots // 2)):
        return 0
    return min(want, chunk_size)


def prefix_order(items: Sequence[T], tokens: Callable[[T], Sequence[int]]) -> list[T]:
    """``items`` sorted so that prompts sharing a prefix are adjacent (lexicographic order of
    their first ``PREFIX_KEY_TOKENS`` token ids); stable, so equal prompts keep their order.

    Adjacent requests reach the engine together, so the first one's prefix blocks are still in
    the cache when the rest are prefilled (vLLM's automatic prefix caching).
    """
    # Sequences of one engine compare as they are (lists with lists): no tuple copied per item.
    return sorted(items, key=lambda item: tokens(item)[:PREFIX_KEY_TOKENS])
