"""What every batch endpoint is made of, and what it may ask of an engine.

An endpoint (``Endpoint``) is three things: its request body as a pydantic model, how a parsed
body becomes engine input (``EngineInput``: prompt token ids and ``SamplingSpec``), and how a
finished line's neutral record (``offpeak.endpoints.records.Answer``) becomes its output body.

Engine input is computed against ``Tokenizer``, a Protocol that any loaded engine satisfies
(``workers.engine.base.Engine`` has these three members), so this package never imports
``workers`` or vLLM: the API may use it to name, parse and render lines.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from offpeak.endpoints.errors import LineError, line_error

if TYPE_CHECKING:
    from offpeak.endpoints.records import Answer


class Tokenizer(Protocol):
    """What an endpoint needs of an engine to turn a body into engine input.

    An embedding engine (``workers.engine.vllm_pooling``) also has ``embedding_size`` (its
    vectors' length) and ``matryoshka_dimensions``, which ``offpeak.endpoints.embeddings`` reads
    where present; text-generation engines have neither."""

    #: Context window in tokens (prompt + completion).
    max_model_len: int

    @property
    def vocab_size(self) -> int | None:
        """Token ids of the model's vocabulary are ``0 .. vocab_size - 1`` (``logit_bias`` keys
        are checked against it); ``None`` where only a remote server knows it, which checks."""
        ...

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` (``{role, content}`` with text content; an assistant's may
        carry ``tool_calls``, a ``tool`` message ``tool_call_id``) rendered with the model's chat
        template and the assistant's generation prompt, offering ``tools`` (OpenAI's chat tool
        shape; endpoints pass it only when there are tools). Raises ``ValueError`` for messages
        the template cannot render."""
        ...

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain prompt (with the tokenizer's BOS if it adds one)."""
        ...


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling for one request, already checked against OpenAI's ranges.

    ``max_tokens``: most new tokens per completion. ``logprobs``: ``None`` for none; ``k >= 0``
    for the sampled token's log-probability plus the ``k`` most likely alternatives at each
    position. ``top_k``: sample from the ``k`` most likely tokens only; 0 for all of them.
    The engine interface (``workers.engine.base``) takes this type as it is.
    ``structured_output``: constrain the completion to JSON (``StructuredOutput``), or ``None``.
    ``logit_bias``: ``(token id, bias)`` pairs, ascending by id, each bias in -100..100 added to
    that token's logit before sampling (OpenAI's ``logit_bias``); empty for none.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int = 0
    structured_output: StructuredOutput | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StructuredOutput:
    """Decode only text of a JSON shape (an engine's grammar-constrained decoding).

    ``json_schema``: the JSON Schema the text must validate against, as JSON text (checked
    against its meta-schema already, ``offpeak.endpoints.structured``); ``None`` for any JSON
    object (OpenAI's ``json_object``). ``param``: where the line set it (``response_format``,
    ``text.format``), for the error of a schema the engine's grammar backend refuses.
    """

    json_schema: str | None = None
    param: str = "response_format"


@dataclass(frozen=True)
class PoolingSpec:
    """What a pooling line (``/v1/embeddings``) asks of an embedding engine instead of text:
    ``inputs``, the token ids of each input, one vector each, in order; ``dimensions``, a
    shorter vector (a Matryoshka model's), or ``None`` for the model's own size."""

    inputs: tuple[tuple[int, ...], ...]
    dimensions: int | None = None


@dataclass(frozen=True)
class EngineInput:
    """What a request line asks of the engine: a prompt in token ids and its sampling.

    ``echo``: request fields the endpoint's output body repeats (the Responses API echoes
    ``instructions``, ``metadata``, ``text`` …), kept in the line's record; ``None`` for none.
    ``pooling``: set for an embeddings line, whose engine pools every input instead of
    generating (``prompt_token_ids`` is then its first input, the key lines are ordered by).
    """

    prompt_token_ids: list[int]
    sampling: SamplingSpec
    echo: dict[str, Any] | None = None
    pooling: PoolingSpec | None = None


Body = TypeVar("Body", bound=BaseModel)


class Endpoint(ABC, Generic[Body]):
    """One batch endpoint. Subclasses set the class attributes and implement
    ``engine_input`` and ``render``; one instance of each is registered by ``url``."""

    #: The batch ``endpoint`` / line ``url`` it serves, e.g. ``/v1/chat/completions``.
    url: ClassVar[str]
    #: The request body (limits in its ``Field`` definitions; unknown parameters allowed).
    body_model: type[Body]
    #: Body fields a line must carry, checked when the file is validated (a missing one fails
    #: the batch with ``missing_required_parameter``); everything else fails its line alone.
    required_fields: ClassVar[tuple[str, ...]]
    #: Prefix of the output body's ``id`` (``chatcmpl-``, ``cmpl-``).
    response_id_prefix: ClassVar[str]
    #: Whether validation refuses the whole input file for a line that sets ``stream``, names
    #: a model not served or another model than earlier lines (OpenAI's Batch API:
    #: ``streaming_unsupported``, ``model_not_found``, ``mismatched_model``). ``False``: the
    #: line runs on the batch's model, set when the batch is created, and the endpoint fails it
    #: alone (Anthropic's Message Batches check each request's params on their own).
    refuses_file_for_body: ClassVar[bool] = True
    #: Whether a line setting ``stream`` fails the whole file (``streaming_unsupported``);
    #: ``False``: the body model refuses it and the line fails alone, a 400 naming ``stream``.
    refuses_file_for_stream: ClassVar[bool] = True
    #: The API surface whose batches hold its lines: ``openai`` (``/v1/batches``) or
    #: ``anthropic`` (``/v1/messages/batches``).
    surface: ClassVar[str] = "openai"
    #: Most request lines one batch may hold; ``None``: the ``max_requests_per_batch`` setting.
    max_requests_per_batch: ClassVar[int | None] = None

    def parse(self, body: dict[str, Any]) -> Body:
        """The validated body. Raises ``LineError`` with OpenAI's code, message and param for
        the first problem, in the model's field order."""
        try:
            return self.body_model.model_validate(body)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            raise self.line_error(error) from None

    def line_error(self, error: ErrorDetails) -> LineError:
        """The ``LineError`` of one pydantic error. Endpoints override this for fields whose
        wording is their own, and fall back to this."""
        return line_error(error, self.body_model)

    def prepare(self, body: dict[str, Any], tokenizer: Tokenizer) -> EngineInput:
        """A line's ``body`` as engine input. Raises ``LineError``."""
        return self.engine_input(self.parse(body), tokenizer)

    @abstractmethod
    def engine_input(self, body: Body, tokenizer: Tokenizer) -> EngineInput:
        """Tokenize ``body`` and check it against the context window. Raises ``LineError``."""

    def engine_needs(self, engine_input: EngineInput) -> tuple[tuple[int, int], ...]:
        """``(prompt tokens, most new tokens)`` of each sequence the line puts in the engine,
        which slot sizing adds up. Text generation: one per ``n``, up to ``max_tokens`` each;
        an endpoint that generates nothing (embeddings) would return ``((prompt, 0),)``."""
        need = (len(engine_input.prompt_token_ids), engine_input.sampling.max_tokens)
        return (need,) * engine_input.sampling.n

    @abstractmethod
    def render(self, answer: Answer) -> dict[str, Any]:
        """The output body (``chat.completion``, ``text_completion`` …) of a finished line."""


def context_budget(prompt_len: int, max_tokens: int | None, limit: int, param: str) -> int:
    """The completion budget in tokens: ``max_tokens``, or what the context window leaves.

    Raises ``LineError`` (``context_length_exceeded``, OpenAI's wording) when ``limit`` tokens
    cannot hold the prompt and ``max_tokens``."""
    if prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit):
        asked = prompt_len + (max_tokens or 0)
        raise LineError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{asked} tokens ({prompt_len} in the prompt, {max_tokens or 0} for the completion). "
            "Please reduce the length of the prompt or the completion.",
            param,
            "context_length_exceeded",
        )
    return max_tokens if max_tokens is not None else limit - prompt_len
