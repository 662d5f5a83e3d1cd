"""A stop that stops: the engine worker's stop closes its engines at once and kills what their
close leaves behind (stand-ins for an engine's processes), and a benchmark interrupted during a
leg leaves no engine behind (a real vLLM engine). SIGTERM to the live stack's two-engine worker
mid-batch: ``tests/e2e/live/test_engine_worker_stop.py``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.processes import alive, describe, tree, wait_until, watch_until_gone

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
