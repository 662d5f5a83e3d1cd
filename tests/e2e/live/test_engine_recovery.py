"""The live stack on the real SmolLM2 engine survives its engine dying: a
200-line seeded batch answers 200/200, and SIGKILL of the engine-core process mid-batch fails no
line: the worker hands its lines back, loads a new engine and runs each ``custom_id`` once."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from tests.support.batches import (
    chat_line,
    check_billed_once,
    check_ran_batch,
    line_statuses,
    submit,
    wait_for_end,
)

pytestmark = pytest.mark.engine


def engine_core(stack: ServiceProcesses) -> psutil.Process:
    """The engine worker's ``VLLM::EngineCore`` child (vLLM spawns it for the engine)."""
    worker = psutil.Process(stack.procs["engine"].pid)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for child in worker.children(recursive=True):
            try:
                if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.5)
    raise AssertionError("no EngineCore process under the engine worker")


def test_a_200_line_seeded_batch_answers_every_line(
    live_sdk: OpenAI, live: ServiceProcesses
) -> None:
    lines = [
        chat_line(f"s{i}", f"Name a colour, number {i}.", temperature=0.7, seed=i, max_tokens=12)
        for i in range(200)
    ]
    batch = wait_for_end(live_sdk, submit(live_sdk, lines).id, live)
    output, errors = check_ran_batch(live_sdk, batch, [f"s{i}" for i in range(200)])
    assert batch.status == "completed" and len(output) == 200 and not errors


def test_killing_the_engine_core_mid_batch_fails_no_line(
    live_sdk: OpenAI, live: ServiceProcesses, live_settings: Settings
) -> None:
    # After the kill every line that was in the engine is a suspect, and suspects run one at a
    # time (``workers.runner.held.SUSPECT_ATTEMPTS``): the rerun takes a step per token of each
    # in turn: 40 lines leave enough suspects to check it without decoding for minutes.
    ids = [f"k{i}" for i in range(40)]
    lines = [chat_line(i, f"Write a sentence about the number {i}.", max_tokens=24) for i in ids]
    batch = submit(live_sdk, lines)
    core = engine_core(live)
    deadline = time.monotonic() + 300
    # Polled in the database. The kill must come while lines still run: a batch over before it
    # would test nothing (test_release_engine lost such a race on CI).
    while line_statuses(live_settings, batch.id).get("succeeded", 0) < 10:
        assert time.monotonic() < deadline, "the batch never started"
        time.sleep(0.2)
    os.kill(core.pid, signal.SIGKILL)
    batch = wait_for_end(live_sdk, batch.id, live)  # also fails if the engine worker died
    output, errors = check_ran_batch(live_sdk, batch, ids)
    assert batch.status == "completed"
    assert not errors, f"lines failed for the engine's death: {errors[:3]}"
    assert len(output) == len(ids)
    check_billed_once(live_settings.resolved_database_url, batch)
    assert engine_core(live).pid != core.pid, "a new engine was started"
