"""The OpenAI wire format, in one place: error bodies, batch output/error lines and the
``chat.completion`` / ``text_completion`` response bodies.

Shapes follow OpenAI's public API reference (Batch API, Chat Completions, Completions) as summed
up in ``shared/docs/batch-api.md``. Both the API and the workers build their JSON here.
"""

from __future__ import annotations

from typing import Any

import orjson

from offpeak.ids import new_id

CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
#: Endpoints a batch may target here.
BATCH_ENDPOINTS = (CHAT_COMPLETIONS, COMPLETIONS)
#: Endpoints OpenAI accepts for batches that this server does not run (yet): a clear 400.
UNSUPPORTED_BATCH_ENDPOINTS = ("/v1/embeddings", "/v1/responses")

#: Error codes on ``batch.errors.data`` (OpenAI's where it has one; ours where it is silent).
INVALID_JSON_LINE = "invalid_json_line"
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
INVALID_URL = "invalid_url"
STREAMING_UNSUPPORTED = "streaming_unsupported"
MODEL_NOT_FOUND = "model_not_found"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
MISMATCHED_MODEL = "mismatched_model"
EMPTY_FILE = "empty_file"
TOO_MANY_REQUESTS = "too_many_requests"
#: ``error.code`` of a request line that never ran.
BATCH_EXPIRED = "batch_expired"
BATCH_CANCELLED = "batch_cancelled"


def error_object(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """``{"error": {message, type, param, code}}``: OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def batch_error(
    code: str, message: str, line: int | None = None, param: str | None = None
) -> dict[str, Any]:
    """One entry of ``batch.errors.data``; ``line`` is 1-based."""
    return {"code": code, "message": message, "param": param, "line": line}


def response_line(custom_id: str, status_code: int, body: dict[str, Any]) -> bytes:
    """A line for a request the endpoint answered: 200 goes to the output file, 4xx/5xx
    (``body`` is an error object) to the error file. Returns the JSON bytes, no newline."""
    return orjson.dumps(
        {
            "id": new_id("batch_req_"),
            "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": new_id("req_"), "body": body},
            "error": None,
        }
    )


def never_ran_line(custom_id: str, code: str, message: str) -> bytes:
    """An error-file line for a request that never ran (``batch_expired``, ``batch_cancelled``)."""
    return orjson.dumps(
        {
            "id": new_id("batch_req_"),
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` of a response body, in tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def chat_completion(
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
) -> dict[str, Any]:
    """A ``chat.completion`` body. Each choice: ``{index, message, logprobs, finish_reason}``."""
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
        "service_tier": "default",
    }


def text_completion(
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage: dict[str, Any],
) -> dict[str, Any]:
    """A ``text_completion`` body. Each choice: ``{index, text, logprobs, finish_reason}``."""
    return {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
        "system_fingerprint": None,
    }
