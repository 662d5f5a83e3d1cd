"""The figures of ``docs/planning.md`` through ``offpeak plan``, ``offpeak simulate`` and the
planner the worker uses; calibration against an engine with a known step time."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from matplotlib.image import imread
from typer.testing import CliRunner

from offpeak.cli import app
from offpeak.settings import get_settings
from workers import calibration
from workers.calibration import (
    CALIBRATION_FILE,
    CalibrationPoint,
    calibrate,
    fit_step_model,
    load_calibration,
)
from workers.engine.base import Completion, EngineCapabilities, EngineRequest, EngineResult
from workers.planner import (
    StepModel,
    choose_engine_limits,
    kv_bytes_per_token,
    largest_batch,
)

runner = CliRunner()

#: Llama 3 8B's config.json, the fields the KV cache depends on (the example of docs/planning.md).
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}
EXAMPLE_MEMORY = ["--weights-gb", "16", "--device-gb", "80"]


def invoke(*args: str) -> Any:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


def invoke_json(*args: str) -> dict[str, Any]:
    return json.loads(invoke(*args, "--json").stdout)


# --- plan memory ------------------------------------------------------------------------------


def test_plan_memory_example_prints_59_reserved_and_244_paged() -> None:
    args = ("plan", "memory", "--kv-bytes-per-token", "131072", *EXAMPLE_MEMORY)
    plan = invoke_json(*args)
    assert (plan["reserved_tokens"], plan["reserved_sequences"]) == (8192, 59)
    assert (plan["paged_avg_tokens"], plan["paged_sequences"]) == (2000, 244)

    table = invoke(*args).stdout
    assert re.search(r"reserved for the whole context .*\b8,192\b.*\b59\b", table)
    assert re.search(r"paged, as tokens arrive .*\b2,000 avg\b.*\b244\b", table)


def test_plan_memory_reads_kv_bytes_from_config_json(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    plan = invoke_json("plan", "memory", "--config", str(config), *EXAMPLE_MEMORY)
    assert plan["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131_072
    assert (plan["reserved_sequences"], plan["paged_sequences"]) == (59, 244)

    # An fp8 KV cache halves the bytes per token, so twice as many sequences fit.
    fp8 = invoke_json(
        "plan", "memory", "--config", str(config), "--dtype-bytes", "1", *EXAMPLE_MEMORY
    )
    assert fp8["kv_bytes_per_token"] == 65_536
    assert fp8["paged_sequences"] == 488


def test_plan_memory_from_model_folder_and_parameter_count(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA3_8B, "head_dim": 64}))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 1000)
    plan = invoke_json("plan", "memory", "--model-folder", str(tmp_path), "--device-gb", "1")
    assert plan["weights_bytes"] == 4000
    assert plan["kv_bytes_per_token"] == 2 * 32 * 8 * 64 * 2

    by_params = invoke_json(
        "plan", "memory", "--kv-bytes-per-token", "131072", "--params-billion", "8",
        "--dtype-bytes", "2", "--device-gb", "80",
    )  # fmt: skip
    assert by_params["weights_bytes"] == 16_000_000_000
    assert by_params["paged_sequences"] == 244


def test_plan_memory_without_a_kv_source_is_a_usage_error() -> None:
    result = runner.invoke(app, ["plan", "memory", "--weights-gb", "16"])
    assert result.exit_code == 2
    assert "--kv-bytes-per-token" in result.output


def test_kv_bytes_per_token_needs_the_layer_count() -> None:
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_bytes_per_token({"num_attention_heads": 32, "torch_dtype": "bfloat16"})


# --- plan batch -------------------------------------------------------------------------------


def test_plan_batch_worked_example_gives_30_of_the_candidates_and_37_exact() -> None:
    args = ("plan", "batch", "--base-ms", "10", "--per-seq-ms", "0.4", "--floor", "40",
            "--candidates", "10,20,30,40")  # fmt: skip
    summary = invoke_json(*args)
    assert summary["best_candidate"] == 30
    assert summary["exact_largest"] == 37
    rows = {r["batch"]: r for r in summary["rows"]}
    # docs/planning.md: at 30 each user gets 45 tokens/s, 1,364 in total; at 40, 38.
    assert round(rows[30]["per_user_tokens_per_s"]) == 45
    assert round(rows[30]["total_tokens_per_s"]) == 1364
    assert round(rows[40]["per_user_tokens_per_s"]) == 38

    text = invoke(*args).stdout
    assert "Largest candidate at >= 40 tokens/s per user: 30" in text
    assert "Exact largest batch at >= 40 tokens/s per user: 37" in text


def test_plan_batch_offline_answer_is_the_memory_limit() -> None:
    summary = invoke_json("plan", "batch", "--floor", "0", "--max-batch-memory", "244")
    assert summary["floor_tokens_per_s"] is None
    assert summary["chosen"] == 244
    # With a floor, memory caps the exact answer only when it is the tighter limit.
    assert invoke_json("plan", "batch", "--max-batch-memory", "20")["chosen"] == 20
    assert invoke_json("plan", "batch", "--max-batch-memory", "244")["chosen"] == 37


@pytest.mark.parametrize(
    ("model", "floor", "expected"),
    [
        (StepModel(10, 0.4), 40, 37),
        (StepModel(10, 0.4), 50, 25),  # 10 + 0.4 × 25 = 20 ms is exactly 50 tokens/s
        (StepModel(10, 0.4), 101, 0),  # even one sequence is slower than the floor
        (StepModel(2, 0.3), 7, 469),
    ],
)
def test_largest_batch_is_the_exact_boundary(model: StepModel, floor: float, expected: int) -> None:
    batch = largest_batch(model, floor)
    assert batch == expected
    if batch:
        assert model.per_user_tokens_per_s(batch) >= floor - 1e-9
    assert model.per_user_tokens_per_s(batch + 1) < floor


def test_largest_batch_without_floor_or_memory_is_unbounded() -> None:
    with pytest.raises(ValueError, match="memory limit"):
        largest_batch(StepModel(), None)


# --- simulate policies ------------------------------------------------------------------------


def test_simulate_policies_prints_the_planning_table() -> None:
    result = invoke_json("simulate", "policies")
    assert result["requests"] == 427
    policies = {p["policy"]: p for p in result["policies"]}
    one, static, continuous = (
        policies["one at a time"],
        policies["static batches"],
        policies["continuous batching"],
    )
    # docs/planning.md: 46 finished one at a time, ~10x throughput continuous, none queued,
    # median wait under 5 s.
    assert one["finished"] == 46
    assert 9.5 < continuous["tokens_per_s"] / one["tokens_per_s"] < 10.5
    assert continuous["still_queued"] == 0
    assert continuous["median_wait_s"] < 5
    # docs/planning.md's table to the last digit (numpy 2.3's default_rng).
    assert [one["tokens_per_s"], static["tokens_per_s"], continuous["tokens_per_s"]] == [
        96.025,
        403.5416666666667,
        957.975,
    ]
    assert [p["finished"] for p in (one, static, continuous)] == [46, 182, 409]
    assert [p["still_queued"] for p in (one, static, continuous)] == [380, 243, 0]
    assert continuous["median_wait_s"] == pytest.approx(4.490612790873598, abs=1e-12)

    text = invoke("simulate", "policies").stdout
    assert "427 requests arrive over 120 s" in text
    assert re.search(r"one at a time\s*│\s*96\s*│\s*46\s*│", text)


def test_simulate_policies_options_change_the_result() -> None:
    slower = invoke_json("simulate", "policies", "--rate", "8", "--max-batch", "8", "--seed", "1")
    continuous = slower["policies"][2]
    assert slower["requests"] > 800
    assert continuous["still_queued"] > 0  # 8 slots cannot keep up with 8 requests/s


# --- plots ------------------------------------------------------------------------------------


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(path).shape
    assert height > 100 and width > 100


def test_plots_write_valid_pngs(tmp_path: Path) -> None:
    memory_png, batch_png = tmp_path / "memory.png", tmp_path / "batch.png"
    memory = ("plan", "memory", "--kv-bytes-per-token", "131072", *EXAMPLE_MEMORY)
    invoke(*memory, "--plot", str(memory_png))
    invoke("plan", "batch", "--plot", str(batch_png))
    assert_png(memory_png)
    assert_png(batch_png)


# --- engine sizing for a chunk ----------------------------------------------------------------

#: SmolLM2-135M: 30 layers × 3 KV heads × 64 head_dim × 2 (K, V) × 2 bytes (bfloat16).
SMOLLM2_KV = 2 * 30 * 3 * 64 * 2


def test_choose_engine_limits_follows_the_requests() -> None:
    budget = 1_000_000_000
    short = choose_engine_limits([100] * 1000, [256] * 1000, SMOLLM2_KV, budget, 2048)
    long = choose_engine_limits([1000] * 1000, [1000] * 1000, SMOLLM2_KV, budget, 2048)
    # 356 tokens → 23 blocks of 16 = 368; 1e9 // (23,040 × 368) = 117 sequences.
    assert short[:2] == (117, 368)
    # 2,000 tokens (125 blocks); 1e9 // (23,040 × 2,000) = 21 sequences.
    assert long[:2] == (21, 2000)
    assert "max_num_seqs 117" in short[2] and "max_model_len 368" in short[2]
    assert "max_num_seqs 21" in long[2]


def test_choose_engine_limits_caps() -> None:
    # A few requests: no more slots than requests.
    seqs, _, why = choose_engine_limits([10, 20], [100, 100], SMOLLM2_KV, 10**9, 2048)
    assert seqs == 2 and "capped at the chunk's size" in why
    # Longer than the model allows: capped at the model's context.
    _, length, why = choose_engine_limits([4000], [1000], SMOLLM2_KV, 10**9, 2048)
    assert length == 2048 and "exceed" in why
    # A tiny KV budget still runs one sequence, of a length the budget can hold.
    seqs, length, _ = choose_engine_limits([1000], [1000], SMOLLM2_KV, 100 * SMOLLM2_KV, 2048)
    assert (seqs, length) == (1, 96)
    with pytest.raises(ValueError):
        choose_engine_limits([1, 2], [3], SMOLLM2_KV, 10**9, 2048)


# --- calibration ------------------------------------------------------------------------------


_engines: list[SleepingEngine] = []


def _engine_clock() -> float:
    """The virtual clock of the last ``SleepingEngine`` made."""
    return _engines[-1].clock


class SleepingEngine:
    """An ``Engine`` whose step takes ``base + per_seq × running``, plus ``prefill`` seconds in
    a step that admits new requests (so timing prefill would visibly bias the fit), on a virtual
    clock (``clock``) the calibration reads: the fit is exact on a loaded machine too."""

    model_name = "fake-model"
    max_model_len = 2048
    capabilities = EngineCapabilities()
    server_meter = None

    def __init__(self, base_s: float, per_seq_s: float, prefill_s: float) -> None:
        self.base_s, self.per_seq_s, self.prefill_s = base_s, per_seq_s, prefill_s
        self.left: dict[str, int] = {}
        self.new = False
        self.clock = 0.0
        _engines.append(self)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return [1, 2, 3]

    def encode_text(self, text: str) -> list[int]:
        return [1, 2, 3]

    def add(self, request: EngineRequest) -> None:
        self.left[request.request_id] = request.sampling.max_tokens
        self.new = True

    def step(self) -> list[EngineResult]:
        prefill = self.prefill_s if self.new else 0.0
        self.new = False
        self.clock += self.base_s + self.per_seq_s * len(self.left) + prefill
        finished = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            if self.left[request_id] == 0:
                del self.left[request_id]
                done = Completion(text="x", token_ids=[7], finish_reason="length")
                finished.append(EngineResult(request_id, 3, 0, [done]))
        return finished

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.left.pop(request_id, None)

    def num_unfinished(self) -> int:
        return len(self.left)

    def close(self) -> None:
        self.left.clear()


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("OFFPEAK_MODEL_CACHE_DIR", str(tmp_path))
    # The calibration times each step on the engine's virtual clock (``SleepingEngine.clock``).
    monkeypatch.setattr(calibration, "time", SimpleNamespace(perf_counter=_engine_clock))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_calibration_recovers_the_step_model_and_round_trips(cache_dir: Path) -> None:
    engine = SleepingEngine(base_s=0.002, per_seq_s=0.0002, prefill_s=0.03)
    result = calibrate(engine, (1, 8, 32, 64), decode_tokens=12, cache_dir=cache_dir, device="dev0")

    assert [p.batch for p in result.points] == [1, 8, 32, 64]
    assert all(p.steps == 10 for p in result.points)  # 12 steps less 2 of prefill
    assert result.step_model.base_ms == pytest.approx(2.0)
    assert result.step_model.per_seq_ms == pytest.approx(0.2)
    assert engine.num_unfinished() == 0

    stored = json.loads((cache_dir / CALIBRATION_FILE).read_text())
    entry = stored["fake-model@dev0"]
    assert entry["base_ms"] == result.step_model.base_ms
    assert [p["batch"] for p in entry["points"]] == [1, 8, 32, 64]
    assert entry["measured_at"]
    assert load_calibration("fake-model", "dev0", cache_dir) == result.step_model
    assert load_calibration("fake-model", "other-device", cache_dir) is None

    summary = invoke_json("plan", "batch", "--calibrated", "fake-model", "--device", "dev0")
    assert summary["base_ms"] == result.step_model.base_ms
    assert summary["per_seq_ms"] == result.step_model.per_seq_ms


def test_calibration_keeps_other_entries(cache_dir: Path) -> None:
    for device, base in (("a", 0.001), ("b", 0.003)):
        engine = SleepingEngine(base_s=base, per_seq_s=0.0001, prefill_s=0.0)
        calibrate(
            engine, (1, 16), decode_tokens=5, warmup=False, cache_dir=cache_dir, device=device
        )
    a = load_calibration("fake-model", "a", cache_dir)
    b = load_calibration("fake-model", "b", cache_dir)
    assert a is not None and b is not None
    assert a.base_ms < b.base_ms


def test_plan_batch_calibrated_without_calibration_fails(cache_dir: Path) -> None:
    result = runner.invoke(app, ["plan", "batch", "--calibrated", "nope", "--device", "cpu"])
    assert result.exit_code == 1
    assert "offpeak calibrate nope" in result.output


def test_fit_step_model_never_fits_a_step_that_gets_cheaper_with_more_sequences() -> None:
    """Flat steps with timing noise fit a negative slope by plain least squares; the model holds
    it at 0 through the mean, and a rising curve still gets its own slope."""
    flat = [
        CalibrationPoint(1, 69.1, 6),
        CalibrationPoint(8, 68.9, 6),
        CalibrationPoint(16, 68.3, 6),
    ]
    model = fit_step_model(flat)
    assert model.per_seq_ms == 0.0
    assert model.base_ms == pytest.approx((69.1 + 68.9 + 68.3) / 3)
    rising = [
        CalibrationPoint(1, 10.1, 6),
        CalibrationPoint(8, 10.8, 6),
        CalibrationPoint(16, 11.6, 6),
    ]
    assert fit_step_model(rising).per_seq_ms == pytest.approx(0.1, abs=0.001)


def test_fit_step_model_needs_two_batch_sizes() -> None:
    with pytest.raises(ValueError):
        fit_step_model([CalibrationPoint(8, 5.0, 10), CalibrationPoint(8, 5.1, 10)])
