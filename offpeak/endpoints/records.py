"""What storage keeps for a finished request line (``requests.result``): a neutral record that
each API surface renders in its own wire format.

- ``Answer``: a line the endpoint answered — its endpoint and model, ``created``, token counts
  and, per completion, the text, finish reason, tokens and log-probabilities.
- ``Failure``: a line that failed alone — ``status_code``, ``type``, ``code``, ``message``,
  ``param``.

Both carry the ids their output line shows (``batch_req_…``, ``req_…`` and the body's
``chatcmpl-…``), chosen once when the line finishes, so writing the files again writes the same
bytes. OpenAI's lines are rendered from them when a batch is finalized
(``offpeak.endpoints.openai_line``); another surface (the Anthropic Message Batches API) reads
the same records (``load``) and writes its own result lines, without parsing OpenAI's.

Rows finished before records existed hold their OpenAI line as it was written; ``load`` returns
``None`` for those and the renderer passes them through as they are, so no data migration is
needed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from offpeak.endpoints.errors import LineError
from offpeak.ids import new_ids

_RECORD = ConfigDict(frozen=True, extra="ignore")


class TokenLogprob(BaseModel):
    """A sampled token, its log-probability (natural log; ``None`` for minus infinity, as
    JSON has no infinities) and the ``top`` alternatives as ``(token, logprob)`` pairs."""

    model_config = _RECORD

    token: str
    logprob: float | None
    top: list[tuple[str, float | None]] = []


class CompletionRecord(BaseModel):
    """One of a line's ``n`` completions."""

    model_config = _RECORD

    text: str
    #: ``stop`` (end of sequence or a stop string) or ``length`` (``max_tokens`` reached).
    finish_reason: str
    #: Tokens generated.
    tokens: int
    #: The stop string that ended the completion, when one did (Anthropic's ``stop_sequence``).
    stop_sequence: str | None = None
    #: ``None`` unless the line asked for log-probabilities.
    logprobs: list[TokenLogprob] | None = None


class Answer(BaseModel):
    """A line the endpoint answered (status 200)."""

    model_config = _RECORD

    record: Literal["answer"] = "answer"
    #: The endpoint's url (``/v1/chat/completions``): which renderer formats the body.
    endpoint: str
    model: str
    #: Unix seconds.
    created: int
    #: The output line's ``id`` (``batch_req_…``), ``response.request_id`` and body ``id``.
    line_id: str
    request_id: str
    response_id: str
    prompt_tokens: int
    #: Prompt tokens served from the prefix cache.
    cached_tokens: int
    completions: list[CompletionRecord]
    #: Request fields the output body repeats (``EngineInput.echo``: the Responses API's
    #: ``instructions``, ``metadata``, ``text`` …); ``None`` for endpoints that repeat none.
    echo: dict[str, Any] | None = None
    #: An embeddings line's vectors, one per input, each little-endian float32 bytes in base64
    #: (``offpeak.endpoints.embeddings``); ``None`` for text endpoints.
    embeddings: list[str] | None = None

    @property
    def completion_tokens(self) -> int:
        """Tokens generated, summed over the completions."""
        return sum(c.tokens for c in self.completions)


class Failure(BaseModel):
    """A line that failed alone: the error its endpoint answered."""

    model_config = _RECORD

    record: Literal["failure"] = "failure"
    line_id: str
    request_id: str
    status_code: int
    #: ``invalid_request_error`` (4xx, the line's fault) or ``server_error`` (5xx).
    type: str
    code: str | None
    message: str
    param: str | None


Record = Annotated[Answer | Failure, Field(discriminator="record")]
_RECORDS: TypeAdapter[Answer | Failure] = TypeAdapter(Record)
#: Every stored record starts so (``record`` is its first field); a line stored already
#: rendered, from before records, starts with ``{"id":``.
_MARK = '{"record":'


def new_line_ids() -> tuple[str, str]:
    """A fresh output line ``id`` and ``request_id``."""
    line_id, request_id = new_ids("batch_req_", "req_")
    return line_id, request_id


def failure(error: LineError) -> Failure:
    """The record of a line that failed with ``error``, with fresh ids."""
    line_id, request_id = new_line_ids()
    return Failure(
        line_id=line_id,
        request_id=request_id,
        status_code=error.status_code,
        type=error.type,
        code=error.code,
        message=error.message,
        param=error.param,
    )


def dump(record: Answer | Failure) -> str:
    """The JSON text stored in ``requests.result``."""
    return record.model_dump_json()


def dump_answer(fields: dict[str, Any]) -> str:
    """``dump(Answer(**fields))``, byte for byte, without building the model (a third of the
    cost; the runner stores one per answered line). ``fields``: ``Answer``'s own (``record``
    may be left out), already of its types (our engine's results, not client input),
    ``completions`` as dicts of ``CompletionRecord``'s fields and ``logprobs`` as dicts of
    ``TokenLogprob``'s. A line
    whose record repeats request fields (``echo``: any JSON the client sent) takes the model's
    path, as does anything ``orjson`` refuses."""
    if fields.get("echo") is not None:
        return dump(Answer(**fields))
    try:
        if tuple(fields) == _RECORD_KEYS and all(
            tuple(c) == _COMPLETION_FIELDS for c in fields["completions"]
        ):
            # Already the record's keys in its order (``workers.engine_io`` builds them so):
            # written as they are, no dict copied (a tenth of a record's cost).
            return orjson.dumps(fields).decode()
        return orjson.dumps(
            {
                "record": "answer",
                **{name: fields.get(name) for name in _ANSWER_FIELDS},
                "completions": [
                    {name: c.get(name) for name in _COMPLETION_FIELDS}
                    for c in fields["completions"]
                ],
                "echo": None,
                "embeddings": fields.get("embeddings"),
            }
        ).decode()
    except (orjson.JSONEncodeError, TypeError):
        return dump(Answer(**fields))


#: ``Answer``'s and ``CompletionRecord``'s fields in their order (``model_dump_json``'s).
_ANSWER_FIELDS = (
    "endpoint",
    "model",
    "created",
    "line_id",
    "request_id",
    "response_id",
    "prompt_tokens",
    "cached_tokens",
)
_COMPLETION_FIELDS = ("text", "finish_reason", "tokens", "stop_sequence", "logprobs")
#: Every key of an answer's record in ``model_dump_json``'s order.
_RECORD_KEYS = ("record", *_ANSWER_FIELDS, "completions", "echo", "embeddings")


def load(stored: str) -> Answer | Failure | None:
    """The record in ``stored``, or ``None`` when it holds an OpenAI line rendered before
    records existed. Raises ``pydantic.ValidationError`` for a damaged record."""
    if not stored.startswith(_MARK):
        return None
    return _RECORDS.validate_json(stored)
