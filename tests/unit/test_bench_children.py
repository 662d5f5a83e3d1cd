"""A benchmark ends every process it started, one a child starts while it is being ended
included (vLLM's engine-core starting its model runner as the benchmark is stopped)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

#: A child that, told to stop, starts a grandchild of its own and exits at once: the grandchild
#: is orphaned as the benchmark's tree is being ended.
CHILD = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    def on_term(*_):
        late = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        open(sys.argv[1], "w").write(str(late.pid))
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    time.sleep(120)
    """
)

#: The benchmark's side: its children owned (``own_children``), one started, then released.
BENCHMARK = textwrap.dedent(
    """
    import subprocess, sys
    from bench.children import own_children
    release = own_children()
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "ready"
    release()
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="prctl is Linux's")
def test_a_child_started_while_the_tree_ends_is_ended_too(tmp_path: Path) -> None:
    late_pid = tmp_path / "late.pid"
    done = subprocess.run(
        [sys.executable, "-c", BENCHMARK, CHILD, str(late_pid)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    pid = int(late_pid.read_text())
    try:
        late = psutil.Process(pid)
        alive = late.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    if alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            late.kill()
    assert not alive, "the grandchild started during the stop outlived the benchmark"
