"""The interface between Offpeak's runner and an inference engine.

The runner owns scheduling (what to admit, when to abort); an engine only tokenizes, accepts
requests and advances one step of continuous batching at a time. Token ids in, token ids and text
out; request bodies and output lines are the endpoints' (``offpeak.endpoints``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

# One definition of sampling for both sides: endpoints (in the core) build it, engines take it.
from offpeak.endpoints.base import PoolingSpec, SamplingSpec, StructuredOutput

__all__ = [
    "Completion",
    "Engine",
    "EngineFault",
    "EngineRequest",
    "EngineResult",
    "PoolingSpec",
    "RequestRefused",
    "SamplingSpec",
    "StructuredOutput",
    "TokenLogprob",
    "TopLogprob",
]


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    #: Lower runs first (vLLM's priority scheduling convention).
    priority: int = 0
    #: An embeddings line: pool each input instead of generating (an embedding engine only;
    #: ``prompt_token_ids`` is then the first input).
    pooling: PoolingSpec | None = None


@dataclass
class TopLogprob:
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    #: ``stop`` (end of sequence or a stop string) or ``length`` (``max_tokens`` reached).
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    #: The stop string that ended it (``finish_reason`` ``stop``), ``None`` for end of sequence.
    stop_sequence: str | None = None


@dataclass
class EngineResult:
    """A finished request: prompt token counts and one completion per ``n``."""

    request_id: str
    prompt_tokens: int
    #: Prompt tokens served from the prefix cache instead of prefilled again.
    cached_tokens: int
    completions: list[Completion]
    #: A pooling request's vectors, one per input in order, each little-endian float32 bytes
    #: (``prompt_tokens`` is then the sum over the inputs); ``None`` for generation.
    embeddings: list[bytes] | None = None
    #: A verdict the engine reached after ``add`` accepted the request (a remote server's 4xx
    #: answer): the line fails alone with it, as for ``add`` raising it; the counts are then 0.
    refused: RequestRefused | None = None


class RequestRefused(ValueError):
    """``add``'s verdict on one request (the line fails alone, a 400), naming the body field at
    fault (``param``) and OpenAI's ``code`` when the engine knows them; ``None`` otherwise."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class EngineFault(RuntimeError):
    """The engine failed, not the request line: it died, or raised something that is not a
    verdict on a request (``add`` raises ``ValueError`` for those).

    The runner hands the lines it holds back to pending and the worker rebuilds its engine; the
    lines run again. ``suspects`` are the runner's request ids that were inside the engine when
    it failed (one of them may have caused it). ``blameless``: no request can have caused it
    (a remote server that went away); the lines go back without an attempt counted.
    """

    def __init__(
        self, message: str, suspects: list[str] | None = None, *, blameless: bool = False
    ) -> None:
        super().__init__(message)
        self.suspects = suspects or []
        self.blameless = blameless


class Engine(Protocol):
    """One loaded model. Not thread-safe: one runner drives it."""

    model_name: str
    #: Context window in tokens (prompt + completion).
    max_model_len: int

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of ``messages`` rendered with the model's chat template, with the
        assistant's generation prompt appended. Raises ``ValueError`` for messages the template
        cannot render."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt (with the tokenizer's BOS if it adds one)."""
        ...

    def add(self, request: EngineRequest) -> None:
        """Queue a request; it joins the running batch at the next step it fits in."""
        ...

    def step(self) -> list[EngineResult]:
        """Run one engine step (prefill and/or one decode token for every running sequence);
        return the requests that finished in it."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests, queued or running; they return no result."""
        ...

    def num_unfinished(self) -> int:
        """Requests added and neither finished nor aborted."""
        ...

    def close(self) -> None:
        """Free the engine's memory and processes."""
        ...
