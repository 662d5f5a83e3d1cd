"""``offpeak up``'s supervisor: which exits it restarts (real child processes, no services)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from offpeak.cli.supervisor import CONFIGURATION_EXIT, Child, Supervisor


def exited_child(name: str, code: int) -> Child:
    """A child whose process already exited with ``code``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"raise SystemExit({code})"], start_new_session=True
    )
    proc.wait()
    return Child(name, ["worker"], proc=proc, started_at=time.monotonic(), restart_at=None)


def test_a_child_that_exits_is_restarted_after_a_backoff(tmp_path: Path) -> None:
    child = exited_child("api", 1)
    supervisor = Supervisor([child], {}, tmp_path, first_backoff=5.0)
    now = time.monotonic()
    supervisor._tick(now)
    assert child.proc is None and child.restart_at == pytest.approx(now + 5.0)
    assert not supervisor._stop.is_set()


def test_a_child_whose_settings_cannot_start_it_stops_everything(tmp_path: Path) -> None:
    """An engine worker that exits with the configuration code would fail again on every
    restart: nothing is restarted, every process stops and ``offpeak up`` exits with it."""
    (tmp_path / "engine.log").write_text("offpeak worker: the engine of m did not start\n")
    child = exited_child("engine", CONFIGURATION_EXIT)
    api = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    running = Child("api", ["serve"], proc=api, started_at=time.monotonic(), restart_at=None)
    supervisor = Supervisor([child, running], {}, tmp_path)
    supervisor._tick(time.monotonic())
    assert child.proc is None and child.restart_at is None
    assert supervisor._stop.is_set()
    assert supervisor.run() == CONFIGURATION_EXIT
    assert api.poll() is not None  # the other processes were stopped, not left running
