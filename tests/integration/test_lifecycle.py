"""Process lifecycle on the embedded default (SQLite, the filesystem broker, a temporary data
folder) and the instant engine: offpeak up restarts what dies and stops everything, and one
control worker runs beat."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from offpeak.cli.supervisor import OffpeakUp, ServiceProcesses
from tests.support.batches import CASES, check_ran_batch, wait_for_end
from tests.support.processes import in_sessions, sessions, tree, wait_gone, wait_until
from tests.support.servers import free_port

INSTANT = '{"SmolLM2-135M-Instruct": {"engine": "instant"}}'


KEY = "sk-lifecycle-test"


def embedded_env(data_dir: Path) -> dict[str, str]:
    return {
        "OFFPEAK_DATA_DIR": str(data_dir),
        "OFFPEAK_LOCAL_API_KEY": KEY,
        "OFFPEAK_MODELS": INSTANT,
        "OFFPEAK_SWEEP_SECONDS": "2",
    }


def only_embedded(env: dict[str, str], keep: dict[str, str]) -> None:
    """Drop the session's OFFPEAK_* settings (PostgreSQL, Redis) from a child environment."""
    for key in [k for k in env if k.startswith("OFFPEAK_") and k not in keep]:
        if key != "OFFPEAK_MODEL_CACHE_DIR":
            del env[key]


def run_small_batch(client: OpenAI, stack: OffpeakUp) -> None:
    path = CASES / "bom-crlf-blank-lines" / "input.jsonl"
    with path.open("rb") as handle:
        file = client.files.create(file=("in.jsonl", handle), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_for_end(client, batch.id, stack, timeout=120)  # type: ignore[arg-type]
    assert batch.status == "completed"
    check_ran_batch(client, batch, ["req-1", "req-2", "req-3"])


@pytest.fixture
def up(tmp_path: Path) -> Iterator[OffpeakUp]:
    data = tmp_path / "data"
    stack = OffpeakUp(embedded_env(data), free_port(), tmp_path / "logs")
    only_embedded(stack.env, embedded_env(data))
    stack.start()
    try:
        stack.wait_http()
        yield stack
    finally:
        stack.stop(signal.SIGKILL)


def test_up_restarts_a_killed_worker_and_stops_everything_on_ctrl_c(up: OffpeakUp) -> None:
    client = OpenAI(base_url=f"{up.base_url}/v1", api_key=KEY, max_retries=2)
    run_small_batch(client, up)
    # The address is shown once the API answers, not when its process starts.
    log = up.tail("up", 10_000)
    assert f"Offpeak up: API on {up.base_url}/v1" in log, log
    assert log.index("Offpeak up: starting") < log.index("Offpeak up: API on"), log

    victim = up.procs["control"]
    os.kill(victim, signal.SIGKILL)
    wait_until(
        lambda: up.procs.get("control") not in (None, victim),
        60,
        "restarted",
        up.tail("up"),
    )
    assert f"control (pid {victim}) ended by SIGKILL" in up.tail("up")
    assert "restarting in 1 s" in up.tail("up")
    run_small_batch(client, up)

    assert up.proc is not None
    everything = tree(up.proc.pid)
    assert {"api", "control", "engine"} <= set(up.procs)
    assert up.stop(signal.SIGINT) == 0  # what Ctrl-C sends
    assert wait_gone(everything) == []
    assert wait_gone(in_sessions(sessions(everything))) == []


def test_up_killed_takes_its_children_along(up: OffpeakUp) -> None:
    """SIGKILL of ``offpeak up`` itself: each child has the kernel's parent-death signal."""
    assert up.proc is not None
    everything = tree(up.proc.pid)
    assert len(everything) >= 4  # up, the API, a control and an engine worker
    up.proc.kill()
    up.proc.wait()
    assert wait_gone(everything) == []
    assert wait_gone(in_sessions(sessions(everything))) == []


def test_killed_control_worker_leaves_no_beat_and_one_beat_runs(tmp_path: Path) -> None:
    """kill -9 of a control worker leaves no beat behind (``-B`` left one, parent 1); of two
    control workers on one data folder one runs beat, the other takes over when it dies."""
    data = tmp_path / "data"
    stack = ServiceProcesses(embedded_env(data), free_port(), tmp_path / "logs", roles=())
    only_embedded(stack.env, embedded_env(data))
    stack.start()
    try:
        stack.start_worker("control", "control-1")
        wait_until(
            lambda: "beat: running" in stack.tail("control-1", 400),
            90,
            "beat",
            stack.tail("control-1"),
        )
        first = stack.procs.pop("control-1")
        os.kill(first.pid, signal.SIGKILL)  # the worker alone, not its process group
        first.wait()
        # With -B, beat was a child process in the worker's session: it lived on, parent 1.
        assert wait_gone(in_sessions({first.pid})) == []

        stack.start_worker("control", "control-2")
        wait_until(lambda: "beat: running" in stack.tail("control-2", 400), 90, "beat")
        stack.start_worker("control", "control-3")
        wait_until(lambda: "standing by" in stack.tail("control-3", 400), 90, "standing by")
        assert "beat: running" not in stack.tail("control-3", 400)

        holder = stack.procs.pop("control-2")
        holder.kill()
        holder.wait()
        wait_until(lambda: "beat: running" in stack.tail("control-3", 400), 90, "taken over")
        started = {holder.pid, *(proc.pid for proc in stack.procs.values())}
    finally:
        stack.stop()
    assert wait_gone(in_sessions(started)) == []
