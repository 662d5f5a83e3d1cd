"""From a request line's body to an engine request, and from an engine result to the endpoint's
response body: the server side of ``/v1/chat/completions`` and ``/v1/completions``.

Checks here are the ones only the engine side can make (the prompt's length in tokens) or that
OpenAI makes per request (sampling ranges); a failure fails that request line alone, with the
400 body OpenAI's real-time endpoint would have returned. Ranges follow OpenAI's API reference
(Chat Completions / Completions, "Request body").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from offpeak import wire
from workers.engine.base import Completion, Engine, EngineRequest, EngineResult, SamplingSpec

#: Chat roles a template understands; OpenAI's ``developer`` is the newer name of ``system``.
_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
#: Body fields that change what an answer means and that this server cannot honour: refusing
#: the line is better than silently answering something else.
_UNSUPPORTED_CHAT = ("tools", "functions", "logit_bias", "audio", "prediction")
_UNSUPPORTED_COMPLETION = ("logit_bias",)
MAX_N = 128
MAX_STOP = 4


class LineError(Exception):
    """A request line that fails alone: a ``status_code`` line in the error file.

    A 4xx is the line's own fault (``invalid_request_error``, OpenAI's type for a request the
    endpoint rejects); a 5xx is the server's (``server_error``, the type OpenAI's API gives its
    own failures), so a client can tell which lines are worth sending again.
    """

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status_code: int = 400,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status_code = message, param, code, status_code

    def body(self) -> dict[str, Any]:
        kind = "server_error" if self.status_code >= 500 else "invalid_request_error"
        return wire.error_object(self.message, kind, self.param, self.code)


@dataclass
class Prepared:
    """An engine request plus what is needed to answer it."""

    request: EngineRequest
    endpoint: str
    model: str
    #: Chat: ``top_logprobs`` asked for (None: no logprobs). Completions: the ``logprobs`` int.
    logprobs: int | None


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LineError(f"Invalid type for '{name}': expected a number.", name, "invalid_type")
    if not low <= value <= high:
        raise LineError(
            f"Invalid '{name}': {value} is not between {low:g} and {high:g}.", name, "invalid_value"
        )
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise LineError(f"Invalid type for '{name}': expected an integer.", name, "invalid_type")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise LineError(f"Invalid '{name}': {value} must be {bound}.", name, "invalid_value")
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise LineError(
            "Invalid 'stop': expected a string or a list of strings.", "stop", "invalid_type"
        )
    if len(stops) > MAX_STOP:
        raise LineError(f"Invalid 'stop': at most {MAX_STOP} sequences.", "stop", "invalid_value")
    return tuple(s for s in stops if s)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LineError("'messages' must be a non-empty list.", "messages", "invalid_value")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in _ROLES:
            raise LineError(
                f"Invalid 'messages[{i}]': each message needs a role ({', '.join(_ROLES)}).",
                f"messages[{i}].role",
                "invalid_value",
            )
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise LineError(
                        "Only text content parts are supported by this model.",
                        f"messages[{i}].content",
                        "unsupported_content",
                    )
                if not isinstance(part.get("text"), str):
                    raise LineError(
                        f"Invalid 'messages[{i}].content': a text part needs a string 'text'.",
                        f"messages[{i}].content",
                        "invalid_type",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise LineError(
                f"Invalid 'messages[{i}].content': expected a string.",
                f"messages[{i}].content",
                "invalid_type",
            )
        out.append({"role": _ROLES[role], "content": content})
    return out


def _completion_prompt(body: dict[str, Any], engine: Engine) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return engine.encode_text(prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise LineError(
            "Several prompts in one request line are not supported here; put each "
            "prompt on its own line.",
            "prompt",
            "unsupported_value",
        )
    raise LineError("'prompt' must be a string or a list of token ids.", "prompt", "invalid_type")


def _context_check(prompt_len: int, max_tokens: int | None, engine: Engine, param: str) -> int:
    """The completion budget in tokens; raises ``LineError`` when the context cannot hold it.
    Message wording follows OpenAI's ``context_length_exceeded`` error."""
    limit = engine.max_model_len
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


def prepare(
    request_id: str, endpoint: str, body: dict[str, Any], engine: Engine, priority: int = 0
) -> Prepared:
    """Turn a validated line's ``body`` into an engine request. Raises ``LineError``."""
    chat = endpoint == wire.CHAT_COMPLETIONS
    for name in _UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION:
        if body.get(name):
            raise LineError(
                f"'{name}' is not supported by this server.", name, "unsupported_parameter"
            )
    if chat:
        response_format = body.get("response_format")
        if response_format not in (None, {"type": "text"}):
            raise LineError(
                "Only response_format {'type': 'text'} is supported.",
                "response_format",
                "unsupported_value",
            )
        try:
            prompt_ids = engine.encode_chat(_messages(body))
        except ValueError as exc:
            raise LineError(f"The messages could not be rendered: {exc}", "messages") from None
        max_tokens = _integer(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _integer(body, "max_tokens", 1)
        if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
            raise LineError(
                "Invalid type for 'logprobs': expected a boolean.", "logprobs", "invalid_type"
            )
        top_logprobs = _integer(body, "top_logprobs", 0, 20)
        if top_logprobs is not None and body.get("logprobs") is not True:
            raise LineError(
                "'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value"
            )
        logprobs = (top_logprobs or 0) if body.get("logprobs") is True else None
    else:
        for name in ("echo", "suffix"):
            if body.get(name):
                raise LineError(
                    f"'{name}' is not supported by this server.", name, "unsupported_parameter"
                )
        prompt_ids = _completion_prompt(body, engine)
        max_tokens = _integer(body, "max_tokens", 1)
        if max_tokens is None:
            max_tokens = 16  # OpenAI's default for /v1/completions
        logprobs = _integer(body, "logprobs", 0, 5)
    n = _integer(body, "n", 1, MAX_N) or 1
    best_of = _integer(body, "best_of", 1, MAX_N)
    if best_of not in (None, n):
        raise LineError("'best_of' other than n is not supported.", "best_of", "unsupported_value")
    budget = _context_check(len(prompt_ids), max_tokens, engine, "messages" if chat else "prompt")
    sampling = SamplingSpec(
        max_tokens=budget,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        n=n,
        stop=_stop(body),
        seed=_integer(body, "seed", -(2**63), 2**63 - 1),
        logprobs=logprobs,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
    )
    if sampling.top_p == 0.0:
        raise LineError("Invalid 'top_p': must be greater than 0.", "top_p", "invalid_value")
    request = EngineRequest(request_id, prompt_ids, sampling, priority)
    return Prepared(request, endpoint, str(body.get("model")), logprobs)


def _chat_logprobs(completion: Completion) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token.encode()),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                    for t in lp.top
                ],
            }
            for lp in completion.logprobs
        ],
        "refusal": None,
    }


def _completion_logprobs(completion: Completion) -> dict[str, Any] | None:
    if completion.logprobs is None:
        return None
    offsets, offset = [], 0
    for lp in completion.logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in completion.logprobs],
        "token_logprobs": [lp.logprob for lp in completion.logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in completion.logprobs],
        "text_offset": offsets,
    }


def response_body(prepared: Prepared, result: EngineResult, created: int) -> dict[str, Any]:
    """The full ``chat.completion`` or ``text_completion`` body, ``usage`` included."""
    completion_tokens = sum(len(c.token_ids) for c in result.completions)
    usage = wire.usage_object(result.prompt_tokens, completion_tokens, result.cached_tokens)
    if prepared.endpoint == wire.CHAT_COMPLETIONS:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text, "refusal": None},
                "logprobs": _chat_logprobs(c),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(result.completions)
        ]
        return wire.chat_completion(prepared.model, created, choices, usage)
    choices = [
        {
            "text": c.text,
            "index": i,
            "logprobs": _completion_logprobs(c),
            "finish_reason": c.finish_reason,
        }
        for i, c in enumerate(result.completions)
    ]
    return wire.text_completion(prepared.model, created, choices, usage)
