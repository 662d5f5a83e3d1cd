"""Engines for tests: a stand-in that finishes one request per step (``SlowEngine``), and the
helpers that drive any engine of ``workers.engine.base.Engine`` request by request."""

from __future__ import annotations

import itertools
import time
from typing import Any

from workers.engine.base import EngineRequest, EngineResult, SamplingSpec
from workers.engine.instant import InstantEngine

#: Steps after which ``run`` gives up waiting: far above what any test's request needs.
MAX_STEPS = 5_000
_ids = itertools.count()


class SlowEngine(InstantEngine):
    """Finishes one request per step, ``delay`` seconds per step, like a slow decode."""

    def __init__(self, model_name: str, delay: float = 0.01) -> None:
        super().__init__(model_name)
        self.delay = delay

    def step(self) -> list[EngineResult]:
        time.sleep(self.delay)
        if not self._queued:
            return []
        first = next(iter(self._queued))
        keep = {k: v for k, v in self._queued.items() if k != first}
        self._queued = {first: self._queued[first]}
        results = super().step()
        self._queued = keep
        return results


def request(ids: list[int], **sampling: object) -> EngineRequest:
    """A request of prompt token ``ids`` with a new id; ``sampling`` as ``SamplingSpec``'s
    fields (32 tokens at temperature 0 unless given)."""
    sampling.setdefault("max_tokens", 32)
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=ids,
        sampling=SamplingSpec(**sampling),  # type: ignore[arg-type]
    )


def run(engine: Any, requests: list[EngineRequest]) -> dict[str, EngineResult]:
    """Add ``requests`` and step until the engine is idle; results by request id, each once."""
    for req in requests:
        engine.add(req)
    results: dict[str, EngineResult] = {}
    for _ in range(MAX_STEPS):
        if engine.num_unfinished() == 0:
            break
        for result in engine.step():
            assert result.request_id not in results, "a request finished twice"
            results[result.request_id] = result
    assert engine.num_unfinished() == 0, "requests still running after MAX_STEPS steps"
    return results


def one(engine: Any, req: EngineRequest) -> EngineResult:
    """Run ``req`` alone; its result."""
    return run(engine, [req])[req.request_id]


def chat(engine: Any, text: str) -> list[int]:
    """The prompt token ids of one user turn saying ``text``."""
    return engine.encode_chat([{"role": "user", "content": text}])  # type: ignore[no-any-return]
