"""An engine that answers at once with a fixed text, for benchmarks of the control plane and
tests of everything but the model. Tokens are UTF-8 bytes."""

from __future__ import annotations

from typing import Any

from workers.engine.base import (
    Completion,
    EngineCapabilities,
    EngineRequest,
    EngineResult,
    TokenLogprob,
    UsageMeter,
)

ANSWER = "OK"


class InstantEngine:
    """Implements ``workers.engine.base.Engine``; every request finishes in the next step."""

    #: Its room is the model's configured ``max_num_seqs``.
    capabilities = EngineCapabilities()
    server_meter: UsageMeter | None = None

    def __init__(self, model_name: str, max_model_len: int = 2048) -> None:
        self.model_name = model_name
        self.max_model_len = max_model_len
        #: Its tokens are bytes.
        self.vocab_size = 256
        self._queued: dict[str, EngineRequest] = {}
        self._answers: dict[tuple[int, bool, int], list[Completion]] = {}

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        offered = "".join(f"<tool>{t['function']['name']}\n" for t in tools or ())
        text = offered + "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return list(text.encode())

    def encode_text(self, text: str) -> list[int]:
        return list(text.encode())

    def add(self, request: EngineRequest) -> None:
        self._queued[request.request_id] = request

    def step(self) -> list[EngineResult]:
        results = [
            EngineResult(
                request.request_id,
                len(request.prompt_token_ids),
                0,
                self._completions(
                    request.sampling.max_tokens,
                    request.sampling.logprobs is not None,
                    request.sampling.n,
                ),
            )
            for request in self._queued.values()
        ]
        self._queued.clear()
        return results

    def _completions(self, max_tokens: int, logprobs: bool, n: int) -> list[Completion]:
        """The answer's ``n`` completions; the same objects for every request that asks the
        same (nothing changes a result once returned), so a step costs the control plane's
        benchmark little of its own."""
        key = (max_tokens, logprobs, n)
        completions = self._answers.get(key)
        if completions is None:
            ids = list(ANSWER.encode())[:max_tokens]
            reason = "stop" if len(ids) == len(ANSWER.encode()) else "length"
            text = bytes(ids).decode(errors="replace")
            lps = [TokenLogprob(chr(t), 0.0) for t in ids] if logprobs else None
            completions = self._answers[key] = [Completion(text, ids, reason, lps)] * n
        return list(completions)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._queued.pop(request_id, None)

    def num_unfinished(self) -> int:
        return len(self._queued)

    def close(self) -> None:
        self._queued.clear()
