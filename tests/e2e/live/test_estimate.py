"""The estimate on the real SmolLM2: ``offpeak estimate`` counts with the model's own tokenizer,
and the prompt tokens the live stack's estimate counts are the ones vLLM prefilled and billed."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
from openai import OpenAI
from typer.testing import CliRunner

from offpeak import cli
from offpeak.billing import format_usd
from offpeak.cli import exit_codes
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import DEFAULT_MODEL, Settings
from tests.support.batches import line, wait_for_end

pytestmark = pytest.mark.engine


def test_the_estimate_counts_the_prompt_tokens_the_engine_bills(
    live_sdk: OpenAI, live: ServiceProcesses
) -> None:
    questions = ["What is the capital of France?", "Name three colours.", "Say hi.", "2+2="]
    lines = [
        orjson.dumps(
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": DEFAULT_MODEL,
                    "messages": [
                        {"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": q},
                    ],
                    "max_tokens": 12,
                    "temperature": 0,
                },
            }
        )
        for i, q in enumerate(questions)
    ]
    file = live_sdk.files.create(file=("in.jsonl", b"\n".join(lines)), purpose="batch")
    batch = live_sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    ended = wait_for_end(live_sdk, batch.id, live)
    assert ended.status == "completed" and ended.usage is not None
    # Counted beside the run: a 4-line batch can end first (the tokenizer's first load is ~13 s).
    deadline = time.monotonic() + 120
    while ended.estimate is None and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.2)
        ended = live_sdk.batches.retrieve(batch.id)
    estimate = ended.estimate  # type: ignore[attr-defined]
    assert estimate is not None, "no estimate two minutes after the batch ended"
    assert estimate["requests"] == 4 and estimate["invalid_requests"] == 0
    assert estimate["max_completion_tokens"] == 4 * 12
    assert estimate["prompt_tokens"] == ended.usage.input_tokens
    price = (ended.model_extra or {})["price"]
    assert estimate["price_low"] <= price <= estimate["price_high"]


def jsonl(*lines: bytes) -> bytes:
    return b"\n".join(lines) + b"\n"


def write(tmp_path: Path, data: bytes, name: str = "in.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_offpeak_estimate_counts_with_the_models_own_tokenizer(tmp_path: Path) -> None:
    """``offpeak estimate FILE`` on the default model (SmolLM2): no server; the prompt tokens are
    what the model's Hugging Face tokenizer makes of the chat template, and the price range is
    the default prices' (0.10 / 0.20 per million, half off)."""
    from transformers import AutoTokenizer

    from offpeak.settings import DEFAULT_MODEL
    from workers.model_store import ensure_model

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    lines = [
        orjson.dumps(
            {
                "custom_id": f"q{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": DEFAULT_MODEL, "messages": messages, "max_tokens": 20},
            }
        )
        for i in range(3)
    ]
    path = write(tmp_path, jsonl(*lines, b"not json"))
    settings = Settings()
    folder = ensure_model(DEFAULT_MODEL, settings.models[DEFAULT_MODEL], settings.model_cache_dir)
    hf = AutoTokenizer.from_pretrained(str(folder))
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = len(hf.encode(rendered, add_special_tokens=False))
    result = CliRunner().invoke(cli.app, ["estimate", str(path)])
    assert result.exit_code == 0, result.output
    assert f"{3 * prompt:,}" in result.output and "0 … 60" in result.output
    low, high = 3 * prompt * 0.10 / 1e6 / 2, (3 * prompt * 0.10 + 60 * 0.20) / 1e6 / 2
    # Rounded as the estimate rounds amounts (to the ledger's 10 digits) before printing.
    assert f"{format_usd(round(low, 10))} … {format_usd(round(high, 10))}" in result.output
    assert "line 4 is not a request line" in result.output
    assert "3 (0 invalid, 1 not a request line)" in result.output
    bad = CliRunner().invoke(cli.app, ["estimate", str(write(tmp_path, jsonl(line("a", "x"))))])
    assert bad.exit_code == exit_codes.ERROR and "not configured here" in bad.output
