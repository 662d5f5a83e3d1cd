"""``/v1/messages``, Anthropic's Messages API as a batch endpoint: the ``params`` of a Message
Batches request (``MessageParams``), its engine input (the system prompt and the turns through
the model's chat template, an assistant prefill continued as is) and the Messages API object of
an answer (``render``), and the result line of each finished request (``result_line``).

Shapes, ranges and wording follow Anthropic's API reference (Messages, Message Batches): a
request's params are checked one by one when it runs, and a request this server cannot honour
(``stream``, server tools, image content, ``thinking`` …) ends ``errored`` with an
``invalid_request_error`` naming the parameter, while the rest of the batch runs. Messages are
worded as Anthropic's are: ``<param path>: <what is wrong>``. Client tools (``tools`` with an
``input_schema``, ``tool_choice``, ``tool_use`` / ``tool_result`` blocks) work as on chat lines
(``offpeak.endpoints.tools``), the calls answered as ``tool_use`` blocks.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from offpeak.endpoints import tools
from offpeak.endpoints.base import Endpoint, EngineInput, SamplingSpec, StructuredOutput, Tokenizer
from offpeak.endpoints.errors import LineError, fail
from offpeak.endpoints.records import Answer, Failure
from offpeak.endpoints.tools import Tool, ToolChoice

URL = "/v1/messages"


def on_surface(path: str) -> bool:
    """Whether an HTTP path is Anthropic's surface (``/v1/messages``, ``/v1/messages/…``),
    whose errors are rendered in Anthropic's shape (``error_body``)."""
    return path == URL or path.startswith(URL + "/")


#: Known Messages API parameters a batch here cannot honour: set, they fail the request alone.
UNSUPPORTED = ("stream", "thinking", "mcp_servers", "container")
#: Content blocks that carry a tool call (an assistant's) or its result (a user's).
TOOL_BLOCKS = {"tool_use": "assistant", "tool_result": "user"}


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


class ToolUseBlock(BaseModel):
    """An earlier call in an assistant turn: ``id``, ``name``, ``input`` (an object)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A call's result in a user turn: ``tool_use_id`` and its ``content`` (text)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["tool_result"]
    tool_use_id: str
    content: Text = ""
    is_error: bool | None = None


class MessageParam(BaseModel):
    """A turn: its text, and the ``tool_use`` (assistant) or ``tool_result`` (user) blocks
    taken out of its content list (``tool_blocks``)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    role: Literal["user", "assistant"]
    content: Text
    tool_blocks: list[ToolUseBlock | ToolResultBlock] = []

    @model_validator(mode="before")
    @classmethod
    def _split(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        if not isinstance(content, list):
            return data
        blocks = [b for b in content if isinstance(b, dict) and b.get("type") in TOOL_BLOCKS]
        for block in blocks:
            if data.get("role") != TOOL_BLOCKS[block["type"]]:
                raise fail(
                    "invalid_value",
                    f"{{param}}: {block['type']} blocks belong in "
                    f"{TOOL_BLOCKS[block['type']]} turns",
                )
        if not blocks:
            return data
        text = [b for b in content if not (isinstance(b, dict) and b.get("type") in TOOL_BLOCKS)]
        return {**data, "content": text, "tool_blocks": blocks}


def _anthropic_tools(value: Any) -> tuple[Tool, ...]:
    """``tools``: client tools, ``{name, description, input_schema}`` (``type`` absent or
    ``custom``). A server tool (``web_search_20250305``, ``code_execution_…``, ``bash_…``,
    ``text_editor_…``, ``computer_…`` …) needs the server to act and is refused."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise fail("invalid_type", "tools: Input should be a valid list", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise fail("invalid_type", f"tools.{i}: Input should be an object", f"tools.{i}")
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise fail(
                "unsupported_value",
                f"tools.{i}.type: server tool {kind!r} is not supported by this server; only "
                "client tools (name, description, input_schema) are",
                f"tools.{i}.type",
            )
        if "input_schema" not in tool:
            raise fail(
                "missing",
                f"tools.{i}.input_schema: Field required",
                f"tools.{i}.input_schema",
            )
        param = f"tools.{i}"
        try:
            out.append(
                tools.function_tool(
                    tool.get("name"),
                    tool.get("description"),
                    tool["input_schema"],
                    param,
                    schema_key="input_schema",
                )
            )
        except PydanticCustomError as exc:
            raise _anthropic_wording(exc) from None
    try:
        return tools.unique(out, "tools")
    except PydanticCustomError as exc:
        raise _anthropic_wording(exc) from None


def _anthropic_wording(exc: PydanticCustomError) -> PydanticCustomError:
    """A shared check's error (OpenAI's wording) in Anthropic's: ``<param>: <message>``."""
    context = exc.context or {}
    param = context.get("param") or "tools"
    return fail(exc.type, f"{param}: {context.get('message', exc.message())}", param)


def _anthropic_choice(value: Any) -> ToolChoice | None:
    """``tool_choice``: ``{"type": "auto" | "any" | "none"}`` or ``{"type": "tool", "name"}``,
    with ``disable_parallel_tool_use``; ``any`` is chat's ``required``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    modes = {"auto": "auto", "any": "required", "none": "none", "tool": "named"}
    if kind not in modes:
        raise fail(
            "invalid_value",
            "tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'",
            "tool_choice.type",
        )
    name = value.get("name")
    if kind == "tool" and not isinstance(name, str):
        raise fail("missing", "tool_choice.name: Field required", "tool_choice.name")
    parallel = value.get("disable_parallel_tool_use") is not True
    return ToolChoice(modes[kind], name if kind == "tool" else None, parallel)  # type: ignore[arg-type]


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
    #: The tool choice in force (``tool_choice``, else ``auto`` with tools and ``none``
    #: without) and the structured output forcing its call (``None``: not forced).
    _choice: ToolChoice = PrivateAttr(ToolChoice("none"))
    _forced: StructuredOutput | None = PrivateAttr(None)
    stream: Any = None
    tools: Annotated[tuple[Tool, ...], BeforeValidator(_anthropic_tools)] = ()
    tool_choice: Annotated[ToolChoice | None, BeforeValidator(_anthropic_choice)] = None
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
        # Anthropic's rule: every turn has text (or a tool block), except a final assistant
        # turn (a prefill).
        for i, message in enumerate(value):
            last_assistant = i == len(value) - 1 and message.role == "assistant"
            if not message.content and not message.tool_blocks and not last_assistant:
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

    @model_validator(mode="after")
    def _tool_choice(self) -> MessageParams:
        choice = self.tool_choice or ToolChoice("auto" if self.tools else "none")
        try:
            self._choice = tools.check_choice(choice, self.tools, "tool_choice")
            self._forced = tools.forced_schema(self.tools, self._choice, "tools")
        except PydanticCustomError as exc:
            raise _anthropic_wording(exc) from None
        return self


def turns(body: MessageParams) -> list[dict[str, Any]]:
    """Chat-template messages of ``body``: the system prompt first, then the turns, consecutive
    text turns of one role joined into one (Anthropic's rule), the text of each joined by a
    blank line. An assistant turn's ``tool_use`` blocks are its ``tool_calls``; a user turn's
    ``tool_result`` blocks are ``tool`` messages, before its text."""
    out: list[dict[str, Any]] = []
    if body.system:
        out.append({"role": "system", "content": body.system})
    for message in body.messages:
        for block in message.tool_blocks:
            if isinstance(block, ToolResultBlock):
                result = {"role": "tool", "tool_call_id": block.tool_use_id}
                out.append({**result, "content": block.content})
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
            for b in message.tool_blocks
            if isinstance(b, ToolUseBlock)
        ]
        if not message.content and (calls or message.tool_blocks):
            if calls:
                out.append({"role": message.role, "content": "", "tool_calls": calls})
            continue
        if out and out[-1]["role"] == message.role and "tool_calls" not in out[-1]:
            joined = out[-1]["content"] + "\n\n" + message.content
            out[-1] = {"role": message.role, "content": joined}
        else:
            out.append({"role": message.role, "content": message.content})
        if calls:
            out[-1] = {**out[-1], "tool_calls": calls}
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
        last = messages[-1]
        if len(messages) > 1 and last["role"] == "assistant" and "tool_calls" not in last:
            prefill = messages.pop()["content"]
            if prefill != prefill.rstrip():
                raise LineError(
                    "messages: final assistant content cannot end with trailing whitespace",
                    "messages",
                )
        choice = body._choice
        # ``none`` leaves the tools out, so the model is not prompted to call one.
        offered = [t.template_dict() for t in body.tools] if choice.mode != "none" else []
        try:
            prompt_ids = (
                tokenizer.encode_chat(messages, tools=offered)
                if offered
                else tokenizer.encode_chat(messages)
            )
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
            structured_output=body._forced,
        )
        if not offered:
            return EngineInput(prompt_ids, sampling)
        parser = getattr(tokenizer, "tool_parser", tools.DEFAULT_PARSER)
        echo = {"tool_calls": tools.echo(choice, body.tools, parser)}
        return EngineInput(prompt_ids, sampling, echo=echo)

    def render(self, answer: Answer) -> dict[str, Any]:
        """A Messages API ``message``: one ``text`` block, or, when the model called tools, a
        ``tool_use`` block per call (``id`` ``toolu_…``, ``name``, ``input``) after the text
        it wrote too, with ``stop_reason`` ``tool_use`` (``max_tokens`` when the calls kept
        were cut short); else ``stop_reason`` ``end_turn``,
        ``max_tokens`` or ``stop_sequence`` (with the matched ``stop_sequence``); ``usage`` in
        Anthropic's terms, where ``input_tokens`` leaves out the prompt tokens read from the
        prefix cache (``cache_read_input_tokens``)."""
        completion = answer.completions[0]
        text, calls = tools.calls(completion.text, (answer.echo or {}).get("tool_calls"))
        content: list[dict[str, Any]] = (
            [{"type": "text", "text": text}] if text or not calls else []
        )
        content += [
            {
                "type": "tool_use",
                "id": tools.call_id("toolu_", answer.response_id, 0, i),
                "name": call.name,
                "input": call.input(),
            }
            for i, call in enumerate(calls)
        ]
        if completion.finish_reason == "length":
            stop_reason, stop_sequence = "max_tokens", None
        elif completion.stop_sequence is not None:
            stop_reason, stop_sequence = "stop_sequence", completion.stop_sequence
        elif calls:
            stop_reason, stop_sequence = "tool_use", None
        else:
            stop_reason, stop_sequence = "end_turn", None
        return {
            "id": answer.response_id,
            "type": "message",
            "role": "assistant",
            "model": answer.model,
            "content": content,
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
