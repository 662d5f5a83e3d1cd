"""``/v1/responses``: OpenAI's Responses API as a batch endpoint — the body
(``ResponseRequest``), its engine input (``instructions`` and the ``input`` messages through the
model's chat template) and the ``response`` object of an answer.

Shapes follow OpenAI's API reference (Responses, "Create a model response" and "The response
object"). Function tools (``tools`` of type ``function``, ``tool_choice``, ``function_call`` and
``function_call_output`` input items) work as on chat lines (``offpeak.endpoints.tools``), the
calls answered as ``function_call`` output items. A batch line is one stateless turn, so what
needs state, the server to act or a stream fails its line alone with a 400 naming the
parameter: built-in tools (``web_search``, ``file_search`` …), ``previous_response_id``,
``conversation``, ``background``, ``prompt`` (a stored prompt),
``reasoning``, ``include``, ``top_logprobs``, ``truncation: "auto"``, ``context_management``,
``stream`` (unlike chat and completions lines, whose ``stream: true`` fails the whole
file with ``streaming_unsupported``, ``refuses_file_for_stream``). ``store``, ``user``,
``safety_identifier``, ``prompt_cache_key``, ``service_tier``, ``max_tool_calls`` and
``text.verbosity`` change nothing here and are accepted.
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

from offpeak.endpoints import fields, structured, tools
from offpeak.endpoints.base import (
    Endpoint,
    EngineInput,
    SamplingSpec,
    StructuredOutput,
    Tokenizer,
    context_budget,
)
from offpeak.endpoints.errors import LineError, fail
from offpeak.endpoints.records import Answer
from offpeak.endpoints.tools import Tool, ToolChoice

URL = "/v1/responses"
#: Input message roles, as the chat template names them (``developer`` is the newer ``system``).
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
#: Text content parts: ``input_text`` in what a user (or system) said, ``output_text`` in an
#: earlier assistant turn replayed as input.
TEXT_PARTS = ("input_text", "output_text")
#: OpenAI's metadata limits (API reference, "metadata"): 16 pairs, keys ≤ 64, values ≤ 512 chars.
MAX_METADATA = (16, 64, 512)
#: Request fields the response object repeats, kept in the line's record.
ECHOED = (
    "instructions",
    "metadata",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "parallel_tool_calls",
    "truncation",
    "user",
    "safety_identifier",
    "prompt_cache_key",
)


def _content(content: Any) -> str:
    """A message's content as one string: a string, or a list of text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise fail("invalid_type", "Invalid '{param}': expected a string or a list of parts.")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise fail(
                "unsupported_content",
                f"Invalid '{{param}}': {kind!r} content is not supported by this model; only "
                "text parts (input_text, output_text) are.",
            )
        if not isinstance(part.get("text"), str):
            raise fail("invalid_type", "Invalid '{param}': a text part needs a string 'text'.")
        texts.append(part["text"])
    return "".join(texts)


#: Input item types and the fields each needs (``_input`` checks they are there).
ITEMS = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
}


class InputItem(BaseModel):
    """One ``input`` item: a message with text content, an earlier ``function_call`` (its
    ``arguments`` JSON text of an object) or a ``function_call_output`` answering one (other
    keys, such as ``id`` or ``status`` of a replayed output item, are ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Annotated[str | None, BeforeValidator(_content)] = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Annotated[str | None, BeforeValidator(_content)] = None

    @field_validator("arguments")
    @classmethod
    def _object(cls, value: str | None) -> str | None:
        try:
            parsed = orjson.loads(value or "")
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise fail("invalid_value", "Invalid '{param}': expected JSON text of an object.")
        return value


def _input(value: Any) -> list[dict[str, Any]]:
    """``input``: a string (one user message) or a non-empty list of message items."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if value is None:
        raise fail("missing_required_parameter", "'input' is required.", "input")
    if not isinstance(value, list) or not value:
        raise fail(
            "invalid_type" if not isinstance(value, list) else "invalid_value",
            "'input' must be a string or a non-empty list of input items.",
            "input",
        )
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in ITEMS:
            raise fail(
                "unsupported_value",
                f"Invalid 'input[{i}]': only message (text), function_call and "
                f"function_call_output items are supported in a batch here, not {kind!r}.",
                f"input[{i}].type",
            )
        for key in ITEMS[kind]:
            if key not in item:
                raise fail(
                    "missing_required_parameter",
                    f"'input[{i}].{key}' is required.",
                    f"input[{i}].{key}",
                )
    return value


def _tools(value: Any) -> tuple[Tool, ...]:
    """``tools``: function tools, ``{"type": "function", name, description, parameters,
    strict}``. A built-in tool (``web_search``, ``file_search``, ``code_interpreter``,
    ``computer_use_preview``, ``mcp``, ``image_generation`` …) needs the server to act and is
    refused."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise fail("invalid_type", "Invalid type for 'tools': expected an array.", "tools")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise fail(
                "unsupported_value",
                f"Invalid 'tools[{i}]': the tool type {kind!r} needs the server to act, which "
                "a batch here does not; only 'function' tools are supported.",
                f"tools[{i}].type",
            )
        param = f"tools[{i}]"
        out.append(
            tools.function_tool(
                tool.get("name"), tool.get("description"), tool.get("parameters"), param
            )
        )
    return tools.unique(out, "tools")


def _tool_choice(value: Any) -> ToolChoice | None:
    """``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function", "name"}``;
    a choice of a built-in tool, ``allowed_tools``, ``mcp`` or ``custom`` is refused."""
    if value is None:
        return None
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    if not isinstance(value, dict) or value.get("type") != "function":
        raise fail(
            "unsupported_value",
            "Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
            '{"type": "function", "name": ...}; this server runs no built-in tools.',
            "tool_choice",
        )
    if not isinstance(value.get("name"), str):
        raise fail(
            "missing_required_parameter", "'tool_choice.name' is required.", "tool_choice.name"
        )
    return ToolChoice("named", value["name"])


def _metadata(value: Any) -> dict[str, str] | None:
    pairs, key_chars, value_chars = MAX_METADATA
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > pairs:
        raise fail(
            "invalid_value", f"'metadata' must be an object of at most {pairs} pairs.", "metadata"
        )
    for key, item in value.items():
        if len(key) > key_chars or not isinstance(item, str) or len(item) > value_chars:
            raise fail(
                "invalid_value",
                f"Invalid 'metadata': keys are at most {key_chars} characters and values "
                f"strings of at most {value_chars}.",
                "metadata",
            )
    return value


class ResponseRequest(BaseModel):
    """A ``/v1/responses`` body. A line with several problems reports the first in field order:
    the parameters a batch cannot honour first."""

    model_config = fields.BODY_CONFIG

    model: str
    # Set, these need state or a stream, which a batch line does not have.
    stream: Any = None
    tools: Annotated[tuple[Tool, ...], BeforeValidator(_tools)] = ()
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    tool_choice: Annotated[ToolChoice | None, BeforeValidator(_tool_choice)] = None
    truncation: Literal["auto", "disabled"] | None = None
    input: Annotated[list[InputItem], BeforeValidator(_input)] = Field(None, validate_default=True)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    text: dict[str, Any] | None = None
    metadata: Annotated[dict[str, str] | None, BeforeValidator(_metadata)] = None
    parallel_tool_calls: bool | None = None
    # Accepted and echoed; they change nothing in a batch here.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    _format: StructuredOutput | None = PrivateAttr(None)
    #: The tool choice in force (``tool_choice``, else ``auto`` with tools and ``none``
    #: without) and the structured output forcing its call (``None``: not forced).
    _choice: ToolChoice = PrivateAttr(ToolChoice("none"))
    _forced: StructuredOutput | None = PrivateAttr(None)

    @field_validator(
        "stream",
        "previous_response_id",
        "conversation",
        "background",
        "prompt",
        "reasoning",
        "include",
        "top_logprobs",
        "context_management",
    )
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return fields.unsupported(value, info)

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, value: str | None) -> str | None:
        if value == "auto":
            raise fail(
                "unsupported_value",
                "'truncation' 'auto' is not supported: an input over the context window fails.",
                "truncation",
            )
        return value

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        return fields.positive_top_p(value)

    @model_validator(mode="after")
    def _text_format(self) -> ResponseRequest:
        if self.text is not None:
            self._format = structured.responses_format(self.text.get("format"))
        choice = self.tool_choice or ToolChoice("auto" if self.tools else "none")
        choice = ToolChoice(choice.mode, choice.name, self.parallel_tool_calls is not False)
        self._choice = tools.check_choice(choice, self.tools, "tool_choice")
        self._forced = tools.forced_schema(self.tools, self._choice, "tools")
        if self._forced is not None and self._format is not None:
            raise fail(
                "invalid_value",
                "'text.format' cannot be set with a 'tool_choice' that forces a call.",
                "text.format",
            )
        return self


def _messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """Chat-template messages of ``input``: a ``function_call`` joins the assistant turn
    before it (or starts one), a ``function_call_output`` is a ``tool`` message."""
    out: list[dict[str, Any]] = []
    for item in items:
        if item.type == "message":
            out.append({"role": ROLES[item.role or "user"], "content": item.content or ""})
        elif item.type == "function_call":
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": orjson.loads(item.arguments or "{}")},
            }
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": ""})
            out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


class Responses(Endpoint[ResponseRequest]):
    url = URL
    body_model = ResponseRequest
    required_fields = ("input",)
    response_id_prefix = "resp_"
    refuses_file_for_stream = False

    def engine_input(self, body: ResponseRequest, tokenizer: Tokenizer) -> EngineInput:
        messages = _messages(body.input)
        if body.instructions:
            messages.insert(0, {"role": "system", "content": body.instructions})
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
            raise LineError(f"The input could not be rendered: {exc}", "input") from None
        budget = context_budget(
            len(prompt_ids), body.max_output_tokens, tokenizer.max_model_len, "input"
        )
        sampling = SamplingSpec(
            max_tokens=budget,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            structured_output=body._forced or body._format,
        )
        echo = {name: getattr(body, name) for name in ECHOED if getattr(body, name) is not None}
        if body.tools:
            echo["tools"] = [_tool_object(t) for t in body.tools]
        if body.tool_choice is not None:
            named = {"type": "function", "name": choice.name}
            echo["tool_choice"] = named if choice.mode == "named" else choice.mode
        if offered:
            parser = getattr(tokenizer, "tool_parser", tools.DEFAULT_PARSER)
            echo["tool_calls"] = tools.echo(choice, body.tools, parser)
        return EngineInput(prompt_ids, sampling, echo=echo)

    def render(self, answer: Answer) -> dict[str, Any]:
        """A ``response`` object: one assistant ``message`` holding one ``output_text``, or,
        when the model called tools, one ``function_call`` item per call (``call_id``,
        ``name``, ``arguments``, ``status``) after the message of any text it wrote too;
        ``status`` ``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) when
        the token budget ran out, else ``completed``."""
        echo = answer.echo or {}
        completion = answer.completions[0]
        content, calls = tools.calls(completion.text, echo.get("tool_calls"))
        complete = completion.finish_reason != "length"
        status = "completed" if complete else "incomplete"
        text = {"format": {"type": "text"}, "verbosity": "medium", **echo.get("text", {})}
        return {
            "id": answer.response_id,
            "object": "response",
            "created_at": answer.created,
            "status": status,
            "background": False,
            "completed_at": answer.created if complete else None,
            "error": None,
            "incomplete_details": None if complete else {"reason": "max_output_tokens"},
            "instructions": echo.get("instructions"),
            "max_output_tokens": echo.get("max_output_tokens"),
            "max_tool_calls": None,
            "model": answer.model,
            "output": self._output(answer.response_id, status, content, calls),
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "previous_response_id": None,
            "prompt_cache_key": echo.get("prompt_cache_key"),
            "reasoning": {"effort": None, "summary": None},
            "safety_identifier": echo.get("safety_identifier"),
            "service_tier": "default",
            "store": False,
            "temperature": echo.get("temperature", 1.0),
            "text": text,
            "tool_choice": echo.get("tool_choice", "auto"),
            "tools": echo.get("tools", []),
            "top_logprobs": 0,
            "top_p": echo.get("top_p", 1.0),
            "truncation": echo.get("truncation", "disabled"),
            "usage": {
                "input_tokens": answer.prompt_tokens,
                # The prefix cache fills itself at no charge: no cache writes are counted.
                "input_tokens_details": {
                    "cached_tokens": answer.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": answer.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": answer.prompt_tokens + answer.completion_tokens,
            },
            "user": echo.get("user"),
            "metadata": echo.get("metadata", {}),
        }

    def _output(
        self, response_id: str, status: str, content: str | None, calls: list[tools.Call]
    ) -> list[dict[str, Any]]:
        # Ids derived, not drawn: writing the files again writes the same bytes.
        suffix = response_id.removeprefix(self.response_id_prefix)
        output: list[dict[str, Any]] = []
        if content is not None or not calls:
            part = {"type": "output_text", "text": content or "", "annotations": [], "logprobs": []}
            output.append(
                {
                    "type": "message",
                    "id": "msg_" + suffix,
                    "status": status,
                    "role": "assistant",
                    "content": [part],
                }
            )
        for i, call in enumerate(calls):
            output.append(
                {
                    "type": "function_call",
                    "id": tools.call_id("fc_", response_id, 0, i),
                    "call_id": tools.call_id("call_", response_id, 0, i),
                    "name": call.name,
                    "arguments": call.arguments,
                    "status": "completed",
                }
            )
        return output


def _tool_object(tool: Tool) -> dict[str, Any]:
    """A function tool as the response object repeats it."""
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": None,
    }
