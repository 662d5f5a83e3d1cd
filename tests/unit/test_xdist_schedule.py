"""How ``make test`` hands modules to its pytest-xdist workers (``tests/conftest.py``): the
end-to-end units go to one worker per CPU, and a worker past the CPUs gets only integration and
unit modules, then stops. Drives the suite's own scheduler with stand-in workers."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import pytest_xdist_make_scheduler, takes_engines

COLLECTION = [
    "tests/e2e/live/test_e2e.py::test_a",
    "tests/e2e/live/test_tools.py::test_b",
    "tests/e2e/test_stop.py::test_c",
    "tests/e2e/test_lora.py::test_d",
    "tests/integration/test_crash.py::test_e",
    "tests/integration/test_hosts.py::test_f",
    "tests/unit/test_lane.py::test_g",
]


class Worker:
    """What the scheduler sees of an xdist worker: its id, the tests sent to it, its stop."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[str] = []

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent += [COLLECTION[i] for i in indexes]

    def shutdown(self) -> None:
        self.shutting_down = True


def scheduler(workers: list[Worker]) -> Any:
    config = SimpleNamespace(
        getvalue=lambda name: {"dist": "loadscope", "tx": [f"{len(workers)}*popen"]}[name],
        option=SimpleNamespace(loadscopereorder=True),
    )
    sched = pytest_xdist_make_scheduler(config, None)  # type: ignore[arg-type]
    for worker in workers:
        sched.add_node(worker)
        sched.add_node_collection(worker, COLLECTION)
    sched.schedule()
    return sched


def finish(sched: Any, worker: Worker) -> None:
    """``worker`` reports every test sent to it so far as done."""
    for nodeid in list(worker.sent):
        if not sched.assigned_work[worker][sched._split_scope(nodeid)][nodeid]:
            sched.mark_test_complete(worker, COLLECTION.index(nodeid))


def test_a_worker_past_the_cpus_takes_no_engine_and_stops_when_only_engines_are_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert takes_engines("gw0") and takes_engines("gw1") and not takes_engines("gw2")
    gw0, gw1, gw2 = (Worker(f"gw{i}") for i in range(3))
    sched = scheduler([gw0, gw1, gw2])
    assert gw2.sent and not any(t.startswith("tests/e2e/") for t in gw2.sent)
    # The engines' workers start on the end-to-end units, in the collection's order.
    assert gw0.sent[0].startswith("tests/e2e/live/") and gw1.sent[0].startswith("tests/e2e/")
    while not gw2.shutting_down:
        finish(sched, gw2)
    assert not any(t.startswith("tests/e2e/") for t in gw2.sent)
    # Every test is sent once, whoever runs it.
    while not (gw0.shutting_down and gw1.shutting_down):
        finish(sched, gw0)
        finish(sched, gw1)
    sent = gw0.sent + gw1.sent + gw2.sent
    assert sorted(sent) == sorted(COLLECTION)


def test_with_a_worker_per_cpu_every_worker_takes_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    workers = [Worker(f"gw{i}") for i in range(3)]
    scheduler(workers)
    assert all(w.sent and w.sent[0].startswith("tests/e2e/") for w in workers)
