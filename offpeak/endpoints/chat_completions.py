"""``/v1/chat/completions``: the body (``ChatCompletionRequest``), its engine input (the
messages through the model's chat template) and the ``chat.completion`` body.

Shapes and limits follow OpenAI's API reference (Chat Completions); a body this server cannot
honour fails its line with the 400 OpenAI's real-time endpoint would have returned.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from offpeak import wire
from offpeak.endpoints import fields, structured
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


class ChatMessage(BaseModel):
    """A message with text content; other keys (``name``, ``tool_calls`` …) are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, BeforeValidator(_text_content)] = ""


class ChatCompletionRequest(BaseModel):
    """A ``/v1/chat/completions`` body. A line with several problems reports the first in field
    order."""

    model_config = fields.BODY_CONFIG

    model: str
    # Parameters that change what an answer means and that this server cannot honour.
    tools: Any = None
    functions: Any = None
    logit_bias: Any = None
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

    @field_validator("tools", "functions", "logit_bias", "audio", "prediction")
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
        return self


class ChatCompletions(Endpoint[ChatCompletionRequest]):
    url = "/v1/chat/completions"
    body_model = ChatCompletionRequest
    required_fields = ("messages",)
    response_id_prefix = "chatcmpl-"

    def line_error(self, error: ErrorDetails) -> LineError:
        loc = error["loc"]
        if loc and loc[0] == "messages":
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
        messages = [{"role": ROLES[m.role], "content": m.content} for m in body.messages]
        try:
            prompt_ids = tokenizer.encode_chat(messages)
        except ValueError as exc:
            raise LineError(f"The messages could not be rendered: {exc}", "messages") from None
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        budget = context_budget(len(prompt_ids), max_tokens, tokenizer.max_model_len, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs is True else None
        sampling = fields.sampling(body, budget, logprobs, body.response_format)
        return EngineInput(prompt_ids, sampling)

    def render(self, answer: Answer) -> dict[str, Any]:
        """A ``chat.completion`` body; each choice ``{index, message, logprobs, finish_reason}``."""
        return {
            "id": answer.response_id,
            "object": "chat.completion",
            "created": answer.created,
            "model": answer.model,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text, "refusal": None},
                    "logprobs": _logprobs(c),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(answer.completions)
            ],
            "usage": wire.usage_object(
                answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens
            ),
            "system_fingerprint": None,
            "service_tier": "default",
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
