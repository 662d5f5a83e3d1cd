"""The OpenAI wire format both sides share: error bodies, batch error codes, the batch output
and error lines, and the ``usage`` of a response body. Each endpoint's own body (``chat.completion``
…) is rendered by its module in ``offpeak.endpoints``.

Shapes follow OpenAI's public API reference (Batch API, Chat Completions, Completions) as summed
up in ``shared/docs/batch-api.md``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

#: Error codes on ``batch.errors.data`` (OpenAI's where it has one; ours where it is silent).
INVALID_JSON_LINE = "invalid_json_line"
MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
INVALID_URL = "invalid_url"
STREAMING_UNSUPPORTED = "streaming_unsupported"
MODEL_NOT_FOUND = "model_not_found"
TOKEN_LIMIT_EXCEEDED = "token_limit_exceeded"
INVALID_REQUEST = "invalid_request"
DUPLICATE_CUSTOM_ID = "duplicate_custom_id"
MISMATCHED_MODEL = "mismatched_model"
EMPTY_FILE = "empty_file"
TOO_MANY_REQUESTS = "too_many_requests"
LINE_TOO_LONG = "line_too_long"
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
    """One entry of ``batch.errors.data``; ``line`` is 1-based. A NUL character in ``message``
    or ``param`` (which quote the client's own text: a model name, a parameter's key) is written
    as the six characters ``\\u0000``: PostgreSQL's ``jsonb`` cannot hold U+0000, and storing the
    errors would fail the batch's validation again at every retry."""
    return {
        "code": code,
        "message": _visible_nul(message),
        "param": _visible_nul(param),
        "line": line,
    }


def _visible_nul(text: str | None) -> str | None:
    return text.replace("\x00", "\\u0000") if text is not None and "\x00" in text else text


def response_line(
    custom_id: str, status_code: int, body: dict[str, Any], *, line_id: str, request_id: str
) -> bytes:
    """A line for a request the endpoint answered: 200 goes to the output file, 4xx/5xx
    (``body`` is an error object) to the error file. ``line_id`` is its ``batch_req_…`` id,
    ``request_id`` its ``req_…``. Returns the JSON bytes, no newline."""
    return orjson.dumps(
        {
            "id": line_id,
            "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None,
        }
    )


def never_ran_line(custom_id: str, code: str, message: str, *, line_id: str) -> bytes:
    """An error-file line for a request that never ran (``batch_expired``, ``batch_cancelled``)."""
    return orjson.dumps(
        {
            "id": line_id,
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
    )


def derived_id(prefix: str, *parts: str) -> str:
    """``prefix`` + 24 hex digits that depend only on ``parts``: the same id each time a line
    with nothing stored is written (the never-ran lines of a batch, by batch id and custom_id),
    as long as a random id (``offpeak.ids.new_id``) and as unlikely to collide."""
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=12).hexdigest()
    return f"{prefix}{digest}"


def usage_object(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The ``usage`` of a response body, in tokens."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }
