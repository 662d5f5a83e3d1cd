"""The CLI's reading of an input file: the endpoint of any first line."""

from __future__ import annotations


def test_submit_reads_the_endpoint_of_any_first_line(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A first line that is not a JSON object crashed ``offpeak submit`` with a traceback after
    the upload; now the batch is created and validation names the line."""
    from offpeak.cli.client import first_url

    for content in (b"garbage\n", b"[1]\n", b'{"url": 5}\n', b"\n\n"):
        path = tmp_path / "in.jsonl"
        path.write_bytes(content)
        assert first_url(path) == "/v1/chat/completions"
    path.write_bytes(b'\xef\xbb\xbf{"url": "/v1/completions"}\n')
    assert first_url(path) == "/v1/completions"
