"""A stop that stops: SIGTERM to an engine worker serving the default two models (the chat
model and the embedding model) mid-batch ends its whole process tree within its stop timeout,
its held lines back to pending; and a benchmark interrupted during a leg leaves no engine behind.

The tests marked ``engine`` run real vLLM engines (run them under
``flock /tmp/offpeak-engine.lock``); the first test runs stand-ins for an engine's processes.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from tests.e2e.test_lifecycle import held_by, start_engine, status_of
from tests.support.batches import (
    check_billed_once,
    check_ran_batch,
    line_statuses,
    story_batch,
    wait_for_end,
)
from tests.support.database import fresh_database, new_key, settings_from
from tests.support.processes import alive, running, start_instant_engine_worker, tree, wait_until
from tests.support.servers import free_port
from tests.support.smollm2 import default_models_json

#: ``offpeak worker --stop-timeout``'s default: seconds from SIGTERM to the worker's exit.
STOP_TIMEOUT = 25.0
MODEL = "SmolLM2-135M-Instruct"


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.name()} [{proc.status()}] {' '.join(proc.cmdline())[:80]!r}"
    except psutil.NoSuchProcess:
        return f"{proc.pid} (gone)"


def watch_until_gone(procs: list[psutil.Process], timeout: float) -> dict[int, float]:
    """Seconds from now until each of ``procs`` ended (a zombie counts as ended); those still
    running after ``timeout`` are absent."""
    started, ended = time.monotonic(), {}
    while time.monotonic() - started < timeout:
        for proc in procs:
            if proc.pid not in ended and not alive([proc]):
                ended[proc.pid] = time.monotonic() - started
        if len(ended) == len(procs):
            break
        time.sleep(0.1)
    return ended


# -- engines closed at once, their processes ended by the deadline ------------------------------

_ORPHAN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def _engine_core(started: Any) -> None:
    """Stands in for vLLM's engine-core: starts a model runner that ignores SIGTERM."""
    runner = subprocess.Popen([sys.executable, "-c", _ORPHAN])
    started.put(runner.pid)
    time.sleep(600)


class _SlowClose:
    """An engine whose close takes ``seconds`` and kills its engine-core (as vLLM's does after
    its own wait), leaving the model runner orphaned."""

    def __init__(self, core: Any, seconds: float) -> None:
        self.core, self.seconds = core, seconds
        self.closed_at = float("inf")

    def close(self) -> None:
        time.sleep(self.seconds)
        self.core.kill()
        self.closed_at = time.monotonic()


def test_stop_engines_closes_them_at_once_and_kills_what_they_leave() -> None:
    from workers import shutdown

    spawn = multiprocessing.get_context("spawn")
    started = spawn.Queue()
    cores = [spawn.Process(target=_engine_core, args=(started,)) for _ in range(2)]
    for core in cores:
        core.start()
    runners = [psutil.Process(started.get(timeout=60)) for _ in cores]
    engines = {"a": _SlowClose(cores[0], 2), "b": _SlowClose(cores[1], 2)}
    began = time.monotonic()
    deadline = began + shutdown.KILL_RESERVE + 3
    shutdown.stop_engines(engines, deadline)
    assert time.monotonic() < deadline + 1
    closes = [engine.closed_at - began for engine in engines.values()]
    assert max(closes) < 2 * 2, f"closed one after another: {closes}"
    assert alive(runners) == [], "a model runner outlived its engine's close"


# -- the default two-engine worker -----------------------------------------------------------


@pytest.fixture(scope="module")
def stop_env(
    base_env: dict[str, str], run_id: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """The session's services and a database of its own; the models as configured by default
    (the chat model and the embedding model, each its own engine), the chat model's KV cache
    of a fixed size (tests/inprocess_engine.py), so the engine starts on a busy machine too."""
    with fresh_database(f"offpeak_{run_id}_stop") as url:
        yield {
            **base_env,
            "OFFPEAK_DATABASE_URL": url,
            "OFFPEAK_QUEUE_PREFIX": f"{run_id}-stop",
            "OFFPEAK_DATA_DIR": str(tmp_path_factory.mktemp("stop-data")),
            "OFFPEAK_LEASE_SECONDS": "6",
            "OFFPEAK_MODELS": default_models_json(2**30),
        }


@pytest.fixture(scope="module")
def stop_settings(stop_env: dict[str, str]) -> Settings:
    settings = settings_from(stop_env)
    assert set(settings.served_models) == set(settings.models) == {MODEL, "all-MiniLM-L6-v2"}
    return settings


@pytest.fixture(scope="module")
def stop_stack(
    stop_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    """The API and a control worker; the test starts the engine workers."""
    with running(
        ServiceProcesses(
            stop_env, free_port(), tmp_path_factory.mktemp("stop-logs"), roles=("control",)
        )
    ) as stack:
        yield stack


def chat_batch(client: OpenAI, ids: list[str]) -> str:
    return story_batch(client, MODEL, ids, base_tokens=16)


@pytest.mark.engine
def test_sigterm_ends_the_two_engine_worker_tree_within_its_stop_timeout(
    stop_stack: ServiceProcesses, stop_settings: Settings
) -> None:
    client = OpenAI(
        base_url=f"{stop_stack.base_url}/v1", api_key=new_key(stop_settings), max_retries=2
    )
    ids = [f"stop-{i}" for i in range(120)]
    batch_id = chat_batch(client, ids)
    worker = start_engine(stop_stack, "engine-two")

    def holds_lines() -> bool:
        stop_stack.check_alive()
        return bool(held_by(stop_settings, batch_id, worker.pid))

    # Two engines to load on a shared 2-core machine: minutes.
    wait_until(holds_lines, 900, "holding lines", stop_stack.tail("engine-two"))
    procs = alive(tree(worker.pid))  # the worker, both engine-cores and their children
    assert len(procs) >= 3, [describe(proc) for proc in procs]
    names = {proc.pid: describe(proc) for proc in procs}
    held = held_by(stop_settings, batch_id, worker.pid)

    worker.send_signal(signal.SIGTERM)  # the worker only, as a supervisor or Kubernetes sends it
    ended = watch_until_gone(procs, STOP_TIMEOUT + 60)
    code = worker.wait(timeout=60)
    stop_stack.procs.pop("engine-two")
    log = stop_stack.tail("engine-two", 80)
    timeline = "\n".join(
        f"{ended.get(pid, float('inf')):6.1f} s  {what}" for pid, what in names.items()
    )
    print(f"process tree after SIGTERM:\n{timeline}")
    late = [names[p.pid] for p in procs if ended.get(p.pid, float("inf")) > STOP_TIMEOUT]
    assert late == [], f"alive {STOP_TIMEOUT:.0f} s after SIGTERM:\n{timeline}\n{log}"
    assert code == 0, log  # stopped by itself: a forced exit is 1
    # What it held a moment before the signal was handed back or written back; what it held
    # when the signal came is in its log, and none of its leases outlives it.
    assert set(status_of(stop_settings, held)) <= {"pending", "succeeded"}
    handed_back = re.search(r"stopping: (\d+) lines handed back to pending", log)
    assert handed_back and int(handed_back.group(1)) > 0, log
    assert held_by(stop_settings, batch_id, worker.pid) == set()
    status = line_statuses(stop_settings, batch_id)
    assert status.get("pending", 0) > 0 and status.get("failed", 0) == 0, status

    # A restarted worker finishes the batch: every line once, nothing failed or billed twice.
    # On the instant engine, the model's name the same: what it shows is the lines handed back.
    start_instant_engine_worker(stop_stack, "engine-next", MODEL)
    batch = wait_for_end(client, batch_id, stop_stack, timeout=900)
    assert batch.status == "completed"
    output, errors = check_ran_batch(client, batch, ids)
    assert len(output) == len(ids) and errors == []
    check_billed_once(stop_settings.resolved_database_url, batch)


# -- a benchmark interrupted during a leg -----------------------------------------------------


def in_session(sid: int) -> list[psutil.Process]:
    """Every running process of session ``sid`` (orphans keep their session)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                found.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive(found)


@pytest.mark.engine
def test_sigterm_to_a_benchmark_during_a_raw_engine_leg_leaves_no_engine(
    tmp_path: Path,
) -> None:
    bench = subprocess.Popen(
        [sys.executable, "-m", "offpeak", "bench", "e2e", "--requests", "2", "--max-tokens", "2",
         "--max-num-seqs", "2", "--out", str(tmp_path)],
        stdout=(tmp_path / "bench.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own session: what it leaves behind is found there
    )  # fmt: skip
    log = tmp_path / "bench.log"

    def engine_core_up() -> bool:
        assert bench.poll() is None, log.read_text()
        return any("VLLM::EngineCore" in describe(p) for p in tree(bench.pid))

    wait_until(engine_core_up, 900, "in the raw leg")
    procs = alive(tree(bench.pid))
    names = {proc.pid: describe(proc) for proc in procs}
    assert any("bench.raw_engine" in what for what in names.values()), names

    bench.send_signal(signal.SIGTERM)
    code = bench.wait(timeout=60)
    ended = watch_until_gone(procs, 30)
    left = [names[p.pid] for p in procs if p.pid not in ended]
    strays = in_session(bench.pid)
    stray = [describe(p) for p in strays]
    for proc in [*alive(procs), *strays]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()  # not left to the next test
    assert left == [] and stray == [], f"left: {left}\nstray: {stray}\n{log.read_text()[-3000:]}"
    assert code != 0
