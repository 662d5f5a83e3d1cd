"""The simulation's engine: the ``Engine`` interface on a virtual clock, each decode step costing
``base + per_sequence × batch`` seconds (``workers.planner.StepModel``, by default 10 ms + 0.4 ms,
``docs/planning.md``)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import Any

from workers.engine.base import (
    Completion,
    EngineCapabilities,
    EngineRequest,
    EngineResult,
    UsageMeter,
)
from workers.planner import StepModel
from workers.scheduler.clock import VirtualClock

MODEL = "simulated-model"
#: Llama 3 8B's KV cache per token, and the tokens of it an 80 GB GPU holds beside its 16 GB of
#: weights: (80e9 − 16e9) / 131,072 bytes per token = 488,281 (``docs/planning.md``).
LLAMA3_8B_KV_BYTES_PER_TOKEN = 131_072
LLAMA3_8B_KV_CACHE_TOKENS = 488_281


class SimEngine:
    """The ``Engine`` interface on a virtual clock: each step costs ``step_model`` seconds for
    the sequences running and gives each of them one token; a request finishes after
    ``max_tokens`` steps. At most ``max_num_seqs`` run; the rest wait, as in vLLM. Prompt blocks
    seen before count as cached tokens (prefix caching, with no eviction)."""

    block_size = 16
    server_meter: UsageMeter | None = None

    def __init__(
        self,
        clock: VirtualClock,
        step_model: StepModel,
        max_num_seqs: int = 256,
        kv_cache_tokens: int = LLAMA3_8B_KV_CACHE_TOKENS,
        max_model_len: int = 4096,
        on_step: Callable[[float, float], None] | None = None,
    ) -> None:
        self.model_name = MODEL
        self.max_model_len = max_model_len
        #: Its tokens are bytes.
        self.vocab_size = 256
        self.max_num_seqs = max_num_seqs
        self.capabilities = EngineCapabilities(
            prefix_caching=True,
            max_num_seqs=max_num_seqs,
            kv_cache_tokens=kv_cache_tokens,
            kv_bytes_per_token=LLAMA3_8B_KV_BYTES_PER_TOKEN,
            block_size=self.block_size,
        )
        self.clock, self.step_model, self.on_step = clock, step_model, on_step
        self.steps = 0
        self._waiting: deque[EngineRequest] = deque()
        self._running: dict[str, tuple[EngineRequest, int]] = {}
        self._finish: list[tuple[int, str]] = []
        self._seen_blocks: set[int] = set()

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return list(text.encode())

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode())

    def add(self, request: EngineRequest) -> None:
        self._waiting.append(request)

    def _cached(self, prompt: list[int]) -> int:
        cached, hit = 0, True
        for end in range(self.block_size, len(prompt) + 1, self.block_size):
            key = hash(tuple(prompt[:end]))
            if hit and key in self._seen_blocks:
                cached = end
            else:
                hit = False
                self._seen_blocks.add(key)
        return cached

    def step(self) -> list[EngineResult]:
        while self._waiting and len(self._running) < self.max_num_seqs:
            request = self._waiting.popleft()
            cached = self._cached(request.prompt_token_ids)
            self._running[request.request_id] = (request, cached)
            finish = self.steps + max(1, request.sampling.max_tokens)
            heapq.heappush(self._finish, (finish, request.request_id))
        if not self._running:
            return []
        cost = self.step_model.step_seconds(len(self._running))
        if self.on_step is not None:
            self.on_step(self.clock.time(), cost)
        self.clock.advance(cost)
        self.steps += 1
        results = []
        while self._finish and self._finish[0][0] <= self.steps:
            _, request_id = heapq.heappop(self._finish)
            entry = self._running.pop(request_id, None)
            if entry is None:  # aborted
                continue
            request, cached = entry
            tokens = [0] * request.sampling.max_tokens
            completions = [Completion("", tokens, "length")] * request.sampling.n
            results.append(
                EngineResult(request_id, len(request.prompt_token_ids), cached, completions)
            )
        return results

    def abort(self, request_ids: list[str]) -> None:
        doomed = set(request_ids)
        for request_id in doomed:
            self._running.pop(request_id, None)
        if doomed:
            self._waiting = deque(r for r in self._waiting if r.request_id not in doomed)

    def num_unfinished(self) -> int:
        return len(self._running) + len(self._waiting)

    def close(self) -> None:
        self._waiting.clear()
        self._running.clear()
