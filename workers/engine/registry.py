"""One engine per served model per worker process, loaded once and kept for the process's life."""

from __future__ import annotations

import logging
import time
from functools import lru_cache

from offpeak.settings import Settings
from workers.engine.base import Engine
from workers.shutdown import close_engines

log = logging.getLogger(__name__)
_engines: dict[str, Engine] = {}
#: Seconds the last ``load`` of each model took: a reload's estimate (``workers.engine.release``).
_load_seconds: dict[str, float] = {}


def load(settings: Settings, name: str) -> Engine:
    """The loaded engine for ``name``, building it on first use (vLLM: tens of seconds).

    Raises ``KeyError`` for a model that is not configured.
    """
    if name in _engines:
        return _engines[name]
    config = settings.models[name]
    started = time.perf_counter()
    engine: Engine
    if config.engine == "instant":
        from workers.engine.instant import InstantEngine

        engine = InstantEngine(name, config.max_model_len)
    elif config.engine == "remote":
        from workers import lifecycle
        from workers.engine.fleet import FleetEngine
        from workers.engine.remote import RemoteEngine
        from workers.model_store import ensure_model

        # The model's own tokenizer when a folder is configured; else the server's /tokenize.
        folder = config.path or config.source
        path = ensure_model(name, config, settings.model_cache_dir) if folder else None
        # Waits (with back-off) for the server to answer; only a stop request ends the wait.
        connect = FleetEngine.connect if config.is_fleet else RemoteEngine.connect
        engine = connect(name, config, path, stop=lifecycle.stop_requested)
    elif config.runner == "pooling":
        from workers.engine.vllm_pooling import VllmPoolingEngine
        from workers.model_store import ensure_model

        # An embedding model: small and quick to load, never released.
        path = ensure_model(name, config, settings.model_cache_dir)
        with _cpus(settings, name):
            engine = VllmPoolingEngine.load(name, config, path)
    else:
        from workers.engine.vllm_engine import VllmEngine
        from workers.model_store import ensure_model

        path = ensure_model(name, config, settings.model_cache_dir)
        # Sleep mode only where the engine may be released (it changes vLLM's allocator).
        release = bool(settings.scheduler.release_after_seconds)
        with _cpus(settings, name):
            engine = VllmEngine.load(name, config, path, sleep_mode=release)
    # The endpoints read it to parse "auto" tool calls (``offpeak.endpoints.tools``).
    engine.tool_parser = config.tool_parser  # type: ignore[union-attr]
    _load_seconds[name] = time.perf_counter() - started
    log.info("engine for %s ready in %.1f s", name, _load_seconds[name])
    _engines[name] = engine
    return engine


def _cpus(settings: Settings, name: str):  # type: ignore[no-untyped-def]
    """``cpu_binding.bound`` for ``name``'s engine, shared with this worker's in-process vLLM
    engines not loaded yet."""
    from workers.engine import cpu_binding

    left = [
        m
        for m in settings.served_models
        if m in settings.models and settings.models[m].engine == "vllm" and m not in _engines
    ]
    return cpu_binding.bound(name, max(len(left), 1), settings.host_engines)


def load_seconds(name: str) -> float:
    """Seconds the last engine load of ``name`` took in this process; 0 before any."""
    return _load_seconds.get(name, 0.0)


@lru_cache(maxsize=1)
def device_name() -> str:
    """``cpu`` or the first GPU's name (imports torch once; seconds)."""
    from workers.calibration import current_device

    return current_device()


def discard(name: str) -> None:
    """Forget ``name``'s engine and close it, ignoring errors (it is usually dead already); the
    next ``load`` builds a new one."""
    engine = _engines.pop(name, None)
    if engine is None:
        return
    try:
        engine.close()
    except Exception as exc:
        log.warning("closing the failed engine for %s raised %r", name, exc)


def loaded() -> dict[str, Engine]:
    return dict(_engines)


def take_all() -> dict[str, Engine]:
    """Every loaded engine, forgotten here: the caller closes them (``workers.shutdown``)."""
    engines = dict(_engines)
    _engines.clear()
    return engines


def close_all(until: float | None = None) -> list[str]:
    """Close every loaded engine at once (``workers.shutdown.close_engines``), waiting for the
    closes until ``until`` (``time.monotonic()``; ``None``: until all return); the names whose
    close had not returned by then."""
    return close_engines(take_all(), until)
