"""``/v1/messages``, Anthropic's Messages API as a batch endpoint: the ``params`` of a Message
Batches request (``MessageParams``), its engine input (the system prompt and the turns through
the model's chat template, an assistant prefill continued as is) and the Messages API object of
an answer (``render``), and the result line of each finished request (``result_line``).

Shapes, ranges and wording follow Anthropic's API reference (Messages, Message Batches): a
request's params are checked one by one when it runs, and a request this server cannot honour
(``stream``, ``tools``, image content, ``thinking`` …) ends ``errored`` with an
``invalid_request_error`` naming the parameter, while the rest of the batch runs. Messages are
worded as Anthropic's are: ``<param path>: <what is wrong>``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import ErrorDetails

from offpeak.endpoints.base import Endpoint, EngineInput, SamplingSpec, Tokenizer
from offpeak.endpoints.errors import LineError, fail
from offpeak.endpoints.records import Answer, Failure

URL = "/v1/messages"


def on_surface(path: str) -> bool:
    """Whether an HTTP path is Anthropic's surface (``/v1/messages``, ``/v1/messages/…``),
    whose errors are rendered in Anthropic's shape (``error_body``)."""
    return path == URL or path.startswith(URL + "/")


#: Known Messages API parameters a batch here cannot honour: set, they fail the request alone.
UNSUPPORTED = ("stream", "tools", "tool_choice", "thinking", "mcp_servers", "container")


def _text(content: Any, info: ValidationInfo) -> str:
    """A content value (a string, or a list of ``text`` blocks) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise fail("invalid_type", "{param}: Input should be a valid string or list of blocks")
    texts = []
    for block in content:
        if not isinstance(block, dict):
            raise fail("invalid_type", "{param}: each content block must be an object")
        if block.get("type") != "text":
            raise fail(
                "unsupported_content",
                f"{{param}}: {block.get('type')!r} content blocks are not supported by this "
                "server; only 'text' blocks are",
            )
        if not isinstance(block.get("text"), str):
            raise fail("invalid_type", "{param}: a text block needs a string 'text'")
        # cache_control and citations change nothing here: the prefix cache is automatic.
        texts.append(block["text"])
    return "\n\n".join(texts) if info.field_name == "system" else "".join(texts)


Text = Annotated[str, BeforeValidator(_text)]


class MessageParam(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["user", "assistant"]
    content: Text


class Metadata(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    user_id: str | None = Field(None, max_length=256)


class MessageParams(BaseModel):
    """A Message Batches request's ``params`` (the Messages API body, without streaming).
    Unknown parameters are refused, as Anthropic's API refuses them."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: Text | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    stream: Any = None
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    mcp_servers: Any = None
    container: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name
        if name == "thinking" and isinstance(value, dict) and value.get("type") == "disabled":
            return value
        if value not in (None, False, []):
            raise fail("unsupported_parameter", f"{name}: not supported by this server", name)
        return value

    @field_validator("messages")
    @classmethod
    def _non_empty(cls, value: list[MessageParam]) -> list[MessageParam]:
        # Anthropic's rule: every turn has text, except a final assistant turn (a prefill).
        for i, message in enumerate(value):
            last_assistant = i == len(value) - 1 and message.role == "assistant"
            if not message.content and not last_assistant:
                raise fail(
                    "invalid_value",
                    f"messages.{i}: all messages must have non-empty content except for the "
                    "optional final assistant message",
                    f"messages.{i}",
                )
        return value

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        for i, stop in enumerate(value or []):
            if not stop.strip():
                raise fail(
                    "invalid_value",
                    f"stop_sequences.{i}: each stop sequence must contain non-whitespace",
                    f"stop_sequences.{i}",
                )
        return value


def turns(body: MessageParams) -> list[dict[str, str]]:
    """Chat-template messages of ``body``: the system prompt first, then the turns, consecutive
    turns of one role joined into one (Anthropic's rule), the text of each joined by a blank
    line."""
    out: list[dict[str, str]] = []
    if body.system:
        out.append({"role": "system", "content": body.system})
    for message in body.messages:
        if out and out[-1]["role"] == message.role:
            joined = out[-1]["content"] + "\n\n" + message.content
            out[-1] = {"role": message.role, "content": joined}
        else:
            out.append({"role": message.role, "content": message.content})
    return out


def _check_window(prompt: int, max_tokens: int, limit: int) -> None:
    """Raises ``LineError`` in Anthropic's wording when the prompt, or the prompt plus
    ``max_tokens``, does not fit the context window of ``limit`` tokens."""
    if prompt >= limit:
        raise LineError(f"prompt is too long: {prompt} tokens > {limit - 1} maximum", "messages")
    if prompt + max_tokens > limit:
        raise LineError(
            f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > "
            f"{limit}, decrease input length or `max_tokens` and try again",
            "max_tokens",
        )


def _dotted(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc)


class AnthropicMessages(Endpoint[MessageParams]):
    url = URL
    body_model = MessageParams
    # Anthropic checks each request's params on its own: a missing one errors that request.
    required_fields = ()
    response_id_prefix = "msg_"
    refuses_file_for_body = False
    surface = "anthropic"
    #: Anthropic's limit (Message Batches, "Batch limitations").
    max_requests_per_batch = 100_000

    def line_error(self, error: ErrorDetails) -> LineError:
        """Anthropic's wording: ``<dotted param path>: <pydantic's message>`` (its API reports
        params errors so, e.g. ``max_tokens: Field required``)."""
        ctx = error.get("ctx") or {}
        where = _dotted(error["loc"]) or "body"
        if ctx.get("offpeak_line_error"):
            param = ctx.get("param") or where
            return LineError(str(ctx["message"]).replace("{param}", param), param, error["type"])
        return LineError(f"{where}: {error['msg']}", where, error["type"])

    def engine_input(self, body: MessageParams, tokenizer: Tokenizer) -> EngineInput:
        # An engine (``workers.engine.base.Engine``) names the model it serves; a tokenizer
        # without a name (the cost estimate's) checks nothing here.
        served = getattr(tokenizer, "model_name", body.model)
        if body.model != served:
            # Anthropic's answer for a model it does not have (404 ``not_found_error``).
            raise LineError(f"model: {body.model}", "model", "not_found_error", status_code=404)
        messages = turns(body)
        prefill = ""
        if len(messages) > 1 and messages[-1]["role"] == "assistant":
            prefill = messages.pop()["content"]
            if prefill != prefill.rstrip():
                raise LineError(
                    "messages: final assistant content cannot end with trailing whitespace",
                    "messages",
                )
        try:
            prompt_ids = tokenizer.encode_chat(messages)
        except ValueError as exc:
            raise LineError(f"messages: cannot be rendered: {exc}", "messages") from None
        if prefill:
            # The answer continues the assistant's text: its tokens follow the generation
            # prompt, without the BOS a tokenizer may put in front of any text.
            bos = tokenizer.encode_text("")
            ids = tokenizer.encode_text(prefill)
            prompt_ids += ids[len(bos) :] if ids[: len(bos)] == bos else ids
        _check_window(len(prompt_ids), body.max_tokens, tokenizer.max_model_len)
        sampling = SamplingSpec(
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            # A nucleus of mass 0 is the most likely token alone; vLLM wants top_p > 0.
            top_p=1.0 if body.top_p is None else max(float(body.top_p), 1e-9),
            top_k=body.top_k or 0,
            stop=tuple(body.stop_sequences or ()),
        )
        return EngineInput(prompt_ids, sampling)

    def render(self, answer: Answer) -> dict[str, Any]:
        """A Messages API ``message``: one ``text`` block; ``stop_reason`` ``end_turn``,
        ``max_tokens`` or ``stop_sequence`` (with the matched ``stop_sequence``); ``usage`` in
        Anthropic's terms, where ``input_tokens`` leaves out the prompt tokens read from the
        prefix cache (``cache_read_input_tokens``)."""
        completion = answer.completions[0]
        if completion.finish_reason == "length":
            stop_reason, stop_sequence = "max_tokens", None
        elif completion.stop_sequence is not None:
            stop_reason, stop_sequence = "stop_sequence", completion.stop_sequence
        else:
            stop_reason, stop_sequence = "end_turn", None
        return {
            "id": answer.response_id,
            "type": "message",
            "role": "assistant",
            "model": answer.model,
            "content": [{"type": "text", "text": completion.text}],
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": answer.prompt_tokens - answer.cached_tokens,
                "output_tokens": answer.completion_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": answer.cached_tokens,
            },
        }


#: Anthropic's error ``type`` of each HTTP status (API reference, "Errors").
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def error_type(status_code: int) -> str:
    """Anthropic's error ``type`` for an HTTP status: its own for the statuses it names, else
    ``invalid_request_error`` for a 4xx and ``api_error`` for a 5xx."""
    default = "api_error" if status_code >= 500 else "invalid_request_error"
    return ERROR_TYPES.get(status_code, default)


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's error body, ``{"type": "error", "error": {type, message}}``."""
    return {"type": "error", "error": {"type": error_type(status_code), "message": message}}


#: The ``result`` of a request that never ran, by its line status.
NEVER_RAN = {"cancelled": {"type": "canceled"}, "expired": {"type": "expired"}}


def result_line(custom_id: str, record: Answer | Failure | None, status: str) -> bytes:
    """One line of a Message Batch's results (JSON, no newline): ``{custom_id, result}`` with
    ``result`` ``{type: "succeeded", message}``, ``{type: "errored", error: {type: "error",
    error: {type, message}}}``, ``{type: "canceled"}`` or ``{type: "expired"}``. ``record`` is
    the line's stored record (``None`` for a request that never ran, whose line ``status`` is
    ``cancelled`` or ``expired``)."""
    if isinstance(record, Answer):
        result: dict[str, Any] = {"type": "succeeded", "message": ENDPOINT.render(record)}
    elif isinstance(record, Failure):
        result = {"type": "errored", "error": error_body(record.status_code, record.message)}
    elif status in NEVER_RAN:
        result = NEVER_RAN[status]
    else:  # a row without a record cannot be an Anthropic line; say so rather than guess
        result = {"type": "errored", "error": error_body(500, "The result was not recorded.")}
    return orjson.dumps({"custom_id": custom_id, "result": result})


ENDPOINT = AnthropicMessages()
