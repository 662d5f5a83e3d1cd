"""Hosts, not processes: the API, the control worker and two engine workers (instant engine) each
on a host of its own (a network namespace with its own hostname, data, temp and home folders),
PostgreSQL, Redis and the S3 store on the test's virtual network (``tests/support/hosts.py``).

- A batch runs with every line once, its files objects on the store, nothing on any host's disk.
- One engine host's link is cut while it holds leased lines: its leases run out, the other host
  runs those lines, the batch completes with every line once and is billed once. When the link
  comes back the cut host rejoins (heartbeats again), and its late write-back changes nothing:
  the rows it held keep the other host's results (fenced on the lease).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psycopg
import pytest
from cryptography.fernet import Fernet
from openai import OpenAI
from sqlalchemy import select, text

import migrations
from offpeak.settings import DEFAULT_MODEL
from storage.db import session_scope
from storage.models import LedgerEntry, RequestLine, WorkerRecord
from tests.support.batches import chat_line, check_ran_batch, submit, wait_for_end
from tests.support.database import LIMITS_OFF, new_key, settings_from
from tests.support.hosts import Host, VirtualNetwork, virtual_network
from tests.support.object_store import S3Server, s3_env, s3_server
from tests.support.processes import wait_until
from tests.support.servers import postgres_server, redis_server

API_PORT = 8000
#: Short leases, so a lost host's lines come back within seconds.
LEASE_SECONDS = 8
#: The server drops a vanished client's connection, and so its row locks, within seconds (as
#: docs/deployment.md asks of a production server, with longer times): a host cut off in the
#: middle of a claim would otherwise keep its rows locked, where no lease expiry reaches.
SERVER_SETTINGS = (
    "tcp_user_timeout = 5000",
    "tcp_keepalives_idle = 5",
    "tcp_keepalives_interval = 2",
    "tcp_keepalives_count = 2",
)


@dataclass
class Fleet:
    network: VirtualNetwork
    api: Host
    control: Host
    engines: dict[str, Host]
    database_url: str
    env: dict[str, str]
    store: S3Server

    @property
    def base_url(self) -> str:
        return f"http://{self.api.address}:{API_PORT}"

    def check_alive(self) -> None:
        for host in (self.api, self.control, *self.engines.values()):
            host.check_alive()

    def logs(self) -> str:
        hosts = (self.api, self.control, *self.engines.values())
        return "\n".join(f"== {h.name}/{n}\n{h.tail(n)}" for h in hosts for n in h.procs)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, run_id: str) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("hosts")
    with (
        virtual_network(root) as network,
        postgres_server(host=network.gateway) as pg,
        redis_server(host=network.gateway) as redis,
        s3_server(host=network.gateway) as store,
    ):
        url = pg.create_database("offpeak")
        with psycopg.connect(pg.url("offpeak", driver="postgresql"), autocommit=True) as conn:
            for setting in SERVER_SETTINGS:
                conn.execute(f"ALTER DATABASE offpeak SET {setting}")
        migrations.upgrade(url)
        env = {
            "OFFPEAK_SECRET_KEYS": json.dumps([Fernet.generate_key().decode()]),
            "OFFPEAK_DATABASE_URL": url,
            "OFFPEAK_BROKER_URL": redis.url(0),
            **s3_env(store.endpoint, "blobs"),
            "OFFPEAK_QUEUE_PREFIX": f"{run_id}-hosts",
            "OFFPEAK_MODELS": json.dumps({DEFAULT_MODEL: {"engine": "instant"}}),
            "OFFPEAK_ALLOWED_COMPLETION_WINDOWS": '["24h"]',
            "OFFPEAK_SWEEP_SECONDS": "2",
            "OFFPEAK_LEASE_SECONDS": str(LEASE_SECONDS),
            "OFFPEAK_WORKER_ALIVE_SECONDS": "8",
            "OFFPEAK_CHUNK_SIZE": "100",
            **LIMITS_OFF,
        }
        api, control = network.add_host("api"), network.add_host("control")
        engines = {name: network.add_host(name) for name in ("engine-a", "engine-b")}
        api.start("api", ["serve", "--host", "0.0.0.0", "--port", str(API_PORT)], env)
        control.start("control", ["worker", "--role", "control"], env)
        for host in engines.values():
            # Results wait 3 s in the worker before they are written: the lines it holds are
            # leased in the database meanwhile, where the test sees them.
            host.start(
                "engine", ["worker", "--role", "engine"], {**env, "OFFPEAK_FLUSH_SECONDS": "3"}
            )
        client_env = {**env, "OFFPEAK_DATA_DIR": str(root / "test-client")}
        fleet = Fleet(network, api, control, engines, url, client_env, store)
        wait_until(lambda: _answers(fleet.base_url), 120, "the API host answering", fleet.logs())
        wait_until(lambda: _live_engines(url) == 2, 120, "two engine hosts ready", fleet.logs())
        yield fleet


def _answers(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _live_engines(url: str) -> int:
    try:
        with session_scope(url) as session:
            rows = session.scalars(select(WorkerRecord).where(WorkerRecord.role == "engine")).all()
            return sum(1 for r in rows if r.ready and r.heartbeat_at > time.time() - 8)
    except Exception:
        return 0


def _client(fleet: Fleet) -> OpenAI:
    key = new_key(settings_from(fleet.env))
    return OpenAI(base_url=f"{fleet.base_url}/v1", api_key=key, max_retries=2)


def test_a_batch_runs_across_hosts_with_every_line_once(fleet: Fleet) -> None:
    client = _client(fleet)
    ids = [f"h{i}" for i in range(300)]
    batch = submit(client, [chat_line(i, f"question {i}", max_tokens=2) for i in ids])
    ended = wait_for_end(client, batch.id, timeout=180)
    assert ended.status == "completed", fleet.logs()
    check_ran_batch(client, ended, ids)
    assert f"blobs/outputs/{batch.id}/output.jsonl" in fleet.store.keys("blobs/outputs/")
    with session_scope(fleet.database_url) as session:
        hosts = {w.hostname for w in session.scalars(select(WorkerRecord)).all()}
    assert {"control", "engine-a", "engine-b"} <= hosts
    for host in fleet.network.hosts:
        assert not (host.root / "data" / "blobs").exists(), f"{host.name} kept a blob on disk"
    print(f"server connections by host after a batch: {_connections_by_host(fleet)}")


def _connections_by_host(fleet: Fleet) -> dict[str, int]:
    """PostgreSQL's connections per host, told apart by their address."""
    names = {host.address: host.name for host in fleet.network.hosts}
    with session_scope(fleet.database_url) as session:
        rows = session.execute(
            text(
                "SELECT host(client_addr), count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() GROUP BY 1"
            )
        ).all()
    return {names.get(address, "test"): int(count) for address, count in rows}


def _held_by(url: str, batch_id: str, hostname: str) -> dict[int, float | None]:
    with session_scope(url) as session:
        rows = session.execute(
            select(RequestLine.id, RequestLine.lease_expires_at)
            .where(RequestLine.batch_id == batch_id)
            .where(RequestLine.status == "running")
            .where(RequestLine.lease_owner.like(f"{hostname}:%"))
        ).all()
    return {row.id: row.lease_expires_at for row in rows}


def _finished(url: str, ids: list[int]) -> dict[int, tuple[str, str | None, float | None]]:
    with session_scope(url) as session:
        rows = session.execute(
            select(
                RequestLine.id, RequestLine.status, RequestLine.result, RequestLine.finished_at
            ).where(RequestLine.id.in_(ids))
        ).all()
    return {row.id: (row.status, row.result, row.finished_at) for row in rows}


def test_a_host_cut_mid_batch_loses_nothing_and_its_late_writes_are_fenced(fleet: Fleet) -> None:
    client = _client(fleet)
    lost = fleet.engines["engine-b"]
    # Enough lines that engine-b still holds leased ones when it is cut: the instant engine
    # answers a claim at once, and a drain that runs out of lines writes back what it holds.
    ids = [f"c{i}" for i in range(20_000)]
    batch = submit(client, [chat_line(i, f"question {i}", max_tokens=2) for i in ids])
    held: dict[int, float | None] = {}

    def holding() -> bool:
        held.update(_held_by(fleet.database_url, batch.id, lost.name))
        return bool(held)

    wait_until(holding, 120, "engine-b holding leased lines", fleet.logs())
    lost.cut()
    cut_at = time.monotonic()
    try:
        # What it held at the cut (it cannot write anything since).
        moved = sorted(_held_by(fleet.database_url, batch.id, lost.name))
        assert moved, "engine-b wrote back between the look and the cut"
        ended = wait_for_end(client, batch.id, timeout=300)
        recovered = time.monotonic() - cut_at
        assert ended.status == "completed", fleet.logs()
        check_ran_batch(client, ended, ids)
        before = _finished(fleet.database_url, moved)
        assert {status for status, _, _ in before.values()} == {"succeeded"}
    finally:
        lost.restore()
    restored_at = time.time()

    def rejoined() -> bool:
        with session_scope(fleet.database_url) as session:
            workers = session.scalars(
                select(WorkerRecord).where(WorkerRecord.hostname == lost.name)
            ).all()
            return any(w.heartbeat_at > restored_at for w in workers)

    wait_until(rejoined, 240, "engine-b heartbeating again", lost.tail("engine"))
    # Its late write-back (results held since the cut) comes once the connection open at the cut
    # gives up, after TCP's retransmission back-off; it is fenced off, and changed none of the
    # rows it had held.
    fenced = lambda: "results not stored: their leases had lapsed" in lost.tail("engine", 2000)  # noqa: E731
    wait_until(fenced, 120, "engine-b's late write-back", lost.tail("engine"))
    assert _finished(fleet.database_url, moved) == before
    after = client.batches.retrieve(batch.id)
    assert after.request_counts is not None and after.request_counts.completed == len(ids)
    with session_scope(fleet.database_url) as session:
        bills = session.scalars(select(LedgerEntry).where(LedgerEntry.batch_id == batch.id)).all()
        assert [b.requests for b in bills] == [len(ids)]
    print(f"lines moved: {len(moved)}; cut to completed: {recovered:.1f} s")
