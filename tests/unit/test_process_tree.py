"""Children of a worker: a spawn child (as vLLM starts its engine-core) dies with its SIGKILLed
parent when armed, and kill_children leaves multiprocessing's resource tracker to end with the
process."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import psutil
import pytest

from tests.support.processes import alive, wait_gone

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
