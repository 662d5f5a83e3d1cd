"""The CLI's figures without an API: money in fixed point, cost per million at the ledger's
resolution, the progress bar with the ETA, and which lines a retry takes."""

from __future__ import annotations

import time

from offpeak.billing import MONEY_DIGITS, cost_per_million_tokens, format_usd
from offpeak.cli import client as client_tools
from offpeak.cli import watching


def test_money_is_printed_in_fixed_point() -> None:
    assert format_usd(4.73535e-05) == "$0.0000474"  # the figure that printed as 4.73535e-05
    assert format_usd(0.0009996) == "$0.00100"
    assert format_usd(2.5e-10) == "$0.000000000250"
    assert format_usd(0.5) == "$0.500"
    assert format_usd(1234.5) == "$1,234.50"
    assert format_usd(0) == "$0" and format_usd(None) == "-"
    assert format_usd(-0.0012) == "-$0.00120"
    for exponent in range(-12, 4):
        assert "e" not in format_usd(1.234 * 10**exponent)


def test_cost_per_million_takes_the_cost_at_the_ledgers_resolution() -> None:
    """A bill's cost is stored to 1e-10 dollars; the dashboard sums its engines' seconds
    unrounded. The two differ below that resolution, and must not straddle a shown digit (the
    card and the CLI would show one batch's cost per million a cent apart)."""
    engine_cost = 1.525000004e-05  # 100 tokens: $0.1525000004 per million unrounded
    ledger_cost = round(engine_cost, MONEY_DIGITS)
    assert ledger_cost != engine_cost
    assert cost_per_million_tokens(engine_cost, 100) == cost_per_million_tokens(ledger_cost, 100)
    assert format_usd(cost_per_million_tokens(engine_cost, 100)) == format_usd(
        cost_per_million_tokens(ledger_cost, 100)
    )


def test_the_progress_bar_moves_with_the_eta_while_lines_run() -> None:
    """Between in_progress_at and the server's estimated_completion_at the bar moves with the
    time that has passed, ahead of the finished lines (none may have finished while a chunk
    decodes), never to 100% before the batch ends."""
    from openai.types import Batch

    now = time.time()

    def batch(status: str, done: int, eta: float | None) -> Batch:
        return Batch.model_validate(
            {
                "id": "batch_x",
                "object": "batch",
                "endpoint": "/v1/chat/completions",
                "input_file_id": "file_x",
                "completion_window": "24h",
                "status": status,
                "created_at": int(now - 20),
                "in_progress_at": int(now - 10),
                "request_counts": {"total": 100, "completed": done, "failed": 0},
                "estimated_completion_at": eta,
            }
        )

    halfway = watching.progress_position(batch("in_progress", 0, now + 10), now)
    assert 45 <= halfway <= 55
    later = watching.progress_position(batch("in_progress", 0, now + 10), now + 5)
    assert later > halfway
    assert watching.progress_position(batch("in_progress", 80, now + 10), now) == 80
    late = watching.progress_position(batch("in_progress", 10, now - 5), now)
    assert 99 <= late < 100  # past the ETA, still not done
    assert watching.progress_position(batch("in_progress", 30, None), now) == 30
    assert watching.progress_position(batch("completed", 100, None), now) == 100


def test_retryable_lines_are_the_servers_failures_only() -> None:
    def failed(status: int, code: str | None) -> dict[str, object]:
        body = {"error": {"message": "m", "type": "t", "param": None, "code": code}}
        return {"custom_id": "x", "response": {"status_code": status, "body": body}, "error": None}

    def never_ran(code: str) -> dict[str, object]:
        return {"custom_id": "x", "response": None, "error": {"code": code, "message": "m"}}

    assert client_tools.retryable(never_ran("batch_expired"))
    assert client_tools.retryable(failed(500, "engine_failure"))
    assert client_tools.retryable(failed(503, None))
    assert client_tools.retryable(failed(200, "server_error"))
    assert not client_tools.retryable(failed(400, "invalid_value"))
    assert not client_tools.retryable(failed(400, "context_length_exceeded"))
    assert not client_tools.retryable(never_ran("batch_cancelled"))


def test_status_shows_the_eta_and_the_late_warning() -> None:
    """``offpeak status``'s rows: the ETA with the time left and the server's
    ``completion_warning`` message while the batch runs; nothing once it ended."""
    from openai.types import Batch

    now = 1_800_000_000.0

    def batch(status: str, eta: float | None, late: dict[str, object] | None) -> Batch:
        return Batch.model_validate(
            {
                "id": "batch_x", "object": "batch", "endpoint": "/v1/chat/completions",
                "input_file_id": "file_x", "completion_window": "24h", "status": status,
                "created_at": int(now - 20), "estimated_completion_at": eta,
                "completion_warning": late,
            }
        )  # fmt: skip

    rows = dict(client_tools.eta_rows(batch("in_progress", now + 3725, None), now))
    assert rows["eta"].endswith("(in 1:02:05)") and "warning" not in rows
    message = "… estimated to finish about 3.0 h after its completion window ends …"
    warned = batch("in_progress", now + 97_200, {"code": "may_miss_completion_window",
                                                   "message": message})  # fmt: skip
    assert dict(client_tools.eta_rows(warned, now))["warning"] == message
    assert client_tools.eta_rows(batch("in_progress", None, None), now) == []
    assert client_tools.eta_rows(batch("completed", now + 10, None), now) == []
