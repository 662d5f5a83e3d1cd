"""What the CLI says to a person: an empty file, a base URL without ``/v1``, the lines
``estimate`` cannot use, numbers with thousands separators, and ``--help`` wrapped by the
terminal rather than the source."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Batch
from rich.console import Console
from typer.testing import CliRunner

from offpeak import cli
from offpeak.cli import client as client_tools
from offpeak.cli.batch_commands import not_request_lines


def test_an_empty_file_is_refused_in_words_before_any_upload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_client() -> None:
        raise AssertionError("nothing should reach the API")

    monkeypatch.setattr(cli, "_client", no_client)
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"\xef\xbb\xbf\n  \n")
    result = CliRunner().invoke(cli.app, ["submit", str(path), "--wait"])
    assert result.exit_code == 1
    assert "is empty: there is no request line to submit" in result.output


def test_a_batch_error_without_a_line_reads_as_a_sentence() -> None:
    said = client_tools.describe_error(None, "empty_file", "The input file holds no request lines.")
    assert said == "The input file holds no request lines. (empty_file)"
    assert "None" not in said
    assert client_tools.describe_error(7943, "invalid_json", "m") == "line 7,943: m (invalid_json)"


def test_a_404_from_a_base_url_without_v1_gets_a_hint(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    request = httpx.Request("POST", "http://127.0.0.1:8000/files")
    response = httpx.Response(404, json={"detail": "Not Found"}, request=request)

    def app() -> None:
        raise openai.NotFoundError("Not Found", response=response, body=None)

    monkeypatch.setattr(cli, "app", app)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:8000")
    with pytest.raises(SystemExit) as ended:
        cli.main()
    assert ended.value.code == 1
    out = capsys.readouterr().out
    assert "error 404" in out and "http://127.0.0.1:8000/v1" in out
    assert cli._base_url_hint(404, "http://127.0.0.1:8000/v1") is None
    assert cli._base_url_hint(401, "http://127.0.0.1:8000") is None


def test_estimate_names_the_lines_that_are_not_request_lines() -> None:
    assert not_request_lines([4]) == "line 4 is not a request line"
    assert not_request_lines([2, 5, 9]) == "3 lines are not request lines: 2, 5, 9"
    many = not_request_lines(list(range(1, 1_502)))
    assert many.startswith("1,501 lines are not request lines: 1, 2,")
    assert many.endswith("10 and 1,491 more")


def test_the_summary_shows_counts_with_thousands_separators() -> None:
    batch = Batch.model_validate(
        {
            "id": "batch_n",
            "object": "batch",
            "endpoint": "/v1/chat/completions",
            "input_file_id": "file_x",
            "completion_window": "24h",
            "status": "completed",
            "created_at": 0,
            "request_counts": {"total": 7943, "completed": 7943, "failed": 0},
            "usage": {
                "input_tokens": 1234567,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": 7943,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": 1242510,
            },
        }
    )
    out = io.StringIO()
    client_tools.print_summary(batch, Console(file=out, width=120))
    text = out.getvalue()
    assert "7,943 total" in text and "1,234,567 in" in text and "7,943 out" in text
    assert "7943" not in text


def test_help_paragraphs_are_wrapped_by_the_terminal_not_the_source() -> None:
    result = CliRunner().invoke(cli.app, ["worker", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "closes its engines and exits, within" in " ".join(
        line.strip() for line in result.output.splitlines() if "closes its" in line
    )
    assert any(
        "hands the lines it holds back, closes its engines and exits" in line
        for line in result.output.splitlines()
    )
