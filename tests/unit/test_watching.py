"""Watching a batch (``offpeak watch``, ``submit --wait``): the bar never goes back, the ETA
stays while the server gives none, exit codes follow the batch's outcome, Ctrl-C says how to
watch again, and failed lines point to the command that downloads their errors."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from openai.types import Batch
from typer.testing import CliRunner

from offpeak import cli
from offpeak.cli import exit_codes, watching

NOW = time.time()


def batch(
    status: str, done: int, eta: float | None = None, failed: int = 0, **extra: object
) -> Batch:
    return Batch.model_validate(
        {
            "id": "batch_w",
            "object": "batch",
            "endpoint": "/v1/chat/completions",
            "input_file_id": "file_x",
            "completion_window": "24h",
            "status": status,
            "created_at": int(NOW - 20),
            "in_progress_at": int(NOW - 10),
            "request_counts": {"total": 100, "completed": done - failed, "failed": failed},
            "estimated_completion_at": eta,
            **extra,
        }
    )


class FakeClient:
    """The SDK calls the watch makes: ``batches.retrieve`` answers each batch of ``answers``
    in turn (then the last one again); ``/healthz`` does not answer."""

    base_url = httpx.URL("http://offpeak.test/v1")

    def __init__(self, answers: list[Batch | BaseException]) -> None:
        self._answers: Iterator[Batch | BaseException] = iter(answers)
        self._last: Batch | BaseException = answers[0]
        self.batches = self

    def retrieve(self, _batch_id: str) -> Batch:
        self._last = next(self._answers, self._last)
        if isinstance(self._last, BaseException):
            raise self._last
        return self._last

    def get(self, *_args: object, **_kwargs: object) -> object:
        raise OSError("no health here")


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watching.time, "sleep", lambda _s: None)


def watch(monkeypatch: pytest.MonkeyPatch, answers: list[Batch | BaseException]):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cli, "_client", lambda: FakeClient(answers))
    return CliRunner().invoke(cli.app, ["watch", "batch_w"])


def test_the_bar_never_goes_back_when_the_eta_moves_later() -> None:
    bar = watching.BarState()
    first, _ = bar.update(batch("in_progress", 0, NOW + 10), NOW)
    later_eta, _ = bar.update(batch("in_progress", 0, NOW + 1000), NOW + 1)
    assert first > 0
    assert later_eta == first  # the time share fell; the bar holds
    assert watching.progress_position(batch("in_progress", 0, NOW + 1000), NOW + 1) < first


def test_the_eta_stays_while_no_line_is_done_and_the_server_gives_none() -> None:
    bar = watching.BarState()
    assert bar.update(batch("in_progress", 0, NOW + 60), NOW)[1] == NOW + 60
    assert bar.update(batch("in_progress", 0, None), NOW + 1)[1] == NOW + 60
    assert bar.update(batch("completed", 100, None), NOW + 2) == (100.0, None)


@pytest.mark.parametrize(
    ("status", "code"),
    [
        ("completed", exit_codes.OK),
        ("failed", exit_codes.BATCH_FAILED),
        ("expired", exit_codes.BATCH_EXPIRED),
        ("cancelled", exit_codes.BATCH_CANCELLED),
    ],
)
def test_watch_exits_with_the_batchs_outcome(
    monkeypatch: pytest.MonkeyPatch, status: str, code: int
) -> None:
    result = watch(monkeypatch, [batch("in_progress", 10, NOW + 30), batch(status, 100)])
    assert result.exit_code == code, result.output
    assert "batch batch_w" in result.output


def test_ctrl_c_says_how_to_watch_again_and_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    result = watch(monkeypatch, [batch("in_progress", 10, NOW + 30), KeyboardInterrupt()])
    assert result.exit_code == 130
    assert "offpeak watch batch_w" in result.output
    assert "runs on" in result.output


def test_failed_lines_point_to_the_error_file(monkeypatch: pytest.MonkeyPatch) -> None:
    ended = batch("completed", 100, failed=2, error_file_id="file_err", output_file_id="file_o")
    result = watch(monkeypatch, [ended])
    assert result.exit_code == exit_codes.OK
    assert "2 of 100 lines failed" in result.output
    assert "offpeak download batch_w" in result.output
