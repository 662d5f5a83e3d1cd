"""The whole lifecycle through the official OpenAI SDK against a live API and workers on the real
SmolLM2 model: answers, sampling parameters and cancel mid-run (the CLI a user types:
``tests/integration/test_cli_script.py``)."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from openai import OpenAI

from tests.support.batches import (
    MODEL,
    QUICKSTART,
    chat_line,
    check_ran_batch,
    submit,
    wait_for_end,
)

pytestmark = pytest.mark.engine


def test_lifecycle_with_sampling_parameters(live_sdk: OpenAI, live: Any) -> None:
    quick = [
        raw
        for raw in QUICKSTART.read_bytes().splitlines()
        if orjson.loads(raw)["url"] == "/v1/chat/completions"
    ]
    extra = [
        chat_line("paris-again", "What is the capital of France?", max_tokens=24, temperature=0),
        chat_line("too-long", "Hi " * 3000, max_tokens=8),
        chat_line("bad-top-p", "Hi", max_tokens=8, top_p=3),
    ]
    batch = submit(live_sdk, quick + extra)
    batch = wait_for_end(live_sdk, batch.id, live)
    assert batch.status == "completed"
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    ids = [orjson.loads(raw)["custom_id"] for raw in quick + extra]
    output, errors = check_ran_batch(live_sdk, batch, ids)
    assert sorted(e["custom_id"] for e in errors) == ["bad-top-p", "too-long"]
    too_long = next(e for e in errors if e["custom_id"] == "too-long")["response"]["body"]["error"]
    assert too_long["code"] == "context_length_exceeded"
    by_id = {line["custom_id"]: line["response"]["body"] for line in output}

    def text(custom_id: str, i: int = 0) -> str:
        return str(by_id[custom_id]["choices"][i]["message"]["content"])

    assert "Paris" in text("capital-france")
    assert text("capital-france") == text("paris-again")  # temperature 0 is deterministic
    assert len(by_id["colours-n2"]["choices"]) == 2
    assert "six" not in text("count-stop").lower()
    logprobs = by_id["logprobs"]["choices"][0]["logprobs"]["content"]
    assert len(logprobs) == by_id["logprobs"]["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in logprobs)
    assert by_id["recipe"]["usage"]["completion_tokens"] <= 40
    for body in by_id.values():
        assert body["model"] == MODEL and body["object"] == "chat.completion"
        for choice in body["choices"]:
            assert choice["finish_reason"] in ("stop", "length")
            assert choice["message"]["role"] == "assistant"


def test_completions_endpoint(live_sdk: OpenAI, live: Any) -> None:
    quick = [
        raw
        for raw in QUICKSTART.read_bytes().splitlines()
        if orjson.loads(raw)["url"] == "/v1/completions"
    ]
    batch = wait_for_end(live_sdk, submit(live_sdk, quick, "/v1/completions").id, live)
    output, _ = check_ran_batch(live_sdk, batch, [orjson.loads(r)["custom_id"] for r in quick])
    by_id = {line["custom_id"]: line["response"]["body"] for line in output}
    assert "Paris" in by_id["complete-paris"]["choices"][0]["text"]
    lp = by_id["complete-logprobs"]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert all(len(top) <= 3 for top in lp["top_logprobs"])


def test_cancel_mid_run(live_sdk: OpenAI, live: Any) -> None:
    # A few short answers finish within seconds; the long ones would take minutes, so the cancel
    # lands while they are decoding.
    short = [chat_line(f"short-{i}", "Say yes.", max_tokens=2, temperature=0) for i in range(4)]
    long = [
        chat_line(
            f"long-{i}",
            f"Write a long story about dragon number {i}.",
            max_tokens=400,
            temperature=0.8,
            seed=i,
        )
        for i in range(24)
    ]
    batch = submit(live_sdk, short + long)
    deadline = time.monotonic() + 300
    while live_sdk.batches.retrieve(batch.id).request_counts.completed < 1:
        assert time.monotonic() < deadline, "no line finished"
        live.check_alive()
        time.sleep(0.2)
    assert live_sdk.batches.cancel(batch.id).status == "cancelling"
    batch = wait_for_end(live_sdk, batch.id, live, timeout=120)
    assert batch.status == "cancelled" and batch.cancelled_at
    ids = [f"short-{i}" for i in range(4)] + [f"long-{i}" for i in range(24)]
    output, errors = check_ran_batch(live_sdk, batch, ids)
    assert output and errors
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert batch.usage.output_tokens == sum(
        line["response"]["body"]["usage"]["completion_tokens"] for line in output
    )
