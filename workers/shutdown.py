"""An engine worker's engines stopped by a deadline: every engine closed at once, and every
process they started (vLLM's engine-core and its model runner) gone, killed if a clean close
has not ended it in time.

A vLLM close waits for the engine-core up to 5 s (``vllm.v1.utils.shutdown``), which waits as
long for its model runner (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``), so closes one after another
add up; and a model runner whose engine-core was SIGKILLed ends on its own, a child of PID 1 no
longer in this process's tree. Its pid is taken here before the close, so it is waited for and
killed like the rest.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from workers.engine.base import Engine

log = logging.getLogger(__name__)

#: Seconds kept before the deadline to SIGKILL what a clean close left and let the kernel end
#: it (a model runner frees its KV cache as it exits).
KILL_RESERVE = 5.0
#: Seconds the engines' processes get to end after a close with no deadline.
UNBOUNDED_GRACE = 10.0


def engine_processes() -> list[psutil.Process]:
    """The processes this one started with ``multiprocessing`` (in an engine worker: vLLM's
    engine-cores) and every descendant of theirs, right now. Not the resource tracker, nor
    ``subprocess`` children."""
    found: list[psutil.Process] = []
    for child in multiprocessing.active_children():
        if child.pid is None:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(child.pid)
            found += [root, *root.children(recursive=True)]
    return found


def close_engines(engines: Mapping[str, Engine], until: float | None) -> list[str]:
    """Close every engine of ``engines`` at once, each on a thread of its own, and wait for the
    closes until ``until`` (``time.monotonic()``; ``None``: until all return). Returns the
    names whose close had not returned by then. A close that raises is logged, not raised."""

    def close(name: str, engine: Engine) -> None:
        try:
            engine.close()
        except Exception:
            log.warning("closing the engine for %s raised", name, exc_info=True)

    threads = {
        name: threading.Thread(target=close, args=(name, engine), name=f"close-{name}", daemon=True)
        for name, engine in engines.items()
    }
    for thread in threads.values():
        thread.start()
    for thread in threads.values():
        thread.join(None if until is None else max(0.0, until - time.monotonic()))
    return [name for name, thread in threads.items() if thread.is_alive()]


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    living = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                living.append(proc)
    return living


def wait_gone(procs: list[psutil.Process], until: float) -> list[psutil.Process]:
    """Wait until ``procs`` have ended or ``until`` (``time.monotonic()``); those still running.
    A zombie counts as ended; this process's own children are reaped."""
    while True:
        left = _alive(procs)
        if not left or time.monotonic() >= until:
            return left
        psutil.wait_procs(left, timeout=min(0.2, max(0.0, until - time.monotonic())))


def stop_engines(engines: Mapping[str, Engine], deadline: float | None) -> None:
    """A worker process's last act on its engines (``workers.engine_worker.EngineWorker.stop``):
    close every engine of ``engines`` in parallel and end every process this one started, all
    by ``deadline`` (``time.monotonic()``). Clean closes get until ``KILL_RESERVE`` seconds
    before it, then what is left of the processes gets SIGKILL. ``None``: the closes take what
    they take and the processes get ``UNBOUNDED_GRACE`` seconds after them. Never raises."""
    procs = engine_processes()  # before the closes: an orphaned model runner stays tracked
    clean_until = None if deadline is None else deadline - KILL_RESERVE
    late = close_engines(engines, clean_until)
    if late:
        log.warning("engines not closed in time, killing their processes: %s", ", ".join(late))
    if clean_until is None:
        clean_until = time.monotonic() + UNBOUNDED_GRACE
    left = wait_gone(procs, clean_until)
    for proc in left:
        log.warning("killing pid %d (%s): its engine's close left it", proc.pid, _name(proc))
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    final = clean_until + KILL_RESERVE if deadline is None else deadline
    left = wait_gone(left, max(final, time.monotonic() + 1.0))
    if left:
        log.warning("still ending after SIGKILL: %s", ", ".join(str(p.pid) for p in left))


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return "?"
