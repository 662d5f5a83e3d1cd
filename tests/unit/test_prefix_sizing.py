"""Lines that share a prompt prefix, in the runner: an engine with prefix caching holds the shared
blocks once, so sizing counts each line without the whole blocks it shares with another; and a
chunk keeps the claim's order of prefix groups."""

from __future__ import annotations

from workers.scheduler.chunking import EngineRoom, shared_prefix_tokens, size_for

DOCUMENT = list(range(1000, 1600))  # 600 tokens


def test_shared_prefix_tokens_counts_whole_blocks_after_the_first_of_a_group() -> None:
    other = list(range(5000, 5600))
    prompts = [
        [*DOCUMENT, 1, 2, 3],
        [*other, 7],
        [*DOCUMENT, 4, 5],
        [*DOCUMENT, 1, 2, 9],
        [*other, 8, 8],
    ]
    shared = shared_prefix_tokens(prompts, 32)
    # One line of each document computes it all; the others reuse 18 whole blocks (576 of 600
    # shared tokens, or 603 of 601: the line's own last token is always computed).
    assert sorted(shared) == [0, 0, 576, 576, 576]
    assert shared[0] == 0 or shared[3] == 0
    assert shared_prefix_tokens([[1, 2, 3], [1, 2, 3]], 1) == [0, 2]
    assert shared_prefix_tokens([], 32) == []


def test_lines_sharing_a_document_fit_more_slots_with_prefix_caching() -> None:
    room = EngineRoom(max_num_seqs=128, kv_cache_tokens=3488, kv_bytes_per_token=46080,
                      block_size=32, prefix_caching=True)  # fmt: skip
    prompts = [[*DOCUMENT, q] for q in range(6)]
    alone = [(len(p), 32) for p in prompts]
    shared = shared_prefix_tokens(prompts, room.block_size)
    together = [(len(p) - s, 32) for p, s in zip(prompts, shared, strict=True)]
    assert size_for(alone, room, 2048).slots <= 5
    assert size_for(together, room, 2048).slots >= 3 * size_for(alone, room, 2048).slots


def test_a_chunk_keeps_the_claims_group_order() -> None:
    """Within a chunk, prefix groups stay in the claim's order (a group the claim cut in two
    ends the chunk, next to its rest in the next one), prompts in token order within each."""
    from workers.scheduler.chunking import prefix_order

    # (group, prompt): group 7's prompts sort first by tokens, but the claim put group 2 first.
    items = [(7, [1, 2, 3]), (2, [9, 9]), (7, [1, 2, 0]), (2, [8, 1])]
    ordered = prefix_order(items, lambda item: item[1], lambda item: item[0])
    assert ordered == [(2, [8, 1]), (2, [9, 9]), (7, [1, 2, 0]), (7, [1, 2, 3])]
    # Without groups: token order alone, as before.
    assert prefix_order(items, lambda item: item[1])[0] == (7, [1, 2, 0])


def test_within_a_group_the_longest_decodes_go_first() -> None:
    """A line whose budget is 10x its siblings' starts with its group, not after it; budgets
    near the group's median keep the token order, and groups keep the claim's order."""
    from workers.scheduler.chunking import prefix_order

    # (group, prompt, max_tokens)
    items = [(5, [1, 1], 32), (5, [1, 2], 40), (5, [1, 3], 400), (3, [2, 0], 16), (3, [2, 1], 17)]
    ordered = prefix_order(items, lambda item: item[1], lambda item: item[0], lambda item: item[2])
    assert ordered == [
        (3, [2, 0], 16), (3, [2, 1], 17), (5, [1, 3], 400), (5, [1, 1], 32), (5, [1, 2], 40)
    ]  # fmt: skip
    # Without budgets: token order within each group, as before.
    plain = prefix_order(items, lambda item: item[1], lambda item: item[0])
    assert [item[2] for item in plain] == [16, 17, 32, 40, 400]
