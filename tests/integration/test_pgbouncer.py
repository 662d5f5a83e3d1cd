"""The service behind PgBouncer in transaction pooling mode: the API, a control worker and an
engine worker (instant engine) reach PostgreSQL only through the pooler, with prepared
statements off (``OFFPEAK_DATABASE_POOL__PREPARED_STATEMENTS=false``); a batch runs with every
line once, and the whole stack holds no more server connections than the pooler's pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from tests.support.batches import chat_line, check_ran_batch, submit, wait_for_end
from tests.support.database import PG_ADMIN, fresh_database, new_key, settings_from
from tests.support.pgbouncer import PgBouncer, pgbouncer
from tests.support.processes import instant_stack_env, running
from tests.support.servers import free_port

POOL_SIZE = 6


@pytest.fixture(scope="module")
def bouncer(run_id: str) -> Iterator[tuple[str, PgBouncer]]:
    """A fresh database (migrated directly, as a deployment's migration job does) and a
    PgBouncer in front of it."""
    name = f"offpeak_{run_id}_bouncer"
    with fresh_database(name), pgbouncer(name, pool_size=POOL_SIZE) as pooler:
        yield name, pooler


@pytest.fixture(scope="module")
def env(
    base_env: dict[str, str], run_id: str, bouncer: tuple[str, PgBouncer], data_dir: Path
) -> dict[str, str]:
    name, pooler = bouncer
    more = {
        "OFFPEAK_DATABASE_POOL__PREPARED_STATEMENTS": "false",
        "OFFPEAK_DATA_DIR": str(data_dir / "bouncer-stack"),
    }
    return instant_stack_env(base_env, pooler.url(name), f"{run_id}-bouncer", **more)


@pytest.fixture(scope="module")
def stack(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    logs = tmp_path_factory.mktemp("bouncer-logs")
    with running(ServiceProcesses(env, free_port(), logs)) as processes:
        yield processes


def _server_connections(database: str) -> int:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (database,)
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_batch_runs_through_pgbouncer_in_transaction_mode(
    stack: ServiceProcesses, env: dict[str, str], bouncer: tuple[str, PgBouncer]
) -> None:
    settings = settings_from(env)
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=new_key(settings), max_retries=0)
    ids = [f"p{i}" for i in range(60)]
    batch = submit(client, [chat_line(i, f"question {i}", max_tokens=2) for i in ids])
    for _ in range(20):  # the same statements again and again: what psycopg would prepare
        client.batches.retrieve(batch.id)
        client.files.retrieve(batch.input_file_id)
    ended = wait_for_end(client, batch.id, stack, timeout=180)
    assert ended.status == "completed", ended.errors
    check_ran_batch(client, ended, ids)
    for _ in range(8):  # probes, as an orchestrator sends them
        for probe in ("/healthz", "/readyz"):
            assert httpx.get(f"{stack.base_url}{probe}").status_code == 200, probe
    name, pooler = bouncer
    # Every process of the stack kept its pools open; the server saw only the pooler's.
    assert 0 < _server_connections(name) <= POOL_SIZE, pooler.tail()
