"""``/v1/completions``: the body (``CompletionRequest``), its engine input (one prompt, as text
or token ids) and the ``text_completion`` body.

Shapes and limits follow OpenAI's API reference (Completions). A line takes one prompt: several
prompts in one line would be several answers in one output line, which a batch spreads over
lines instead.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from offpeak import wire
from offpeak.endpoints import fields
from offpeak.endpoints.base import Endpoint, EngineInput, Tokenizer, context_budget
from offpeak.endpoints.errors import fail
from offpeak.endpoints.records import Answer, CompletionRecord

#: OpenAI's default ``max_tokens`` for ``/v1/completions``.
DEFAULT_MAX_TOKENS = 16


def _one_prompt(prompt: Any) -> str | list[int]:
    """The line's prompt: a string or token ids (a list of one of either is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise fail(
            "unsupported_value",
            "Several prompts in one request line are not supported here; put each "
            "prompt on its own line.",
        )
    raise fail("invalid_type", "'prompt' must be a string or a list of token ids.")


class CompletionRequest(BaseModel):
    """A ``/v1/completions`` body. A line with several problems reports the first in field
    order."""

    model_config = fields.BODY_CONFIG

    model: str
    # Parameters that change what an answer means and that this server cannot honour.
    echo: Any = None
    suffix: Any = None
    prompt: Annotated[str | list[int], BeforeValidator(_one_prompt)] = Field(
        None, validate_default=True
    )
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    n: int | None = Field(None, ge=1, le=fields.MAX_N)
    best_of: int | None = Field(None, ge=1, le=fields.MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    stop: Annotated[tuple[str, ...], BeforeValidator(fields.stop_sequences)] = ()
    seed: Annotated[int | None, BeforeValidator(fields.int64_seed)] = Field(
        None, ge=fields.INT64[0], le=fields.INT64[1]
    )
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: Annotated[
        tuple[tuple[int, float], ...], BeforeValidator(fields.logit_bias_pairs)
    ] = ()

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return fields.unsupported(value, info)

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, value: float | None) -> float | None:
        return fields.positive_top_p(value)

    @model_validator(mode="after")
    def _together(self) -> CompletionRequest:
        fields.check_best_of(self.best_of, self.n)
        return self


class Completions(Endpoint[CompletionRequest]):
    url = "/v1/completions"
    body_model = CompletionRequest
    required_fields = ("prompt",)
    response_id_prefix = "cmpl-"

    def engine_input(self, body: CompletionRequest, tokenizer: Tokenizer) -> EngineInput:
        prompt = body.prompt
        prompt_ids = tokenizer.encode_text(prompt) if isinstance(prompt, str) else prompt
        max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        budget = context_budget(len(prompt_ids), max_tokens, tokenizer.max_model_len, "prompt")
        fields.check_logit_bias(body.logit_bias, tokenizer)
        return EngineInput(prompt_ids, fields.sampling(body, budget, body.logprobs))

    def render(self, answer: Answer) -> dict[str, Any]:
        """A ``text_completion`` body; each choice ``{text, index, logprobs, finish_reason}``."""
        return {
            "id": answer.response_id,
            "object": "text_completion",
            "created": answer.created,
            "model": answer.model,
            "choices": [
                {
                    "text": c.text,
                    "index": i,
                    "logprobs": _logprobs(c),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(answer.completions)
            ],
            "usage": wire.usage_object(
                answer.prompt_tokens, answer.completion_tokens, answer.cached_tokens
            ),
            "system_fingerprint": None,
        }


def _logprobs(completion: CompletionRecord) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    offsets, offset = [], 0
    for lp in completion.logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in completion.logprobs],
        "token_logprobs": [lp.logprob for lp in completion.logprobs],
        "top_logprobs": [dict(lp.top) for lp in completion.logprobs],
        "text_offset": offsets,
    }
