"""The engine adapters' modules share the test process's in-process SmolLM2 engine (``smollm2``):
``test_engine_remote`` compares the server's answers with it, ``test_engine_vllm`` (after it in
the folder's order) tests the adapter on it and closes it. They share one ``vllm serve`` too
(``server``): the free replica of ``test_engine_fleet``, then ``test_engine_remote``'s server."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.servers import VllmServe, free_port
from offpeak.settings import DEFAULT_MODEL, get_settings
from tests.support.smollm2 import close_smollm2_engine, smollm2_engine
from workers.model_store import ensure_model

log = logging.getLogger(__name__)


@pytest.fixture(scope="session", autouse=True)
def closes_the_inprocess_engine() -> Iterator[None]:
    """The in-process SmolLM2 engine (``tests/support/smollm2.py``) ends with the session at
    the latest, its engine-core process with it."""
    yield
    close_smollm2_engine()


@pytest.fixture(scope="module")
def smollm2() -> Any:
    """The test process's in-process SmolLM2 ``VllmEngine``, loaded on first use."""
    return smollm2_engine()


@pytest.fixture(scope="package")
def folder() -> Path:
    """The default model's folder (its weights and tokenizer)."""
    settings = get_settings()
    return ensure_model(DEFAULT_MODEL, settings.models[DEFAULT_MODEL], settings.model_cache_dir)


@pytest.fixture(scope="package")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServe]:
    """One ``vllm serve`` of the default model for the folder (a start is the costliest step of
    its tests); no test stops it: one that takes it away cuts a proxy in front of it."""
    started = time.monotonic()
    log_path = tmp_path_factory.mktemp("vllm") / "serve.log"
    server = VllmServe(
        folder, DEFAULT_MODEL, free_port(), log_path, dies_with_this_process=True, one_process=True
    )
    server.start()
    try:
        server.wait_ready()
        log.warning("vllm serve ready in %.1f s", time.monotonic() - started)
        yield server
    finally:
        server.stop()
