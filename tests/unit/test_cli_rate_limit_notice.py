"""The CLI says on stderr each time the server rate-limits it, and the SDK's own retry still
gets the answer: a real ``offpeak status`` against a tiny local server that answers 429 with
``Retry-After`` first."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import orjson
import pytest
from typer.testing import CliRunner

from offpeak import cli
from offpeak.cli import rate_limit_notice

BATCH = {
    "id": "batch_r",
    "object": "batch",
    "endpoint": "/v1/chat/completions",
    "input_file_id": "file_x",
    "completion_window": "24h",
    "status": "in_progress",
    "created_at": 0,
    "request_counts": {"total": 3, "completed": 1, "failed": 0},
}


@pytest.fixture
def limiting_server() -> Iterator[tuple[str, list[str]]]:
    """A server that refuses the first request with 429 ``Retry-After: 1``, then answers."""
    seen: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            if len(seen) == 1:
                body = orjson.dumps(
                    {
                        "error": {
                            "message": "Limit 1",
                            "type": "requests",
                            "code": "rate_limit_exceeded",
                        }
                    }
                )
                self.send_response(429)
                self.send_header("Retry-After", "1")
            else:
                body = orjson.dumps(BATCH)
                self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_cli_prints_each_rate_limit_wait_and_still_succeeds(
    limiting_server: tuple[str, list[str]],
) -> None:
    base_url, seen = limiting_server
    result = CliRunner().invoke(
        cli.app,
        ["status", "batch_r"],
        env={"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "sk-test", "COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    assert seen == ["/v1/batches/batch_r", "/v1/batches/batch_r"]  # the SDK retried once
    assert result.stderr.count("rate-limited by the server") == 1
    assert "retrying in 1 s (Retry-After)" in result.stderr
    assert "batch batch_r" in result.stdout and "in_progress" in result.stdout


def test_only_a_429_the_sdk_retries_is_announced_as_a_wait() -> None:
    said: list[str] = []
    hook = rate_limit_notice.say_each_rate_limit(2, said.append)

    class Request:
        def __init__(self, count: int) -> None:
            self.headers = {"x-stainless-retry-count": str(count)}

    class Response:
        status_code = 429

        def __init__(self, count: int, headers: dict[str, str]) -> None:
            self.request = Request(count)
            self.headers = headers

    hook(Response(0, {"retry-after-ms": "2500", "retry-after": "3"}))
    hook(Response(1, {}))
    hook(Response(2, {"retry-after": "3"}))  # the last attempt: the SDK gives up
    hook(Response(0, {"retry-after": "600"}))  # past the SDK's ceiling: it does not retry
    hook(Response(0, {"x-should-retry": "false"}))  # a quota's 429
    assert said == [
        "rate-limited by the server: retrying in 2.5 s (Retry-After)",
        "rate-limited by the server: retrying after a short back-off",
    ]
