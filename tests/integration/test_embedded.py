"""Smoke test of the embedded default: no database or broker configured, so SQLite and kombu's
filesystem transport under the data folder (the engine is the instant one: this is about the
embedded plumbing, the real engine is covered by the end-to-end tests)."""

from __future__ import annotations

import os
from pathlib import Path

from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from tests.support.batches import CASES, check_ran_batch, wait_for_end
from tests.support.servers import free_port


def test_embedded_default_runs_a_batch(tmp_path: Path) -> None:
    data = tmp_path / "data"
    stack = ServiceProcesses(
        {
            "OFFPEAK_DATA_DIR": str(data),
            "OFFPEAK_LOCAL_API_KEY": "sk-embedded-test",
            "OFFPEAK_MODELS": '{"SmolLM2-135M-Instruct": {"engine": "instant"}}',
        },
        free_port(),
        tmp_path / "logs",
    )
    for key in list(stack.env):
        if key.startswith("OFFPEAK_") and key not in (
            "OFFPEAK_DATA_DIR",
            "OFFPEAK_LOCAL_API_KEY",
            "OFFPEAK_MODELS",
            "OFFPEAK_MODEL_CACHE_DIR",
        ):
            del stack.env[key]
    stack.start()
    try:
        stack.wait_http()
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="sk-embedded-test")
        path = CASES / "bom-crlf-blank-lines" / "input.jsonl"
        with path.open("rb") as handle:
            file = client.files.create(file=("in.jsonl", handle), purpose="batch")
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = wait_for_end(client, batch.id, stack, timeout=120)
        assert batch.status == "completed"
        check_ran_batch(client, batch, ["req-1", "req-2", "req-3"])
    finally:
        stack.stop()
    assert (data / "offpeak.db").exists() and (data / "broker").is_dir()
    assert os.listdir(data / "blobs" / "outputs")
