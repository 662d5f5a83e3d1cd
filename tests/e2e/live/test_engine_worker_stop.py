"""A stop that stops, on the live stack's engine worker (the default two models: the chat model
and the embedding model, each its own engine): SIGTERM mid-batch ends its whole process tree
within its stop timeout, the lines it held back to pending, and a worker started after it
finishes the batch with every ``custom_id`` once.

It takes the live stack's engine worker away, so it runs after every other test of the folder
(``ends_live_engine``: ``tests/e2e/live/conftest.py``). Stand-ins for a slow engine close and a
benchmark stopped mid-leg: ``tests/e2e/test_stop.py``."""

from __future__ import annotations

import re
import signal

import pytest
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import DEFAULT_EMBEDDING_MODEL, DEFAULT_MODEL, Settings
from tests.e2e.test_lifecycle import held_by, status_of
from tests.support.batches import (
    check_billed_once,
    check_ran_batch,
    line_statuses,
    story_batch,
    wait_for_end,
)
from tests.support.processes import (
    alive,
    describe,
    start_instant_engine_worker,
    tree,
    wait_until,
    watch_until_gone,
)

pytestmark = [pytest.mark.engine, pytest.mark.ends_live_engine]

#: ``offpeak worker --stop-timeout``'s default: seconds from SIGTERM to the worker's exit.
STOP_TIMEOUT = 25.0
MODEL = DEFAULT_MODEL


def test_sigterm_ends_the_two_engine_worker_tree_within_its_stop_timeout(
    live: ServiceProcesses, live_sdk: OpenAI, live_settings: Settings
) -> None:
    assert set(live_settings.served_models) == {MODEL, DEFAULT_EMBEDDING_MODEL}
    ids = [f"stop-{i}" for i in range(120)]
    batch_id = story_batch(live_sdk, MODEL, ids, base_tokens=16)
    worker = live.procs["engine"]

    def holds_lines() -> bool:
        live.check_alive()
        return bool(held_by(live_settings, batch_id, worker.pid))

    wait_until(holds_lines, 300, "holding lines", live.tail("engine"))
    procs = alive(tree(worker.pid))  # the worker, both engine-cores and their children
    names = {proc.pid: describe(proc) for proc in procs}
    cores = [what for what in names.values() if "EngineCor" in what]
    assert len(cores) == 2, list(names.values())
    held = held_by(live_settings, batch_id, worker.pid)

    worker.send_signal(signal.SIGTERM)  # the worker only, as a supervisor or Kubernetes sends it
    ended = watch_until_gone(procs, STOP_TIMEOUT + 60)
    code = worker.wait(timeout=60)
    live.procs.pop("engine")
    log = live.tail("engine", 80)
    timeline = "\n".join(
        f"{ended.get(pid, float('inf')):6.1f} s  {what}" for pid, what in names.items()
    )
    print(f"process tree after SIGTERM:\n{timeline}")
    late = [names[p.pid] for p in procs if ended.get(p.pid, float("inf")) > STOP_TIMEOUT]
    assert late == [], f"alive {STOP_TIMEOUT:.0f} s after SIGTERM:\n{timeline}\n{log}"
    assert code == 0, log  # stopped by itself: a forced exit is 1
    # What it held a moment before the signal was handed back or written back; what it held
    # when the signal came is in its log, and none of its leases outlives it.
    assert set(status_of(live_settings, held)) <= {"pending", "succeeded"}
    handed_back = re.search(r"stopping: (\d+) lines handed back to pending", log)
    assert handed_back and int(handed_back.group(1)) > 0, log
    assert held_by(live_settings, batch_id, worker.pid) == set()
    status = line_statuses(live_settings, batch_id)
    assert status.get("pending", 0) > 0 and status.get("failed", 0) == 0, status

    # A restarted worker finishes the batch: every line once, nothing failed or billed twice.
    # On the instant engine, the model's name the same: what it shows is the lines handed back.
    start_instant_engine_worker(live, "engine-next", MODEL)
    batch = wait_for_end(live_sdk, batch_id, live, timeout=600)
    assert batch.status == "completed"
    output, errors = check_ran_batch(live_sdk, batch, ids)
    assert len(output) == len(ids) and errors == []
    check_billed_once(live_settings.resolved_database_url, batch)
