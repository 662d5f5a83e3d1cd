"""The fixtures of the integration and end-to-end tiers: a fresh PostgreSQL database migrated with
Alembic, Redis as the broker, settings on both and the API in-process. Registered for the whole
suite by ``tests/conftest.py``; a test requests them by name, and ``tests/conftest.py`` refuses a
unit test that does (``EXTERNAL_FIXTURES``), so the unit tier never reaches PostgreSQL or Redis.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from offpeak.settings import Settings
from tests.support.database import LIMITS_OFF, fresh_database, new_key, settings_from
from tests.support.object_store import own_s3  # noqa: F401 (a fixture)
from tests.support.servers import own_postgres, own_redis, redis_server  # noqa: F401 (fixtures)

#: A Redis for the run to use instead of a throwaway server of its own (``broker_url``).
SHARED_REDIS_URL = os.environ.get("OFFPEAK_TEST_REDIS")
#: The fixtures that reach PostgreSQL or Redis (directly or through another one).
EXTERNAL_FIXTURES = frozenset(
    {
        "database_url",
        "broker_url",
        "base_env",
        "settings",
        "http",
        "api_key",
        "sdk",
        "own_postgres",
        "own_redis",
        "own_s3",
    }
)


@pytest.fixture(scope="session")
def run_id() -> str:
    return f"t{os.getpid()}{secrets.token_hex(3)}"


@pytest.fixture(scope="session")
def database_url(run_id: str) -> Iterator[str]:
    """The database of the in-process tests."""
    with fresh_database(f"offpeak_{run_id}") as url:
        yield url


@pytest.fixture(scope="session")
def broker_url(run_id: str) -> Iterator[str]:
    """The run's Redis: a throwaway ``redis-server`` of the session's own, gone with it, so the
    run leaves nothing in the machine's Redis (on a shared server kombu's own bookkeeping —
    ``unacked``, ``_kombu.binding_deadlines``, the pidbox bindings — outlives the run under names
    no queue prefix identifies). ``OFFPEAK_TEST_REDIS`` points the run at a running server
    instead (db 7 of the local one when ``redis-server`` is not installed); then the run's
    queues and bindings are deleted afterwards, by the run id in their names."""
    shared = SHARED_REDIS_URL
    if shared is None and shutil.which("redis-server") is None:
        shared = "redis://127.0.0.1:6379/7"
    if shared is None:
        with redis_server() as server:
            yield server.url(0)
        return
    yield shared
    import redis

    client = redis.Redis.from_url(shared)
    for key in client.scan_iter(f"*{run_id}*"):
        client.delete(key)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("offpeak-data")


@pytest.fixture(scope="session")
def base_env(database_url: str, broker_url: str, data_dir: Path, run_id: str) -> dict[str, str]:
    """The environment every process of the session shares (settings are read from it),
    with a sealing key made as an operator makes one (``offpeak keys new-secret-key``) and
    the tenant limits off (``LIMITS_OFF``)."""
    from cryptography.fernet import Fernet

    return {
        "OFFPEAK_SECRET_KEYS": json.dumps([Fernet.generate_key().decode()]),
        "OFFPEAK_DATABASE_URL": database_url,
        "OFFPEAK_BROKER_URL": broker_url,
        "OFFPEAK_DATA_DIR": str(data_dir),
        "OFFPEAK_QUEUE_PREFIX": run_id,
        "OFFPEAK_ALLOWED_COMPLETION_WINDOWS": '["24h", "60s", "1h"]',
        "OFFPEAK_SWEEP_SECONDS": "2",
        **LIMITS_OFF,
    }


@pytest.fixture(scope="session")
def settings(base_env: dict[str, str], run_id: str) -> Settings:
    """Settings for in-process tests. Their own queue prefix keeps the tasks they send away from
    the live stack's workers, which would otherwise run those batches on the real model."""
    return settings_from({**base_env, "OFFPEAK_QUEUE_PREFIX": f"{run_id}-inproc"})


@pytest.fixture(scope="session")
def http(settings: Settings) -> Iterator[TestClient]:
    """The API in-process (no worker consumes the tasks it sends)."""
    from api.app import create_app

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
