"""Crash safety: API, control worker and an engine worker, with short leases, on a PostgreSQL
and a Redis server of this module's own (``tests.support.servers``: throwaway servers in
temporary folders, on free ports). The engine is the instant one, claiming a few lines at a
time, so a batch of many lines is still running when the fault comes: the faults are the
database's, the broker's and the worker's, not the model's (a real engine worker killed:
``tests/e2e/test_lifecycle.py``).

- Redis restarted during validation and then several times in the middle of a batch (it keeps
  nothing on disk: queued messages are lost, the sweep sends them again; every worker stays up),
  and PostgreSQL restarted in the middle of a batch (workers keep their results until the
  database is back): the batch still completes.
- The engine worker killed with SIGKILL in the middle of a chunk: its leases run out and a
  second worker runs its lines; every ``custom_id`` comes back exactly once.

The restarts stop this module's servers only; the machine's shared ones are never touched.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import openai
import pytest
from openai import OpenAI
from sqlalchemy import func, select

import migrations
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import DEFAULT_MODEL, Settings
from storage.db import session_scope
from storage.models import EngineChunk, RequestLine, WorkerRecord
from tests.support.batches import (
    chat_line,
    check_billed_once,
    check_ran_batch,
    line_statuses,
    wait_for_end,
)
from tests.support.batches import submit as send
from tests.support.database import new_key, settings_from
from tests.support.processes import instant_stack_env, start_instant_engine_worker
from tests.support.servers import PostgresServer, RedisServer, free_port

MODEL = DEFAULT_MODEL
#: The engine worker the faults hit, and the one started after it is killed.
VICTIM, SURVIVOR = "engine-a", "engine-b"
#: Seconds a claim stays valid without a heartbeat (flushes renew it every half second).
LEASE_SECONDS = 6
#: Lines a claim takes, and a test batch's lines: at a claim's round trip per few lines, the
#: batch is still running when the fault comes.
CHUNK_SIZE, LINES = 2, 3000
#: Broker restarts in a row once lines run, after the one during validation: each a chance for
#: a consumer's reconnect to race its close (``offpeak.redis_broker``).
BROKER_RESTARTS = 3


@pytest.fixture(scope="module")
def crash_env(
    base_env: dict[str, str],
    run_id: str,
    own_postgres: PostgresServer,
    own_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, str]]:
    """The stack's environment: the module's own database server and broker, which the tests
    restart, and a queue prefix and data folder of its own."""
    url = own_postgres.create_database("offpeak_crash")
    migrations.upgrade(url)
    yield instant_stack_env(
        base_env,
        url,
        f"{run_id}-crash",
        OFFPEAK_BROKER_URL=own_redis.url(0),
        OFFPEAK_DATA_DIR=str(tmp_path_factory.mktemp("crash-data")),
        OFFPEAK_LEASE_SECONDS=str(LEASE_SECONDS),
        OFFPEAK_FLUSH_SECONDS="0.5",
        OFFPEAK_SWEEP_SECONDS="2",
        OFFPEAK_CHUNK_SIZE=str(CHUNK_SIZE),
    )
    from storage.db import get_engine

    get_engine(url).dispose()  # this process's pool, before its server goes away


@pytest.fixture(scope="module")
def crash_settings(crash_env: dict[str, str]) -> Settings:
    return settings_from(crash_env)


@pytest.fixture(scope="module")
def stack(
    crash_env: dict[str, str], crash_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    logs = tmp_path_factory.mktemp("crash-logs")
    stack = ServiceProcesses(crash_env, free_port(), logs, roles=("control",))
    stack.start()
    stack.start_worker("engine", VICTIM)
    try:
        stack.wait_http()
        wait_until(lambda: len(ready_workers(crash_settings)) == 1, stack, timeout=300)
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def client(stack: ServiceProcesses, crash_settings: Settings) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=new_key(crash_settings), max_retries=5)


def wait_until(check, stack: ServiceProcesses, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            logs = "\n".join(f"== {n}\n{stack.tail(n)}" for n in stack.procs)
            raise AssertionError(f"timed out after {timeout} s\n{logs}")
        stack.check_alive()
        time.sleep(0.25)


def ready_workers(settings: Settings) -> list[str]:
    """Ids of the ready engine workers (the control worker registers a ready record too)."""
    with session_scope(settings.resolved_database_url) as session:
        return list(
            session.scalars(
                select(WorkerRecord.id).where(
                    WorkerRecord.ready.is_(True), WorkerRecord.role == "engine"
                )
            )
        )


def lines_by_status(settings: Settings, batch_id: str) -> dict[str, int]:
    try:
        return line_statuses(settings, batch_id)
    except Exception:  # the database is restarting
        return {}


def pid_of(worker_id: str) -> int:
    """The process id in a worker id (``host:pid``, with a per-start suffix or without)."""
    return int(worker_id.split(":")[1])


def submit(client: OpenAI, prefix: str) -> tuple[str, list[str]]:
    """A batch of ``LINES`` lines, and their ``custom_id``s."""
    ids = [f"{prefix}-{i}" for i in range(LINES)]
    lines = [chat_line(c, f"Tell story number {i} about a lighthouse.") for i, c in enumerate(ids)]
    return send(client, lines).id, ids


def wait_through_outages(client: OpenAI, batch_id: str, stack: ServiceProcesses, timeout: float):  # type: ignore[no-untyped-def]
    """``wait_for_end``, retrying while the API answers errors (its database is restarting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return wait_for_end(
                client, batch_id, stack, timeout=max(1.0, deadline - time.monotonic())
            )
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def restart_broker(redis_server: RedisServer, stack: ServiceProcesses) -> None:
    """Restart the broker empty (``SHUTDOWN NOSAVE``: every queued message is lost), give the
    workers time to reconnect, and check every process is still up."""
    redis_server.restart()
    time.sleep(2)
    stack.check_alive()


@pytest.mark.parametrize("service", ["redis", "postgres"])
def test_batch_completes_across_a_restart(
    stack: ServiceProcesses,
    client: OpenAI,
    crash_settings: Settings,
    own_postgres: PostgresServer,
    own_redis: RedisServer,
    service: str,
) -> None:
    batch_id, ids = submit(client, f"restart-{service}")
    if service == "redis":
        # At once, while the control worker validates the file: a task in flight, its message
        # unacknowledged, is what made kombu's own transport fail the consumer's reconnect.
        restart_broker(own_redis, stack)
    wait_until(
        lambda: lines_by_status(crash_settings, batch_id).get("succeeded", 0) >= 2,
        stack,
        timeout=240,
    )
    before = lines_by_status(crash_settings, batch_id)
    assert before.get("pending", 0) + before.get("running", 0) > 0, "restart came too late"
    if service == "redis":
        for _ in range(BROKER_RESTARTS):
            restart_broker(own_redis, stack)
    else:
        own_postgres.restart("fast")  # open connections are cut
    batch = wait_through_outages(client, batch_id, stack, timeout=300)
    assert batch.status == "completed"
    output, errors = check_ran_batch(client, batch, ids)
    assert len(output) == LINES and not errors
    check_billed_once(crash_settings.resolved_database_url, batch)


def test_engine_worker_killed_mid_chunk(
    stack: ServiceProcesses, client: OpenAI, crash_settings: Settings
) -> None:
    batch_id, ids = submit(client, "kill")
    pids = {stack.procs[VICTIM].pid: VICTIM}

    def holder() -> str | None:
        """The engine worker holding leases on running lines, once some lines have finished."""
        with session_scope(crash_settings.resolved_database_url) as session:
            owners = session.scalars(
                select(RequestLine.lease_owner)
                .where(RequestLine.batch_id == batch_id, RequestLine.status == "running")
                .distinct()
            ).all()
        done = lines_by_status(crash_settings, batch_id).get("succeeded", 0)
        held = [pids[pid_of(o)] for o in owners if o]
        return held[0] if held and done >= 2 else None

    wait_until(lambda: holder() is not None, stack, timeout=240)
    victim = holder()
    assert victim is not None
    victim_id = next(
        w for w in ready_workers(crash_settings) if pid_of(w) == stack.procs[victim].pid
    )
    stack.kill(victim, signal.SIGKILL)  # its whole process group
    killed_at = time.time()
    start_instant_engine_worker(stack, SURVIVOR, MODEL)

    batch = wait_for_end(client, batch_id, stack, timeout=300)
    assert batch.status == "completed"
    output, errors = check_ran_batch(client, batch, ids)
    assert len(output) == LINES and not errors
    check_billed_once(crash_settings.resolved_database_url, batch)
    with session_scope(crash_settings.resolved_database_url) as session:
        attempts = session.scalars(
            select(RequestLine.attempts).where(RequestLine.batch_id == batch_id)
        ).all()
        late = session.scalar(
            select(func.count()).where(
                EngineChunk.worker_id == victim_id, EngineChunk.ended_at > killed_at + 1
            )
        )
    assert max(attempts) == 2, "the killed worker's lines ran again elsewhere"
    assert late == 0  # nothing written by the dead worker after its death
    assert SURVIVOR in stack.procs  # still up
