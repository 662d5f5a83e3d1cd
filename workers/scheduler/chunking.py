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

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from offpeak.model_config import GPU_MAX_NUM_SEQS, ModelConfig
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
    #: The engine reuses cached prompt blocks (a prefix shared by running lines is held once).
    prefix_caching: bool = False


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
        prefix_caching=bool(caps.prefix_caching),
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


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (a binary search of slice
    comparisons, which run in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def shared_prefix_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> list[int]:
    """For each prompt (token ids), the tokens of it in whole KV blocks of ``block_size`` that
    an earlier prompt of the list, in prompt order, already holds: what the engine's prefix
    cache gives it while they run together. The first prompt of every shared prefix gets 0.
    Same order as ``prompts``."""
    order = sorted(range(len(prompts)), key=lambda i: list(prompts[i][:PREFIX_KEY_TOKENS]))
    shared = [0] * len(prompts)
    for before, index in itertools.pairwise(order):
        common = common_prefix(prompts[before], prompts[index])
        # The engine caches whole blocks, and a prompt's last token is always computed.
        common = min(common, len(prompts[index]) - 1)
        shared[index] = common // block_size * block_size
    return shared


def prefix_order(
    items: Sequence[T],
    tokens: Callable[[T], Sequence[int]],
    group: Callable[[T], int] | None = None,
    budget: Callable[[T], int] | None = None,
) -> list[T]:
    """``items`` sorted so that prompts sharing a prefix are adjacent (lexicographic order of
    their first ``PREFIX_KEY_TOKENS`` token ids), within each ``group`` (ascending, the claim's
    order of prefix groups) when given; stable, so equal prompts keep their order.

    Adjacent requests reach the engine together, so the first one's prefix blocks are still in
    the cache when the rest are prefilled (vLLM's automatic prefix caching).

    ``budget`` (a line's most new tokens): within a group, the lines whose budget is at least
    ``LONG_DECODE_FACTOR`` times the group's median go first, so a long decode starts with its
    group rather than holding a slot long after the group's short lines ended; the rest keep the
    token order. Longest-first is list scheduling's rule for a short makespan (Graham, "Bounds on
    multiprocessing timing anomalies", 1969: within 4/3 of the optimum).
    """
    # Sequences of one engine compare as they are (lists with lists): no tuple copied per item.
    ordered = sorted(items, key=lambda item: tokens(item)[:PREFIX_KEY_TOKENS])
    if budget is not None:
        long = long_decodes(ordered, group or (lambda item: 0), budget)
        ordered.sort(key=lambda item: id(item) not in long)  # stable: token order kept
    if group is not None:
        ordered.sort(key=group)  # stable: long decodes, then token order, within a group
    return ordered


#: A line's budget this many times its group's median makes it a long decode (``prefix_order``).
LONG_DECODE_FACTOR = 4


def long_decodes(
    items: Sequence[T], group: Callable[[T], int], budget: Callable[[T], int]
) -> set[int]:
    """The ``id()`` of each item whose ``budget`` is at least ``LONG_DECODE_FACTOR`` times the
    median budget of its ``group``."""
    budgets: dict[int, list[int]] = {}
    for item in items:
        budgets.setdefault(group(item), []).append(budget(item))
    medians = {key: sorted(values)[len(values) // 2] for key, values in budgets.items()}
    return {
        id(item)
        for item in items
        if budget(item) >= LONG_DECODE_FACTOR * max(medians[group(item)], 1)
    }
