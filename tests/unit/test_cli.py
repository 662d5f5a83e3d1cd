"""The CLI's reading of an input file: the endpoint of any first line; what every ``offpeak``
process imports before its command runs."""

from __future__ import annotations

import subprocess
import sys


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


def test_the_cli_imports_the_openai_sdk_only_for_a_command_that_needs_it() -> None:
    """Every ``offpeak`` process (the API, each worker, ``migrate``) imports the CLI; the SDK, a
    large import, belongs to the client commands alone."""
    code = "import sys, offpeak.cli; print('openai' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
