"""Validation's duplicate custom_ids: found exactly, in memory that does not grow with the ids'
text (a file of 2,000,000 lines once held every id in a set, about 200 MB)."""

from __future__ import annotations

import tracemalloc

import orjson

from offpeak.settings import ModelConfig, Settings
from workers.custom_ids import CustomIdHashes, duplicates
from workers.validation import _Checker

MODEL = "m"
LINES = 100_000


def _line(custom_id: str) -> bytes:
    return orjson.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
        }
    )


def test_the_checker_keeps_no_custom_id_text() -> None:
    """What the checker holds after 100,000 lines with 40-character ids: about 8 bytes a line
    (their hashes), not the ids (over 80 bytes a line with a set's table)."""
    settings = Settings(models={MODEL: ModelConfig(engine="instant")})
    checker = _Checker("/v1/chat/completions", {MODEL}, settings, MODEL)
    lines = [_line(f"request-{n:032d}") for n in range(LINES)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for number, raw in enumerate(lines, start=1):
            problem, _ = checker.check(number, raw)
            assert problem is None
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 16 * LINES, f"the checker holds {held / LINES:.0f} bytes a line"
    assert checker.custom_ids.repeated() == set()


def test_repeats_are_found_exactly_and_in_line_order() -> None:
    ids = ["a", "b", "a", "c", "b", "a"]
    hashes = CustomIdHashes()
    for custom_id in ids:
        hashes.add(custom_id)
    repeated = hashes.repeated()
    assert repeated == {hash("a"), hash("b")}
    lines = [(n, custom_id.encode()) for n, custom_id in enumerate(ids, start=1)]
    found = duplicates(lines, lambda _n, raw: raw.decode(), repeated)
    assert found == [(3, "a"), (5, "b"), (6, "a")]
    # An id whose hash is not among the repeated ones is never a duplicate, nor is a line
    # that had no id.
    assert duplicates([(1, b"a"), (2, b""), (3, b"a")], lambda _n, raw: raw.decode(), set()) == []
