"""Input lines read across chunk boundaries: BOM, CRLF and blank lines."""

from __future__ import annotations

from workers.validation import iter_lines


def test_iter_lines_across_chunk_boundaries() -> None:
    data = b"\xef\xbb\xbfab\r\ncd\n\nef"
    for size in range(1, len(data) + 1):
        chunks = (data[i : i + size] for i in range(0, len(data), size))
        assert list(iter_lines(chunks)) == [(1, b"ab"), (2, b"cd"), (3, b""), (4, b"ef")]
