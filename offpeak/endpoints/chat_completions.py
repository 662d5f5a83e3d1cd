"""``/v1/chat/completions``: the body (``ChatCompletionRequest``), its engine input (the
messages through the model's chat template) and the ``chat.completion`` body.

Shapes and limits follow OpenAI's API reference (Chat Completions); a body this server cannot
honour fails its line with the 400 OpenAI's real-time endpoint would have returned.
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
from pydantic_core import ErrorDetails

from offpeak import wire
from offpeak.endpoints import fields, structured, tools
from offpeak.endpoints.base import (
    Endpoint,
    EngineInput,
    LineError,
    StructuredOutput,
    Tokenizer,
    context_budget,
)
from offpeak.endpoints.errors import fail
from offpeak.endpoints.records import Answer, CompletionRecord
from offpeak.endpoints.tools import Tool, ToolChoice

#: Chat roles a template understands; OpenAI's ``developer`` is the newer name of ``system``.
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def _text_content(content: Any) -> str:
    """A message's content as one string: a string, null, or a list of text parts joined."""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise fail(
                    "unsupported_content", "Only text content parts are supported by this model."
                )
            if not isinstance(part.get("text"), str):
                raise fail("invalid_type", "Invalid '{param}': a text part needs a string 'text'.")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        return ""
    if not isinstance(content, str):
        raise fail("invalid_type", "Invalid '{param}': expected a string.")
    return content


class CalledFunction(BaseModel):
    """An earlier call's function: its ``name`` and ``arguments``, JSON text of an object."""

    model_config = ConfigDict(strict=True, extra="ignore")

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _object(cls, value: str) -> str:
        try:
            parsed = orjson.loads(value)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise fail("invalid_value", "Invalid '{param}': expected JSON text of an object.")
        return value


class ToolCall(BaseModel):
    """A call an assistant turn made (``message.tool_calls[]`` replayed as history)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    """A message with text content; an assistant's may carry ``tool_calls`` and a ``tool``
    message answers one (``tool_call_id``). Other keys (``name`` …) are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, BeforeValidator(_text_content)] = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise fail(
                "invalid_value", "Invalid '{param}': only assistant messages carry 'tool_calls'."
            )
        if self.role == "tool" and self.tool_call_id is None:
            raise fail(
                "missing_required_parameter",
                "Invalid '{param}': a 'tool' message needs 'tool_call_id'.",
            )
        return self

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it: ``arguments`` as objects (Hugging Face's
        convention, which vLLM follows too)."""
        message: dict[str, Any] = {"role": ROLES[self.role], "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": orjson.loads(c.function.arguments),
                    },
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _chat_tools(value: Any) -> tuple[Tool, ...]:
    """``tools``: a list of ``{"type": "function", "function": {name, description,
    parameters, strict}}`` (OpenAI's chat shape; ``strict`` changes nothing, a forced call is
    always decoded to the schema)."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise fail("invalid_type", "Invalid type for 'tools': expected an array.", "tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise fail(
                "unsupported_value",
                f"Invalid 'tools[{i}]': only tools of type 'function' are supported.",
                f"tools[{i}].type",
            )
        spec = tool.get("function")
        if not isinstance(spec, dict):
            raise fail(
                "missing_required_parameter",
                f"'tools[{i}].function' must be an object with a 'name'.",
                f"tools[{i}].function",
            )
        param = f"tools[{i}].function"
        out.append(
            tools.function_tool(
                spec.get("name"), spec.get("description"), spec.get("parameters"), param
            )
        )
    return tools.unique(out, "tools")


def _chat_choice(value: Any) -> ToolChoice | None:
    """``tool_choice``: ``none``, ``auto``, ``required`` or ``{"type": "function",
    "function": {"name"}}``; ``None`` when not set."""
    if value is None:
        return None
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict) or value.get("type") != "function":
        raise fail(
            "invalid_value",
            "Invalid 'tool_choice': expected 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}.',
            "tool_choice",
        )
    if not isinstance(function.get("name"), str):
        raise fail(
            "missing_required_parameter",
            "'tool_choice.function.name' is required.",
            "tool_choice.function.name",
        )
    return ToolChoice("named", function["name"])


class ChatCompletionRequest(BaseModel):
    """A ``/v1/chat/completions`` body. A line with several problems reports the first in field
    order."""

    model_config = fields.BODY_CONFIG

    model: str
    tools: Annotated[tuple[Tool, ...], BeforeValidator(_chat_tools)] = ()
    tool_choice: Annotated[ToolChoice | None, BeforeValidator(_chat_choice)] = None
    parallel_tool_calls: bool | None = None
    # Parameters that change what an answer means and that this server cannot honour
    # (``functions`` and ``function_call``: the deprecated form of ``tools``).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    #: ``None`` for text; JSON mode or a JSON Schema (``offpeak.endpoints.structured``).
    response_format: Annotated[StructuredOutput | None, BeforeValidator(structured.chat_format)] = (
        None
    )
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    n: int | None = Field(None, ge=1, le=fields.MAX_N)
    best_of: int | None = Field(None, ge=1, le=fields.MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    stop: Annotated[tuple[str, ...], BeforeValidator(fields.stop_sequences)] = ()
    modalities: Annotated[list[str] | None, BeforeValidator(fields.text_modalities)] = None
    seed: Annotated[int | None, BeforeValidator(fields.int64_seed)] = Field(
        None, ge=fields.INT64[0], le=fields.INT64[1]
    )
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: Annotated[
        tuple[tuple[int, float], ...], BeforeValidator(fields.logit_bias_pairs)
    ] = ()

    #: The tool choice in force (``tool_choice``, else ``auto`` with tools and ``none``
    #: without) and the structured output forcing its call (``None``: not forced).
    _choice: ToolChoice = PrivateAttr(ToolChoice("none"))
    _forced: StructuredOutput | None = PrivateAttr(None)

    @field_validator("functions", "function_call", "audio", "prediction")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return fields.unsupported(value, info)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        return fields.positive_top_p(value)

    @model_validator(mode="after")
    def _together(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.logprobs is not True:
            raise fail(
                "invalid_value", "'top_logprobs' requires 'logprobs' to be true.", "top_logprobs"
            )
        fields.check_best_of(self.best_of, self.n)
        choice = self.tool_choice or ToolChoice("auto" if self.tools else "none")
        choice = ToolChoice(choice.mode, choice.name, self.parallel_tool_calls is not False)
        self._choice = tools.check_choice(choice, self.tools, "tool_choice")
        self._forced = tools.forced_schema(self.tools, self._choice, "tools")
        if self._forced is not None and self.response_format is not None:
            raise fail(
                "invalid_value",
                "'response_format' cannot be set with a 'tool_choice' that forces a call.",
                "response_format",
            )
        return self


class ChatCompletions(Endpoint[ChatCompletionRequest]):
    url = "/v1/chat/completions"
    body_model = ChatCompletionRequest
    required_fields = ("messages",)
    response_id_prefix = "chatcmpl-"

    def line_error(self, error: ErrorDetails) -> LineError:
        loc = error["loc"]
        ours = (error.get("ctx") or {}).get("offpeak_line_error")
        if loc and loc[0] == "messages" and not ours:
            if len(loc) == 1:
                return LineError(
                    "'messages' must be a non-empty list.", "messages", "invalid_value"
                )
            if len(loc) == 2 or loc[2] == "role":  # not an object, or no known role
                return LineError(
                    f"Invalid 'messages[{loc[1]}]': each message needs a role "
                    f"({', '.join(ROLES)}).",
                    f"messages[{loc[1]}].role",
                    "invalid_value",
                )
        return super().line_error(error)

    def engine_input(self, body: ChatCompletionRequest, tokenizer: Tokenizer) -> EngineInput:
        messages = [m.template_message() for m in body.messages]
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
            raise LineError(f"The messages could not be rendered: {exc}", "messages") from None
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        budget = context_budget(len(prompt_ids), max_tokens, tokenizer.max_model_len, "messages")
        fields.check_logit_bias(body.logit_bias, tokenizer)
        logprobs = (body.top_logprobs or 0) if body.logprobs is True else None
        sampling = fields.sampling(body, budget, logprobs, body._forced or body.response_format)
        if not offered:
            return EngineInput(prompt_ids, sampling)
        parser = getattr(tokenizer, "tool_parser", tools.DEFAULT_PARSER)
        return EngineInput(
            prompt_ids, sampling, echo={"tool_calls": tools.echo(choice, body.tools, parser)}
        )

    def render(self, answer: Answer) -> dict[str, Any]:
        """A ``chat.completion`` body; each choice ``{index, message, logprobs, finish_reason}``.
        A completion that called tools has ``message.tool_calls`` (``content`` null when it said
        nothing else) and ``finish_reason`` ``tool_calls`` (``length`` when it was cut at
        ``max_tokens`` after some complete calls)."""
        kept = (answer.echo or {}).get("tool_calls")
        return {
            "id": answer.response_id,
            "object": "chat.completion",
            "created": answer.created,
            "model": answer.model,
            "choices": [
                _choice(answer.response_id, i, c, kept) for i, c in enumerate(answer.completions)
            ],
            "usage": wire.usage_object(
                answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens
            ),
            "system_fingerprint": None,
            "service_tier": "default",
        }


def _choice(
    response_id: str, index: int, completion: CompletionRecord, kept: dict[str, Any] | None
) -> dict[str, Any]:
    content, calls = tools.calls(completion.text, kept)
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if calls:
        message["tool_calls"] = [
            {
                "id": tools.call_id("call_", response_id, index, j),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for j, call in enumerate(calls)
        ]
    return {
        "index": index,
        "message": message,
        "logprobs": _logprobs(completion),
        # Calls kept from a completion cut at ``max_tokens`` still say it was cut.
        "finish_reason": (
            "tool_calls"
            if calls and completion.finish_reason != "length"
            else completion.finish_reason
        ),
    }


def _logprobs(completion: CompletionRecord) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token.encode()),
                "top_logprobs": [
                    {"token": token, "logprob": logprob, "bytes": list(token.encode())}
                    for token, logprob in lp.top
                ],
            }
            for lp in completion.logprobs
        ],
        "refusal": None,
    }
