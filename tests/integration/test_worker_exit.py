"""A worker told to stop exits within its stop timeout however slow the interpreter's own
teardown: once its work is handed back and its children are gone it exits without that
teardown (``offpeak.process_tree.exit_without_teardown``).

The fault, injected: an object whose finalizer takes a minute, freed with its module when the
interpreter tears itself down, as torch's and vLLM's are in an engine worker (seconds on a busy
host). The stop timeout's own timer cannot end that wait: it runs on a daemon thread, and
daemon threads stop running once the teardown frees modules.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import wait_until

OFFPEAK = str(Path(sys.executable).with_name("offpeak"))
STOP_TIMEOUT = 10
#: What the injected finalizer takes: far past the stop timeout.
TEARDOWN_SECONDS = 60

SLOW_TEARDOWN = f"""
import time


class _SlowFinalizer:
    def __del__(self, sleep=time.sleep):
        sleep({TEARDOWN_SECONDS})


slow = _SlowFinalizer()
"""


@pytest.mark.parametrize("role", ["control", "engine"])
def test_a_stopped_worker_exits_within_its_stop_timeout_however_slow_the_teardown(
    base_env: dict[str, str], run_id: str, role: str, tmp_path: Path
) -> None:
    (tmp_path / "sitecustomize.py").write_text(SLOW_TEARDOWN)
    env = {
        **os.environ,
        **base_env,
        "PYTHONPATH": str(tmp_path),
        "OFFPEAK_DATA_DIR": str(tmp_path / "data"),
        "OFFPEAK_QUEUE_PREFIX": f"{run_id}-exit-{role}",
        "OFFPEAK_MODELS": '{"m": {"engine": "instant"}}',
    }
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log_file:
        worker = subprocess.Popen(
            [OFFPEAK, "worker", "--role", role, "--stop-timeout", str(STOP_TIMEOUT)],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def ready() -> bool:
            assert worker.poll() is None, log_path.read_text(errors="replace")[-3000:]
            return " ready." in log_path.read_text(errors="replace")

        wait_until(ready, 120, "Celery ready", "")
        worker.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        try:
            code = worker.wait(timeout=STOP_TIMEOUT + TEARDOWN_SECONDS)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - signalled
        log = log_path.read_text(errors="replace")[-3000:]
        assert took < STOP_TIMEOUT, f"exited {took:.1f} s after SIGTERM\n{log}"
        assert code == 0, log  # stopped by itself, not by the stop timeout's forced exit
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
