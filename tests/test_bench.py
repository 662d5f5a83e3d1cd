"""The benchmark commands work end to end at a tiny size (no timing is asserted: benchmarks are
ratios read by people, not pass/fail thresholds), and the request generator is deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from bench import harness
from bench.generator import SYSTEM_PROMPT, chat_requests, write_jsonl, write_padded_file
from offpeak.cli import app
from tests.conftest import PG_ADMIN, REDIS_URL


@pytest.fixture(autouse=True)
def _services(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "PG_ADMIN", PG_ADMIN)
    monkeypatch.setattr(harness, "REDIS_URL", REDIS_URL)


def test_chat_requests_are_deterministic_and_mixed(tmp_path: Path) -> None:
    first, second = (chat_requests(256, model="m", max_tokens=64) for _ in range(2))
    assert first == second
    assert len({line["custom_id"] for line in first}) == 256
    with_system = [
        line for line in first if line["body"]["messages"][0]["content"] == SYSTEM_PROMPT
    ]
    assert len(with_system) == 128
    assert {line["body"]["max_tokens"] for line in first} == {8, 16, 32, 64}
    assert {line["body"]["temperature"] for line in first} == {0}
    prompt_sizes = {len(line["body"]["messages"][-1]["content"]) for line in first}
    assert max(prompt_sizes) > 10 * min(prompt_sizes)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(first, a)
    write_jsonl(chat_requests(256, model="m", max_tokens=64), b)
    assert a.read_bytes() == b.read_bytes()


def test_padded_file_has_the_asked_lines_and_size(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    size = write_padded_file(path, 1000, 500_000, model="m")
    lines = path.read_bytes().splitlines()
    assert size == path.stat().st_size == 500_000
    assert len(lines) == 1000
    assert len({orjson.loads(line)["custom_id"] for line in lines}) == 1000


def test_intake_command_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "intake", "--lines", "300", "--mb", "0.3", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "intake.json").read_text())
    (run,) = report["runs"]
    assert run["rows_stored"] == run["lines"] == 300
    assert run["mb_per_s"] > 0 and run["api_rss_peak_mb"] > 0
    assert set(report["met"]) == {"mb_per_s", "api_rss_growth_mb_at_largest"}


def test_control_command_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "control", "--lines", "500", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "control.json").read_text())
    (run,) = report["runs"]
    assert run["lines"] == 500 and run["requests_per_s"] > 0
    assert run["engine_rss_peak_mb"] >= run["engine_rss_baseline_mb"] > 0
    # The database's floor ran on the same lines, in the claims' chunk size, and was cleaned up.
    floor = run["floor"]
    assert floor["lines"] == 500 and floor["chunks"] >= 1 and floor["chunk"] >= 1
    assert floor["requests_per_s"] > 0 and run["floor_ratio"] > 0
    assert set(report["met"]) == {"requests_per_s", "floor_ratio"}


def test_overhead_command_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "overhead", "--lines", "300", "--step-ms", "1", "--per-seq-ms", "0.01",
         "--max-num-seqs", "32", "--out", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "overhead.json").read_text())
    leg, ideals = report["offpeak"], report["ideal"]
    # Both legs generated the same tokens for the same lines; the runner's through the database.
    assert leg["requests"] == 300 and all(i["requests"] == 300 for i in ideals)
    assert leg["tokens"] == ideals[0]["tokens"] == ideals[1]["tokens"] > 0
    assert report["ratio"] > 0 and set(report["met"]) == {"ratio"}


def test_polls_command_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        ["bench", "polls", "--api-workers", "1", "--clients", "4", "--seconds", "2",
         "--batches", "2", "--lines", "5", "--out", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    (run,) = json.loads((tmp_path / "polls.json").read_text())["runs"]
    assert run["errors"] == {} and run["retrieve"]["count"] > 0
    assert run["list"]["count"] + run["download"]["count"] > 0
