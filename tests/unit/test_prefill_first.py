"""A long shared prefix is prefilled once: the first line of a prefix group runs alone for its
prefill, and its siblings join after it, so they find the prefix in the KV cache. On an engine
that caches a prompt's blocks only once it has computed them, lines joining together would each
compute the whole prefix. The wait is bounded and ends with the first line, and the chunk's
lines and their answers are unchanged."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import orjson

from storage.repositories.requests import ClaimedRequest
from workers.engine.base import EngineCapabilities, EngineRequest, EngineResult
from workers.engine.instant import InstantEngine
from workers.engine_io import LineError
from workers.runner.admission import prepare_chunk
from workers.runner.held import MAX_PREFILL_STEPS, HeldLine, HeldLines
from workers.scheduler.prefix_groups import prefix_group

BLOCK = 4  # tokens (bytes) per KV block


class CachingEngine(InstantEngine):
    """The instant engine with a prefix cache that learns a prompt's whole blocks at the end of
    the step that prefilled it (as an engine prefilling in several steps, or caching after
    compute); a request runs ``steps`` steps, ``max_tokens`` by default. Counts the prompt
    tokens it computed and records the requests that joined before each step."""

    capabilities = EngineCapabilities(prefix_caching=True, block_size=BLOCK, max_num_seqs=64)

    def __init__(self, steps: dict[str, int] | None = None) -> None:
        super().__init__("m", max_model_len=1 << 20)
        self.cache: set[int] = set()
        self.computed = 0
        self.joined: list[list[str]] = []
        self._new: list[EngineRequest] = []
        self._running: dict[str, tuple[EngineRequest, int]] = {}
        self._steps = steps or {}

    def add(self, request: EngineRequest) -> None:
        self._new.append(request)
        steps = self._steps.get(request.request_id, request.sampling.max_tokens)
        self._running[request.request_id] = (request, steps)

    def step(self) -> list[EngineResult]:
        self.joined.append([r.request_id for r in self._new])
        # Every new prompt looks the cache up before any of them is stored in it.
        chains = [_block_chain(request.prompt_token_ids) for request in self._new]
        for request, chain in zip(self._new, chains, strict=True):
            # A prompt's last token is always computed: its last block, if whole, is not reused.
            usable = chain[: (len(request.prompt_token_ids) - 1) // BLOCK]
            hits = next((i for i, key in enumerate(usable) if key not in self.cache), len(usable))
            self.computed += len(request.prompt_token_ids) - hits * BLOCK
        for chain in chains:
            self.cache.update(chain)
        self._new.clear()
        finished = []
        for request_id, (request, left) in list(self._running.items()):
            if left > 1:
                self._running[request_id] = (request, left - 1)
                continue
            del self._running[request_id]
            completions = self._completions(request.sampling.max_tokens, False, 1)
            finished.append(EngineResult(request_id, len(request.prompt_token_ids), 0, completions))
        return finished

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._running.pop(request_id, None)

    def num_unfinished(self) -> int:
        return len(self._running)


def _block_chain(prompt: list[int]) -> list[int]:
    """A key per whole block of ``prompt``: the hash of the block and every block before it."""
    keys, key = [], 0
    for end in range(BLOCK, len(prompt) + 1, BLOCK):
        key = hash((key, *prompt[end - BLOCK : end]))
        keys.append(key)
    return keys


def _row(row_id: int, content: str, max_tokens: int = 3) -> ClaimedRequest:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    line = {"custom_id": f"c{row_id}", "method": "POST", "url": "/v1/chat/completions"}
    return ClaimedRequest(
        row_id, "b", f"c{row_id}", orjson.dumps({**line, "body": body}).decode(), 1,
        prefix_group(body),
    )  # fmt: skip


def _refused(held: HeldLine, error: LineError) -> None:
    raise AssertionError(f"refused {held.request_id}: {error}")


def _run(engine: CachingEngine, rows: Iterable[ClaimedRequest], feed: int = 16) -> list[str]:
    """Queue ``rows`` as one chunk and step ``engine`` until every line ended; the ids of the
    lines answered, in the order they finished."""
    held = HeldLines()
    chunk = prepare_chunk(list(rows), engine, held=(), urgent=(), max_attempts=3, at=0.0)
    held.queue(chunk.ready)
    answered: list[str] = []
    for _ in range(100):
        held.admit(engine, feed, lambda _b: True, _refused)
        if not held.running:
            break
        for result in engine.step():
            assert held.finished(result.request_id) is not None
            answered.append(result.request_id)
        held.stepped()
    assert not held, "lines left behind"
    return answered


# Prefixes longer than one step's prefill (2048 tokens): the first line needs 2 steps.
DOC_A = "Document A: " + "the lease runs five years. " * 80 + "\n"
DOC_B = "Document B: " + "rent is due each month on the first. " * 60 + "\n"
SHORT = "Hi, " * 100 + "\n"  # shared, but one step prefills it whole: nobody waits


def _joined_at(engine: CachingEngine) -> dict[str, int]:
    return {request_id: step for step, ids in enumerate(engine.joined) for request_id in ids}


def test_siblings_join_after_their_first_line_prefilled_and_reuse_its_prefix() -> None:
    rows = [
        _row(1, DOC_A + "How long?"),
        _row(2, DOC_A + "Who signs?"),
        _row(3, DOC_B + "When?"),
        _row(4, DOC_A + "Rent?"),
        _row(5, DOC_B + "How much?"),
        _row(6, SHORT + "a"),
        _row(7, SHORT + "b"),
    ]
    engine = CachingEngine()
    answered = _run(engine, rows)
    assert sorted(answered) == [str(i) for i in range(1, 8)]
    at = _joined_at(engine)
    # Each document's first line joins alone, beside the lines of a short shared prefix; its
    # siblings join once it has had its two prefill steps.
    assert sorted(at[i] for i in "124") == [0, 2, 2] and sorted(at[i] for i in "35") == [0, 2]
    assert at["6"] == at["7"] == 0
    # The document computed once, as when the lines run one at a time (the least an engine
    # with this cache can compute: each line computes its tail past the prefix's last block).
    questions = [row for row in rows if row.id in (1, 2, 4)]
    together, alone = CachingEngine(), CachingEngine()
    _run(together, questions)
    for row in questions:
        _run(alone, [row])
    assert together.computed == alone.computed


def test_a_first_line_that_never_ends_holds_its_siblings_only_for_its_prefill() -> None:
    """A first line decoding for 50 steps, and one whose prompt needs the most prefill steps:
    the siblings join after its prefill (two steps for a prompt of 2048-4096 tokens, at most
    ``MAX_PREFILL_STEPS``), never after its end."""
    engine = CachingEngine(steps={"1": 50})
    _run(engine, [_row(1, DOC_A + "x"), _row(2, DOC_A + "y"), _row(3, DOC_A + "z")])
    assert _joined_at(engine) == {"1": 0, "2": 2, "3": 2}

    huge = "word " * 20_000 + "\n"  # 100,000 prompt tokens: 49 steps of 2048, capped
    engine = CachingEngine(steps={"1": 100})
    _run(engine, [_row(1, huge + "x"), _row(2, huge + "y")])
    assert _joined_at(engine)["2"] == MAX_PREFILL_STEPS
    assert math.ceil(100_000 / 2048) > MAX_PREFILL_STEPS


def test_siblings_count_against_the_feed_and_lines_behind_them_still_join() -> None:
    engine = CachingEngine()
    rows = [_row(i, DOC_A + f"q{i}") for i in range(1, 5)] + [_row(9, SHORT + "z")]
    _run(engine, rows, feed=3)
    # Feed 3: the first line runs and two siblings wait (counted): nothing else joins.
    assert len(engine.joined[0]) == 1
    engine = CachingEngine()
    _run(engine, rows, feed=16)
    assert "9" in engine.joined[0]


def test_no_wait_without_prefix_caching_or_for_a_dropped_first_line() -> None:
    plain = InstantEngine("m")
    rows = [_row(1, DOC_A + "x"), _row(2, DOC_A + "y")]
    chunk = prepare_chunk(rows, plain, held=(), urgent=(), max_attempts=3, at=0.0)
    assert all(h.leader is None for h in chunk.ready)
    # The first line taken out (a cancel, a lost lease): its siblings join at once.
    engine = CachingEngine()
    held = HeldLines()
    chunk = prepare_chunk(rows, engine, held=(), urgent=(), max_attempts=3, at=0.0)
    held.queue(chunk.ready)
    held.admit(engine, 16, lambda _b: True, _refused)
    assert len(held.running) == 1 and len(held.queued) == 1
    held.take_running(lambda _h: True)
    held.admit(engine, 16, lambda _b: True, _refused)
    assert len(held.running) == 1 and not held.queued
