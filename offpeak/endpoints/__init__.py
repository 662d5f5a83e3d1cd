"""The batch endpoints, one module each, and the registry everything asks (``ENDPOINTS``).

Each module (``chat_completions``, ``completions``, ``responses``, ``embeddings``, ``score``,
``rerank`` …) holds its
endpoint's request body as a pydantic model, how a parsed body becomes engine input, and how a
finished line's record becomes its output body. Adding an endpoint is one new module and one
entry in ``ENDPOINTS``.

Who asks: the API's batch create (which endpoints a batch may target), the file validation
(which body fields a line must carry), the runner (``workers.engine_io``: a line's body to an
engine request, an engine result to a record) and finalize (records to OpenAI's output lines).

Why here, in the core: the API must name the endpoints and, for a second API surface (Anthropic's
Message Batches), parse request bodies and render finished lines, yet it may import only the core
and ``storage``. So the whole endpoint lives here, with the two things that would tie it to
``workers`` replaced by neutral ones: engine input is computed against ``base.Tokenizer`` (a
Protocol every engine satisfies) into ``base.SamplingSpec`` (which the engine interface uses as
its own), and results are stored as ``records`` rather than as OpenAI's bytes. Turning an engine's
own result into a record stays in ``workers.engine_io``, next to the engine types.
"""

from __future__ import annotations

from typing import Any

from offpeak import wire
from offpeak.endpoints import records
from offpeak.endpoints.anthropic_messages import AnthropicMessages
from offpeak.endpoints.base import Endpoint, EngineInput, SamplingSpec, Tokenizer
from offpeak.endpoints.chat_completions import ChatCompletions
from offpeak.endpoints.completions import Completions
from offpeak.endpoints.embeddings import Embeddings
from offpeak.endpoints.errors import LineError
from offpeak.endpoints.rerank import Rerank
from offpeak.endpoints.responses import Responses
from offpeak.endpoints.score import Score

__all__ = [
    "BATCH_ENDPOINTS",
    "ENDPOINTS",
    "UNSERVED_BATCH_ENDPOINTS",
    "Endpoint",
    "EngineInput",
    "LineError",
    "SamplingSpec",
    "Tokenizer",
    "get",
    "openai_line",
    "record_line",
]

#: Batch endpoints served here, by url.
ENDPOINTS: dict[str, Endpoint[Any]] = {
    endpoint.url: endpoint
    for endpoint in (
        ChatCompletions(),
        Completions(),
        Responses(),
        Embeddings(),
        Score(),
        Rerank(),
        AnthropicMessages(),
    )
}
#: The urls an OpenAI batch may target, in the order error messages list them (Anthropic's
#: ``/v1/messages`` lines come only through the Message Batches API).
BATCH_ENDPOINTS = tuple(url for url, endpoint in ENDPOINTS.items() if endpoint.surface == "openai")
#: Endpoints OpenAI's Batch API accepts that this server does not run (OpenAI's API reference,
#: Batch, ``endpoint``). Batch create answers these, like any other url it does not serve, with
#: a 400 ``invalid_value`` naming ``BATCH_ENDPOINTS``.
UNSERVED_BATCH_ENDPOINTS = (
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/videos",
)


def get(url: str) -> Endpoint[Any]:
    """The endpoint serving ``url``. Raises ``LineError`` (``invalid_url``) for another url."""
    endpoint = ENDPOINTS.get(url)
    if endpoint is None:
        raise LineError(
            f"The url {url!r} is not served here; use one of {', '.join(BATCH_ENDPOINTS)}.",
            "url",
            "invalid_url",
        )
    return endpoint


def openai_line(custom_id: str, stored: str) -> bytes:
    """The output or error file line (JSON, no newline) of a finished line whose
    ``requests.result`` is ``stored``: a record rendered in OpenAI's batch line shape, or a
    line stored already rendered (before records) as it is. Raises ``LineError`` for a record
    of an endpoint no longer served, ``pydantic.ValidationError`` for a damaged record."""
    record = records.load(stored)
    if record is None:
        return stored.encode()
    return record_line(custom_id, record)


def record_line(custom_id: str, record: records.Answer | records.Failure) -> bytes:
    """``openai_line`` of a record already loaded. Raises ``LineError`` for a record of an
    endpoint no longer served."""
    if isinstance(record, records.Answer):
        status, body = 200, get(record.endpoint).render(record)
    else:
        status = record.status_code
        body = wire.error_object(record.message, record.type, record.param, record.code)
    return wire.response_line(
        custom_id, status, body, line_id=record.line_id, request_id=record.request_id
    )
