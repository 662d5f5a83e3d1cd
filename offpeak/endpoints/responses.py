"""``/v1/responses``: OpenAI's Responses API as a batch endpoint — the body
(``ResponseRequest``), its engine input (``instructions`` and the ``input`` messages through the
model's chat template) and the ``response`` object of an answer.

Shapes follow OpenAI's API reference (Responses, "Create a model response" and "The response
object"). A batch line is one stateless text turn, so what needs state, tools or a stream fails
its line alone with a 400 naming the parameter: ``tools`` (and a ``tool_choice`` that would call
one), ``previous_response_id``, ``conversation``, ``background``, ``prompt`` (a stored prompt),
``reasoning``, ``include``, ``top_logprobs``, ``truncation: "auto"``, ``context_management``,
``stream`` (unlike chat and completions lines, whose ``stream: true`` fails the whole
file with ``streaming_unsupported``, ``refuses_file_for_stream``). ``store``, ``user``,
``safety_identifier``, ``prompt_cache_key``, ``service_tier``, ``parallel_tool_calls``,
``max_tool_calls`` and ``text.verbosity`` change nothing here and are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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

from offpeak.endpoints import fields, structured
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
    "tool_choice",
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


class InputMessage(BaseModel):
    """One ``input`` item: a message with text content (other keys, such as ``id`` or
    ``status`` of a replayed output message, are ignored)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[str, BeforeValidator(_content)]


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
        if kind != "message":
            raise fail(
                "unsupported_value",
                f"Invalid 'input[{i}]': only message items with text content are supported in a "
                f"batch here, not {kind!r}.",
                f"input[{i}].type",
            )
    return value


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
    # Set, these need state, tools or a stream, which a batch line does not have.
    stream: Any = None
    tools: Any = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    reasoning: Any = None
    include: Any = None
    top_logprobs: Any = None
    context_management: Any = None
    tool_choice: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    input: Annotated[list[InputMessage], BeforeValidator(_input)] = Field(
        None, validate_default=True
    )
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    text: dict[str, Any] | None = None
    metadata: Annotated[dict[str, str] | None, BeforeValidator(_metadata)] = None
    # Accepted and echoed; they change nothing in a batch here.
    parallel_tool_calls: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    _format: StructuredOutput | None = PrivateAttr(None)

    @field_validator(
        "stream",
        "tools",
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

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_call(cls, value: Any) -> Any:
        # "auto" and "none" with no tools both mean: answer in text.
        if value not in (None, "auto", "none"):
            raise fail(
                "unsupported_value",
                "'tool_choice' other than 'auto' or 'none' is not supported: this server runs "
                "no tools.",
                "tool_choice",
            )
        return value

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
        return self


class Responses(Endpoint[ResponseRequest]):
    url = URL
    body_model = ResponseRequest
    required_fields = ("input",)
    response_id_prefix = "resp_"
    refuses_file_for_stream = False

    def engine_input(self, body: ResponseRequest, tokenizer: Tokenizer) -> EngineInput:
        messages = [{"role": ROLES[m.role], "content": m.content} for m in body.input]
        if body.instructions:
            messages.insert(0, {"role": "system", "content": body.instructions})
        try:
            prompt_ids = tokenizer.encode_chat(messages)
        except ValueError as exc:
            raise LineError(f"The input could not be rendered: {exc}", "input") from None
        budget = context_budget(
            len(prompt_ids), body.max_output_tokens, tokenizer.max_model_len, "input"
        )
        sampling = SamplingSpec(
            max_tokens=budget,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            structured_output=body._format,
        )
        echo = {name: getattr(body, name) for name in ECHOED if getattr(body, name) is not None}
        return EngineInput(prompt_ids, sampling, echo=echo)

    def render(self, answer: Answer) -> dict[str, Any]:
        """A ``response`` object: one assistant ``message`` holding one ``output_text``;
        ``status`` ``incomplete`` (``incomplete_details.reason`` ``max_output_tokens``) when
        the token budget ran out, else ``completed``."""
        echo = answer.echo or {}
        completion = answer.completions[0]
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
            "output": [
                {
                    "type": "message",
                    # Derived, not drawn: writing the files again writes the same bytes.
                    "id": "msg_" + answer.response_id.removeprefix(self.response_id_prefix),
                    "status": status,
                    "role": "assistant",
                    "content": [
                        {
                            "type": "output_text",
                            "text": completion.text,
                            "annotations": [],
                            "logprobs": [],
                        }
                    ],
                }
            ],
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
            "tools": [],
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
