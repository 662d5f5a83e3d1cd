"""Validation costs what the file is allowed to hold: blank lines count toward a batch's line
limit, and a line over ``max_line_bytes`` fails by its length, never joined, parsed or
tokenized."""

from __future__ import annotations

import tracemalloc

import pytest

from offpeak.settings import ModelConfig, Settings
from tests.support.batches import line, validate
from workers.validation import BLANK_LINE_ALLOWANCE, iter_lines

MODEL = "validation-model"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"models": {MODEL: ModelConfig(engine="instant")}})


def test_an_oversized_line_is_none_whether_it_spans_chunks_or_not() -> None:
    chunks = [b"ab\nxxxx", b"xxxx", b"xx\ncd\n", b"yyyyyyyyyyyy\nef"]
    assert list(iter_lines(iter(chunks), max_line_bytes=8)) == [
        (1, b"ab"),
        (2, None),
        (3, b"cd"),
        (4, None),
        (5, b"ef"),
    ]
    assert list(iter_lines(iter([b"ok\n", b"z" * 20]), max_line_bytes=8)) == [
        (1, b"ok"),
        (2, None),
    ]


def test_a_line_over_the_byte_cap_fails_before_it_is_parsed(settings: Settings) -> None:
    capped = settings.model_copy(update={"max_line_bytes": 64 * 1024})
    huge = b'{"custom_id": "' + b"a" * (8 << 20) + b'"}'
    tracemalloc.start()
    try:
        batch, rows = validate(capped, line("a") + b"\n" + huge + b"\n" + line("c") + b"\n")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(e["code"], e["line"]) for e in batch.errors] == [("line_too_long", 2)]
    assert rows == 0
    # The 8 MiB line was never joined: the upload's and the read's pieces are 1 MiB.
    assert peak < 24 << 20, f"peak {peak / (1 << 20):.0f} MiB"


def test_blank_lines_count_toward_the_line_limit(settings: Settings) -> None:
    small = settings.model_copy(update={"max_requests_per_batch": 2})
    limit = 2 + BLANK_LINE_ALLOWANCE
    batch, rows = validate(small, line("a") + b"\n" * (limit + 10) + line("b") + b"\n")
    assert [(e["code"], e["line"]) for e in batch.errors] == [("too_many_requests", limit + 1)]
    assert rows == 0
    # A few blank lines beside the requests are fine.
    batch, rows = validate(small, line("a") + b"\n" * 20 + line("b") + b"\n")
    assert batch.status == "in_progress" and rows == 2
