"""Chunking: how much to claim, how many sequences the engine runs, and the order a chunk
joins it in.

The engine's room is its sequence limit (``max_num_seqs``) and its KV cache. How many sequences
of *these* requests fit is ``workers.planner.choose_engine_limits`` (issue 5's planner: paged
KV cache, each request counted at ``prompt + max_tokens`` so none is preempted). The runner keeps
``slots`` sequences running and about as many waiting in its own queue, and claims the
difference: large chunks while the engine runs, so it never waits for a claim round trip.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from offpeak.settings import GPU_MAX_NUM_SEQS, ModelConfig
from workers.planner import (
    DEFAULT_BLOCK_SIZE,
    choose_engine_limits,
    dtype_bytes,
    kv_bytes_per_token,
)

log = logging.getLogger(__name__)

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


def engine_room(engine: Any, config: ModelConfig | None) -> EngineRoom:
    """The room of a loaded engine.

    An engine may say it itself (attributes ``max_num_seqs``, ``kv_cache_tokens``,
    ``kv_bytes_per_token``, ``block_size``: the simulation's does). For the vLLM adapter the
    numbers come from the loaded ``LLMEngine``'s config (blocks the engine core allocated, the
    model's layers × KV heads × head size × dtype). Anything unknown is left out: the room is
    then ``max_num_seqs`` alone.
    """
    max_num_seqs = int(
        getattr(engine, "max_num_seqs", 0)
        or (config.max_num_seqs_on(on_cpu=False) if config else GPU_MAX_NUM_SEQS)
    )
    tokens = getattr(engine, "kv_cache_tokens", None)
    per_token = getattr(engine, "kv_bytes_per_token", None)
    block = int(getattr(engine, "block_size", 0) or DEFAULT_BLOCK_SIZE)
    llm_engine = getattr(engine, "_llm_engine", None)
    if tokens is None and llm_engine is not None:
        try:
            vllm_config = llm_engine.vllm_config
            cache = vllm_config.cache_config
            block = int(cache.block_size)
            if cache.num_gpu_blocks:
                tokens = int(cache.num_gpu_blocks) * block
            max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
            model_config = llm_engine.model_config
            per_token = kv_bytes_per_token(
                model_config.hf_config.to_dict(),
                dtype_bytes(str(model_config.dtype)),
            )
        except Exception as exc:  # another vLLM release: fall back to max_num_seqs alone
            log.warning("cannot read the engine's KV cache size (%s); sizing by max_num_seqs", exc)
    return EngineRoom(
        max_num_seqs=max(1, max_num_seqs),
        kv_cache_tokens=int(tokens) if tokens else None,
        kv_bytes_per_token=int(per_token) if per_token else None,
        block_size=block,
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
