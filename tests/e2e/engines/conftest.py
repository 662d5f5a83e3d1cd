"""The engine adapters' modules share the test process's in-process SmolLM2 engine (``smollm2``):
``test_engine_remote`` compares the server's answers with it, ``test_engine_vllm`` (after it in
the folder's order) tests the adapter on it and closes it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.smollm2 import close_smollm2_engine, smollm2_engine


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
