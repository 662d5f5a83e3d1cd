"""The CLI as a user's script runs it: ``offpeak`` as a subprocess against the API and workers as
processes (the instant engine), its exit codes and output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import DEFAULT_MODEL, Settings
from tests.support.batches import chat_line
from tests.support.database import new_key


def test_submit_wait_exits_as_the_batch_ends(
    instant_stack: ServiceProcesses, instant_settings: Settings, tmp_path: Path
) -> None:
    """``offpeak submit --wait`` as a script runs it (a subprocess, the real API and workers):
    exit 0 for a batch that completes, 3 and a line saying so for one that fails validation."""
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"{instant_stack.base_url}/v1",
        "OPENAI_API_KEY": new_key(instant_settings),
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


def test_submit_wait_status_and_download(instant_sdk: OpenAI, tmp_path: Path) -> None:
    """``submit --wait``, ``status`` and ``download`` as a user types them: the downloaded
    output holds the line's answer."""
    path = tmp_path / "mine.jsonl"
    path.write_bytes(chat_line("one", "Say hello.", max_tokens=8, temperature=0) + b"\n")
    env = {
        **os.environ,
        "OPENAI_BASE_URL": str(instant_sdk.base_url),
        "OPENAI_API_KEY": instant_sdk.api_key,
    }
    done = subprocess.run(
        [sys.executable, "-m", "offpeak", "submit", str(path), "--wait"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completed" in done.stdout
    batch_id = next(w for w in done.stdout.split() if w.startswith("batch_"))
    status = subprocess.run(
        [sys.executable, "-m", "offpeak", "status", batch_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "1 completed" in status.stdout
    target = tmp_path / "out.jsonl"
    got = subprocess.run(
        [sys.executable, "-m", "offpeak", "download", batch_id, "-o", str(target)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    [line] = [orjson.loads(x) for x in target.read_bytes().splitlines()]
    assert line["custom_id"] == "one" and line["response"]["status_code"] == 200
