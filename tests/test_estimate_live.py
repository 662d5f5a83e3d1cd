"""The estimate on the real model (SmolLM2 in the live stack's control and engine workers): the
prompt tokens the estimate counts with the model's tokenizer (beside the run, once validation
has put the batch in progress) are exactly the prompt tokens vLLM prefilled and the batch is
billed for, and the billed price falls inside the estimated range.
Engine-heavy: run under ``flock /tmp/offpeak-engine.lock``."""

from __future__ import annotations

import time

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


def test_submit_wait_through_the_console_script_on_the_live_stack(
    live: ServiceProcesses,
    live_settings,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """``offpeak submit --wait`` as a script runs it (a subprocess, the real API and workers):
    exit 0 for a batch that completes, 3 and a line saying so for one that fails validation."""
    import os
    import subprocess
    import sys

    from tests.conftest import new_key

    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"{live.base_url}/v1",
        "OPENAI_API_KEY": new_key(live_settings),
    }
    good = tmp_path / "good.jsonl"
    good.write_bytes(
        orjson.dumps(
            {
                "custom_id": "a",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": DEFAULT_MODEL,
                    "messages": [{"role": "user", "content": "Say hi."}],
                    "max_tokens": 8,
                },
            }
        )
        + b"\n"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(good.read_bytes().replace(DEFAULT_MODEL.encode(), b"no-such-model"))
    command = [sys.executable, "-c", "from offpeak.cli import main; main()", "submit"]
    done = subprocess.run(
        [*command, str(good), "--wait"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed" in done.stdout and "ETA" in done.stdout
    failed = subprocess.run(
        [*command, str(bad), "--wait"], env=env, capture_output=True, text=True, timeout=600
    )
    assert failed.returncode == 3, failed.stdout + failed.stderr
    assert "ended failed (exit 3)" in failed.stderr
