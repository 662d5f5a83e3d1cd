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
    "EngineCapabilities",
    "EngineFault",
    "EngineRequest",
    "EngineResult",
    "LoraSpec",
    "PoolingSpec",
    "RequestRefused",
    "SamplingSpec",
    "SleepableEngine",
    "StructuredOutput",
    "TokenLogprob",
    "TopLogprob",
    "UsageMeter",
]


@dataclass(frozen=True)
class LoraSpec:
    """A LoRA adapter a request runs with: its served ``name`` and its PEFT folder ``path``
    (local, already fetched)."""

    name: str
    path: str


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
    #: The LoRA adapter to run with; ``None``: the base model.
    lora: LoraSpec | None = None


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
    fault (``param``) and OpenAI's ``code`` when the engine knows them; ``None`` otherwise.
    ``status_code`` 500: the line cannot run here for a reason of the server's (an adapter that
    does not load), not the line's body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status_code: int = 400,
    ) -> None:
        super().__init__(message)
        self.param, self.code, self.status_code = param, code, status_code


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


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do and hold, declared by the engine (the runner never probes for it).

    The room (``max_num_seqs``, the KV cache) sizes the runner's chunks
    (``workers.scheduler.chunking.engine_room``); ``None`` is unknown: the model's configured
    ``max_num_seqs`` then stands in, and without a KV cache size sizing is by sequences alone.
    """

    #: ``sleep`` / ``wake_up`` free and refill the device memory (``SleepableEngine``, vLLM's
    #: sleep mode); otherwise releasing the engine closes it and loads it again.
    can_sleep: bool = False
    #: Prompt blocks seen before are served from a cache (``EngineResult.cached_tokens``).
    prefix_caching: bool = False
    #: ``step`` collects finished requests from elsewhere (a remote server) rather than running
    #: one decode step, so the runner counts finished tokens, not one per running sequence.
    step_is_poll: bool = False
    #: Serves embeddings lines (``EngineRequest.pooling``) only.
    pooling: bool = False
    #: Sequences it runs at once.
    max_num_seqs: int | None = None
    #: KV cache: tokens it holds, bytes per token, tokens per block.
    kv_cache_tokens: int | None = None
    kv_bytes_per_token: int | None = None
    block_size: int | None = None


class UsageMeter(Protocol):
    """A shared server's usage (``workers.engine.remote.ServerMeter``: busy seconds and the
    server's token counts), by which the write-back prices our share of its time."""

    def usage(self) -> Any: ...


class Engine(Protocol):
    """One loaded model. Not thread-safe: one runner drives it."""

    model_name: str
    #: Context window in tokens (prompt + completion).
    max_model_len: int

    @property
    def vocab_size(self) -> int | None:
        """Token ids are ``0 .. vocab_size - 1``; ``None`` where only a remote server knows."""
        ...

    @property
    def capabilities(self) -> EngineCapabilities:
        """What it can do and hold (fixed once the engine is loaded)."""
        ...

    @property
    def server_meter(self) -> UsageMeter | None:
        """The meter of a server shared with others (a remote engine); ``None`` for an engine of
        our own, whose time is the seconds spent stepping it."""
        ...

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
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


class SleepableEngine(Engine, Protocol):
    """An engine with ``capabilities.can_sleep``."""

    def sleep(self) -> None:
        """Free the device memory (weights to host memory, the KV cache discarded). Raises
        ``RuntimeError`` with a request in flight."""
        ...

    def wake_up(self) -> None:
        """Back from ``sleep``: weights on the device again, an empty KV cache."""
        ...
