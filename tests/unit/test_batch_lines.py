"""A finished row as its file line (``offpeak.endpoints.batch_lines``, which finalize and the
results route share) and the CLI's resume point in a results file (``partial_results``)."""

from __future__ import annotations

from pathlib import Path

import orjson

from offpeak.cli.partial_results import count_lines, last_line_id
from offpeak.endpoints import records
from offpeak.endpoints.batch_lines import batch_line, never_ran_line_id
from offpeak.endpoints.errors import LineError


def answer() -> records.Answer:
    return records.Answer(
        endpoint="/v1/chat/completions",
        model="m",
        created=1,
        line_id="batch_req_a",
        request_id="req_a",
        response_id="chatcmpl-a",
        prompt_tokens=2,
        cached_tokens=0,
        completions=[records.CompletionRecord(text="OK", finish_reason="stop", tokens=1)],
    )


def test_each_status_goes_to_its_file_with_its_id() -> None:
    ok = batch_line("batch_1", "c1", "succeeded", records.dump(answer()))
    assert ok is not None and ok.file == "output" and ok.id == "batch_req_a"
    assert orjson.loads(ok.json)["response"]["status_code"] == 200
    failure = records.failure(LineError("bad", "temperature", "invalid_value"))
    bad = batch_line("batch_1", "c2", "failed", records.dump(failure))
    assert bad is not None and bad.file == "error" and bad.id == failure.line_id
    assert orjson.loads(bad.json)["response"]["status_code"] == 400
    for status, code in (("cancelled", "batch_cancelled"), ("expired", "batch_expired")):
        never = batch_line("batch_1", "c3", status, None)
        assert never is not None and never.file == "error"
        assert never.id == never_ran_line_id("batch_1", "c3")
        assert orjson.loads(never.json)["error"]["code"] == code
    # The same row renders the same bytes every time: the id does not change.
    assert batch_line("batch_1", "c3", "expired", None) == never
    assert batch_line("batch_1", "c4", "pending", None) is None
    assert batch_line("batch_1", "c5", "running", None) is None


def test_a_line_stored_already_rendered_passes_through() -> None:
    legacy = '{"id":"batch_req_old","custom_id":"c","response":null,"error":null}'
    line = batch_line("batch_1", "c", "succeeded", legacy)
    assert line is not None and line.id == "batch_req_old" and line.json == legacy.encode()


def test_the_resume_point_is_the_last_whole_line(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    assert last_line_id(path) is None and count_lines(path) == 0
    path.write_bytes(b"")
    assert last_line_id(path) is None
    path.write_bytes(b'{"id":"batch_req_1"}\n{"id":"batch_req_2"}\n')
    assert last_line_id(path) == "batch_req_2" and count_lines(path) == 2
    # An interrupted write leaves half a line: it is cut off, and the last whole one counts.
    path.write_bytes(b'{"id":"batch_req_1"}\n{"id":"batch_req_2"}\n{"id":"batch_re')
    assert last_line_id(path) == "batch_req_2"
    assert path.read_bytes() == b'{"id":"batch_req_1"}\n{"id":"batch_req_2"}\n'
    path.write_bytes(b'{"id":"batch_re')
    assert last_line_id(path) is None and path.read_bytes() == b""
    # A last line longer than one read back from the end.
    long = b'{"id":"batch_req_3","pad":"' + b"x" * 200_000 + b'"}\n'
    path.write_bytes(b'{"id":"batch_req_1"}\n' + long)
    assert last_line_id(path) == "batch_req_3"
