"""A benchmark owns the processes it starts: every leg's engine (a raw ``vllm.LLM``'s process,
``run_batch``, ``vllm serve``, Offpeak's services, and vLLM's engine-core and model runner under
each) ends with the benchmark, on SIGTERM, SIGINT or its own error.

- ``own_children``: called by ``offpeak bench`` before a benchmark runs; on SIGTERM or SIGINT
  it ends the tree of processes the benchmark started, then exits; when the benchmark ends,
  however it ends, it ends what is left of that tree.
- ``python -m bench.children MODULE ARGS…`` runs ``python -m MODULE ARGS…`` (vLLM's
  ``run_batch``) with its spawned children (the engine-core) set to die with it, so a killed
  leg leaves no engine-core behind either.
"""

from __future__ import annotations

import contextlib
import runpy
import signal
import sys
from collections.abc import Callable
from types import FrameType

import psutil

from offpeak.process_tree import (
    adopt_orphans,
    die_with_parent,
    spawned_children_die_with_this_process,
)

#: Seconds a child gets after SIGTERM before SIGKILL when the benchmark ends.
GRACE_SECONDS = 3.0
#: Rounds of ``end_tree``: a child being ended may start one more (vLLM's engine-core starting
#: its model runner), which a round after it finds.
ROUNDS = 3


def end_tree(spare: frozenset[int] = frozenset(), grace: float = GRACE_SECONDS) -> None:
    """End every descendant of this process but those of ``spare`` (pids) and theirs, taken as
    a whole tree first (a model runner stays known when its engine-core dies before it):
    SIGTERM, SIGKILL after ``grace`` seconds, then wait until they are gone. Orphans a dying
    child left (adopted: ``own_children``) are ended in the next round, up to ``ROUNDS``.
    Never raises."""
    for _ in range(ROUNDS):
        procs = _descendants(spare)
        if not procs:
            return
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.terminate()
        _, left = psutil.wait_procs(procs, timeout=grace)
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(left, timeout=10)


def _descendants(spare: frozenset[int]) -> list[psutil.Process]:
    """This process's live descendants, but ``spare`` and theirs."""
    try:
        procs = psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    spared = set(spare)
    for proc in procs:
        if proc.pid in spare:
            with contextlib.suppress(psutil.NoSuchProcess):
                spared |= {child.pid for child in proc.children(recursive=True)}
    return [proc for proc in procs if proc.pid not in spared and _alive(proc)]


def _alive(proc: psutil.Process) -> bool:
    """Running, not a zombie an adopted orphan left until it is reaped."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def own_children() -> Callable[[], None]:
    """From now on, the children this process starts end with the benchmark: on SIGTERM or
    SIGINT (``end_tree``, then ``SystemExit(128 + signal)``), or by the returned function, to
    call when the benchmark ends, an error included (it also puts the signal handlers back).
    Children that ran before the call are left alone. Call from the main thread.

    This process adopts the orphans of its descendants (``adopt_orphans``), so a child that a
    dying child started is still found and ended."""
    adopt_orphans()
    spare = frozenset(child.pid for child in psutil.Process().children(recursive=True))

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        # A repeat is ignored while the tree ends; the benchmark's own cleanups (its scratch
        # database dropped) run on the way out of the exception.
        signal.signal(signum, signal.SIG_IGN)
        end_tree(spare)
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def release() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        end_tree(spare)

    return release


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``python -m module args…`` with its spawned children (and itself)
    dying with their parent: for a vLLM entry point run as a benchmark's child."""
    return [sys.executable, "-m", "bench.children", module, *args]


def main() -> None:
    """``python -m bench.children MODULE ARGS…``: ``runpy`` MODULE as ``__main__``."""
    die_with_parent()
    spawned_children_die_with_this_process()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
