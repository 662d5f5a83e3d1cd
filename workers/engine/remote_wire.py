"""The remote engine's wire format: engine requests as vLLM's ``/v1/completions`` bodies, and its
answers back as ``EngineResult``s, so both engines give a line the same tokens, logprobs and usage.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import httpx

from workers.engine.base import (
    Completion,
    EngineRequest,
    EngineResult,
    RequestRefused,
    SamplingSpec,
    TokenLogprob,
    TopLogprob,
)

log = logging.getLogger(__name__)

#: Answers that are a verdict on the request itself (vLLM: 400 for a prompt over the context
#: window, bad sampling values). 401/403/404 (wrong key, wrong model name) and 429 are about
#: the server or its configuration: faults, not line failures.
VERDICTS = frozenset({400, 413, 422})
_FINISH_REASONS = {"stop": "stop", "length": "length"}


def completion_body(model: str, request: EngineRequest, priority: int) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``request``: its token ids, every ``SamplingSpec`` field,
    vLLM's ``priority`` and ``return_token_ids``.

    ``min_p`` and ``repetition_penalty`` are sent at vLLM's ``SamplingParams`` defaults: a
    server fills what a request leaves out from the model's ``generation_config.json``, which
    the in-process engine (explicit ``SamplingParams``) does not use, so the same line samples
    the same tokens on both. ``structured_output`` becomes vLLM's ``structured_outputs``.
    """
    spec = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.prompt_token_ids),
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "n": spec.n,
        "stop": list(spec.stop),
        "seed": spec.seed,
        "logprobs": spec.logprobs,
        "presence_penalty": spec.presence_penalty,
        "frequency_penalty": spec.frequency_penalty,
        "top_k": spec.top_k,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "priority": priority,
        "return_token_ids": True,
        "stream": False,
    }
    structured = spec.structured_output
    if spec.logit_bias:
        # JSON object keys are strings; vLLM's server takes token ids so.
        body["logit_bias"] = {str(token): bias for token, bias in spec.logit_bias}
    if structured is not None:
        body["structured_outputs"] = (
            {"json_object": True}
            if structured.json_schema is None
            else {"json": structured.json_schema}
        )
    return body


def to_result(
    rid: str, spec: SamplingSpec, body: dict[str, Any], count_tokens: Callable[[str], int]
) -> EngineResult:
    """A ``/v1/completions`` answer ``body`` as request ``rid``'s result. ``count_tokens`` counts
    a completion's tokens when the server returned no token ids. Raises ``KeyError``,
    ``TypeError`` or ``ValueError`` for an answer without ``choices`` or ``usage``."""
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details")
    choices = sorted(body["choices"], key=lambda c: c.get("index", 0))
    return EngineResult(
        request_id=rid,
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=int((details or {}).get("cached_tokens") or 0),
        completions=[_to_completion(c, spec, count_tokens) for c in choices],
    )


def _to_completion(
    choice: dict[str, Any], spec: SamplingSpec, count_tokens: Callable[[str], int]
) -> Completion:
    reason = choice.get("finish_reason") or "stop"
    if reason not in _FINISH_REASONS:
        log.warning("completion ended with finish reason %r", reason)
    text = str(choice.get("text") or "")
    token_ids = choice.get("token_ids")
    if token_ids is None:  # a server without return_token_ids: the count is what matters
        token_ids = [0] * count_tokens(text)
    logprobs = None
    if spec.logprobs is not None and choice.get("logprobs"):
        logprobs = to_logprobs(choice["logprobs"], spec.logprobs)
    stop = choice.get("stop_reason")  # the stop string matched, a stop token id, or None
    return Completion(
        text=text,
        token_ids=[int(t) for t in token_ids],
        finish_reason=_FINISH_REASONS.get(reason, "stop"),
        logprobs=logprobs,
        stop_sequence=stop if isinstance(stop, str) else None,
    )


def refusal(request: EngineRequest, message: str) -> RequestRefused:
    """The verdict of a server's 4xx answer; a schema its grammar backend refused names the
    line's schema parameter, as ``VllmEngine`` does."""
    structured = request.sampling.structured_output
    lowered = message.lower()
    if structured is not None and ("schema" in lowered or "grammar" in lowered):
        return RequestRefused(
            f"The schema cannot be used for structured output: {message}",
            param=structured.param,
            code="invalid_json_schema",
        )
    return RequestRefused(message)


def to_logprobs(logprobs: dict[str, Any], k: int) -> list[TokenLogprob]:
    """Completions-API logprobs (``tokens``, ``token_logprobs``, ``top_logprobs``) as
    ``TokenLogprob``s, with the ``k`` most likely alternatives, most likely first. vLLM lists the
    sampled token and the ``k`` most likely ones (k + 1 when the sampled one ranks below them,
    keyed by decoded text); keeping the best ``k`` leaves it out exactly then, as
    ``VllmEngine`` does. Two alternatives that decode to the same text collapse into one key at
    the server; ``-9999.0`` is how it writes minus infinity."""
    out = []
    tops = logprobs.get("top_logprobs") or []
    for i, token in enumerate(logprobs.get("tokens") or []):
        value = logprobs["token_logprobs"][i]
        top = tops[i] if i < len(tops) and tops[i] else {}
        best = sorted(top.items(), key=lambda item: -item[1])[:k]
        out.append(
            TokenLogprob(
                token=str(token),
                logprob=float(value) if value is not None else math.nan,
                top=[TopLogprob(str(t), float(lp)) for t, lp in best],
            )
        )
    return out


def served_models(client: httpx.Client) -> dict[str, int | None]:
    """``name → max_model_len`` from a healthy server. Raises ``httpx.HTTPError`` while it is
    not (``/health`` not 200, or no answer)."""
    client.get("/health").raise_for_status()
    response = client.get("/v1/models")
    response.raise_for_status()
    return {m["id"]: m.get("max_model_len") for m in response.json()["data"]}


def error_message(response: httpx.Response) -> str:
    """The server's error message (OpenAI's ``{"error": {"message"}}``), else its text."""
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    except ValueError:
        pass
    return f"the server answered {response.status_code}: {response.text[:300]}"
