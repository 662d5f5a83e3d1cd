"""The estimate on the real model (SmolLM2 in the live stack's control and engine workers): the
prompt tokens validation counts with the model's tokenizer are exactly the prompt tokens vLLM
prefilled and the batch is billed for, and the billed price falls inside the estimated range.
Engine-heavy: run under ``flock /tmp/offpeak-engine.lock``."""

from __future__ import annotations

import orjson
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import DEFAULT_MODEL
from tests.conftest import wait_for_end


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
    estimate = ended.estimate  # type: ignore[attr-defined]
    assert estimate["requests"] == 4 and estimate["invalid_requests"] == 0
    assert estimate["max_completion_tokens"] == 4 * 12
    assert estimate["prompt_tokens"] == ended.usage.input_tokens
    price = (ended.model_extra or {})["price"]
    assert estimate["price_low"] <= price <= estimate["price_high"]
