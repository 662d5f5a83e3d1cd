"""The Redis broker going away under a worker (``offpeak.redis_broker``), and a worker that Celery
stops anyway (``workers.celery_worker.run_worker``), each on a Redis server of the test's own.

The close after a lost connection is driven through kombu's public API in the order Celery's
consumer takes (``Consumer.on_connection_error_after_connected``: ``collect``, then ``close``),
at the moment a real consumer is always in: a ``BRPOP`` in flight, a broadcast queue bound, a
task delivered and not yet acknowledged. The control runs kombu's own transport through the
same steps: it shows the harness reproduces the fault, so the test of ours can fail. If the
control starts failing, kombu has fixed the race upstream. The whole stack across repeated
broker restarts: ``tests/integration/test_crash.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kombu import Connection, Exchange, Queue

from offpeak.celery_app import make_celery
from tests.support.database import settings_from
from tests.support.servers import redis_server

OURS = "offpeak.redis_broker:Transport"
KOMBU = "kombu.transport.redis:Transport"
OFFPEAK = str(Path(sys.executable).with_name("offpeak"))


def close_after_the_broker_went_away(transport: str) -> None:
    """Consume one message (left unacknowledged) and wait on the queue once more with a
    broadcast queue bound, as a worker's consumer does; stop the server; then ``collect`` and
    ``close`` the connection as Celery does after a connection error."""
    with redis_server() as server:
        conn = Connection(server.url(0), transport=transport)
        tasks = Queue("tasks", Exchange("tasks"), "tasks")
        broadcast = Queue("broadcast", Exchange("broadcast", type="fanout"), auto_delete=True)
        with conn.Producer() as producer:
            producer.publish(
                {"n": 1}, exchange=tasks.exchange, routing_key="tasks", declare=[tasks]
            )
        delivered: list[object] = []
        consumer = conn.Consumer(
            [tasks, broadcast],
            channel=conn.default_channel,
            callbacks=[lambda _body, message: delivered.append(message)],
            accept=["json"],
        )
        consumer.consume()
        conn.drain_events(timeout=5)
        assert len(delivered) == 1
        with contextlib.suppress(TimeoutError):  # nothing more comes; a BRPOP stays in flight
            conn.drain_events(timeout=0.3)
        server.stop()
        conn.collect()
        conn.close()


def test_kombu_redis_transport_fails_to_close_after_the_broker_went_away() -> None:
    """Control: kombu's own transport raises ``AttributeError`` (not a connection error, so
    Celery stops the worker)."""
    with pytest.raises(AttributeError, match="hostname"):
        close_after_the_broker_went_away(KOMBU)


def test_our_transport_closes_after_the_broker_went_away() -> None:
    close_after_the_broker_went_away(OURS)


def test_redis_brokers_use_our_transport(base_env: dict[str, str]) -> None:
    app = make_celery(settings_from({**base_env, "OFFPEAK_BROKER_URL": "redis://127.0.0.1:1/0"}))
    assert app.conf.broker_transport == OURS
    assert type(app.connection_for_read().transport).__module__ == "offpeak.redis_broker"


@pytest.mark.parametrize("role", ["control", "engine"])
def test_a_worker_celery_stops_exits_non_zero(
    base_env: dict[str, str], run_id: str, role: str
) -> None:
    """A broker that refuses the command a consumer waits with (``BRPOP`` renamed away, as an
    ACL or a proxy can): Celery calls that unrecoverable and stops. The worker exits 1, so a
    supervisor that restarts only on failure (systemd's ``Restart=on-failure``) restarts it."""
    with redis_server(extra=("--rename-command", "BRPOP", "")) as server:
        env = {
            **os.environ,
            **base_env,
            "OFFPEAK_BROKER_URL": server.url(0),
            "OFFPEAK_QUEUE_PREFIX": f"{run_id}-refused-{role}",
            "OFFPEAK_MODELS": '{"m": {"engine": "instant"}}',
        }
        started = time.monotonic()
        result = subprocess.run(
            [OFFPEAK, "worker", "--role", role],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert "Unrecoverable error" in result.stderr, result.stderr[-3000:]
    assert result.returncode == 1, (time.monotonic() - started, result.stderr[-3000:])
