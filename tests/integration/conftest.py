"""The integration tier's stack of processes: the API, a control worker and an engine worker on
the instant engine (``instant_stack``), for tests of what the service does with a batch through
its real processes, PostgreSQL and Redis, where the model's answers do not matter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from tests.support.database import fresh_database, new_key, settings_from
from tests.support.processes import instant_stack_env, running
from tests.support.servers import free_port


@pytest.fixture(autouse=True)
def sealing_keys_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's sealing keys as they were before each test: the app factory configures
    them process-wide (``storage.sealing``), and an app built for another deployment (an
    embedded SQLite one has a key file of its own) would otherwise seal the next test's
    webhook secrets with a key its processes do not have."""
    from storage import sealing

    monkeypatch.setattr(sealing, "_sealer", sealing._sealer)
    monkeypatch.setattr(sealing, "_from_environment", sealing._from_environment)


@pytest.fixture(scope="session")
def instant_env(base_env: dict[str, str], run_id: str) -> Iterator[dict[str, str]]:
    """The instant stack's environment: its own database and queue prefix, the default model's
    name served by the instant engine."""
    with fresh_database(f"offpeak_{run_id}_instant") as url:
        yield instant_stack_env(base_env, url, f"{run_id}-instant")


@pytest.fixture(scope="session")
def instant_settings(instant_env: dict[str, str]) -> Settings:
    return settings_from(instant_env)


@pytest.fixture(scope="session")
def instant_stack(
    instant_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    """API, control worker and engine worker on the instant engine, for the whole session."""
    with running(
        ServiceProcesses(instant_env, free_port(), tmp_path_factory.mktemp("instant-logs"))
    ) as stack:
        yield stack


@pytest.fixture()
def instant_sdk(instant_stack: ServiceProcesses, instant_settings: Settings) -> OpenAI:
    """The official OpenAI SDK on the instant stack, with a new tenant's key."""
    return OpenAI(
        base_url=f"{instant_stack.base_url}/v1",
        api_key=new_key(instant_settings),
        max_retries=2,
    )
