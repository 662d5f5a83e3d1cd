"""One error hierarchy; each class carries its HTTP status and renders in OpenAI's error shape.

Every client mistake maps to a 4xx here; a 500 is only ever our bug. A database that cannot be
reached is neither: a 503 with ``Retry-After`` (``install_error_handlers``).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from api.schemas.common import ErrorResponse
from offpeak.endpoints import anthropic_messages
from offpeak.wire import error_object
from storage.blobs import StoreUnavailable
from storage.errors import is_unavailable

log = logging.getLogger(__name__)

#: Seconds a 503 asks the client to wait (``Retry-After``) while the database is unavailable
#: (``/readyz``'s too). The official SDKs retry a 503 by themselves, ``max_retries`` times (2 by
#: default), each after the ``Retry-After`` seconds when they are at most two minutes
#: (``openai`` 3.57, ``openai/_base_client.py``: ``_should_retry`` retries any status >= 500,
#: ``_calculate_retry_timeout`` honours the header up to ``MAX_RETRY_AFTER_DELAY``; ``anthropic``
#: 2.16's ``_base_client.py`` retries >= 500 too and waits the header's seconds): a poll loop
#: rides through a restart of about ten seconds without seeing an error.
RETRY_AFTER_SECONDS = 5
DATABASE_UNAVAILABLE = "The database is unavailable right now; retry in a few seconds."
STORE_UNAVAILABLE = "The file store is unavailable right now; nothing was stored, retry later."


def log_unavailable(method: str, path: str, exc: Exception) -> None:
    """One warning line for a request answered 503 because the database is unavailable: no
    traceback, since the cause is outside this process and the stack would be the same for every
    request refused while it lasts (``/readyz`` says the same)."""
    cause = getattr(exc, "orig", None) or exc
    text = str(cause).strip()
    log.warning(
        "database unavailable: %s %s answered 503 (%s: %s)",
        method,
        path,
        type(cause).__name__,
        text.splitlines()[0] if text else "",
    )


class ApiError(Exception):
    status_code = 400
    type = "invalid_request_error"
    code: str | None = None
    #: Response headers the answer carries besides the body's.
    headers: dict[str, str] = {}  # noqa: RUF012 (read only)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, object]:
        return error_object(self.message, self.type, self.param, self.code)


class BadRequest(ApiError):
    status_code = 400


def unknown_cursor(kind: str, after: str) -> BadRequest:
    """The answer to a list's ``after`` that names no object of the caller's: a 400 rather than
    a page from the top, which a client paging through would take for the next page and loop
    on (OpenAI's reference does not say what it answers; a 400 is what its other invalid
    parameters get)."""
    return BadRequest(
        f"Invalid 'after': no {kind} with id '{after}' in this list; pass the 'last_id' of a "
        "page you were given.",
        param="after",
        code="invalid_value",
    )


class Unauthorized(ApiError):
    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(ApiError):
    status_code = 404
    code = "not_found"


class Conflict(ApiError):
    status_code = 409
    code = "invalid_state"


class UnprocessableContent(ApiError):
    """422: the request is well-formed but cannot be processed as sent (an Idempotency-Key
    reused with another body, as the IETF idempotency-key draft answers)."""

    status_code = 422
    code = "unprocessable_content"


class PayloadTooLarge(ApiError):
    status_code = 413
    code = "file_too_large"


class QuotaExceeded(ApiError):
    """429: a tenant's quota (batches in progress, stored bytes) is used up. Waiting seconds
    will not free it, so ``x-should-retry: false`` tells OpenAI's SDKs, which retry every 429
    twice by default, not to."""

    status_code = 429
    headers = {"x-should-retry": "false"}  # noqa: RUF012 (read only)


#: What each error status means on this API, for the OpenAPI document.
_STATUS_DESCRIPTIONS = {
    400: "A parameter is missing or invalid (OpenAI's invalid_request_error).",
    401: "No API key, or an incorrect one.",
    404: "No such object (also for another tenant's id).",
    409: "The object's state does not allow this (e.g. cancelling a finished batch), or a "
    "request with the same Idempotency-Key is still running.",
    413: "The request body is larger than the limit.",
    429: "A rate limit (Retry-After, x-ratelimit-*-requests) or a quota of the tenant "
    "(batch_limit_exceeded, storage_limit_exceeded) was reached.",
    422: "The request body is not valid JSON, or its Idempotency-Key was used with another body.",
    503: "The database or the file store is unavailable right now (code database_unavailable "
    "or store_unavailable); retry after the seconds in Retry-After.",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for a route that can answer ``statuses``, each with OpenAI's
    error body (``ErrorResponse``). Declaring 422 replaces FastAPI's own 422 schema, which is
    not what this API sends."""
    return {
        status: {"model": ErrorResponse, "description": _STATUS_DESCRIPTIONS[status]}
        for status in statuses
    }


def _param_from_loc(loc: tuple[object, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header", "form")]
    return ".".join(parts) or None


_RETRY_LATER = {
    503: (
        _STATUS_DESCRIPTIONS[503],
        "api_error: the database is unavailable right now; retry after the seconds in Retry-After.",
    ),
    429: (
        "Too many incorrect API keys from this address (code rate_limit_exceeded); retry "
        "after the seconds in Retry-After.",
        "rate_limit_error: too many incorrect API keys from this address; retry after the "
        "seconds in Retry-After.",
    ),
}


def _retry_later_response(path: str, status: int) -> dict[str, Any]:
    """The OpenAPI response of a 503 (``database_unavailable``) or a 429 (``api.key_gate``'s
    wrong-key throttle) on ``path``, in its surface's error shape, with ``Retry-After``."""
    schema, description = "ErrorResponse", _RETRY_LATER[status][0]
    if anthropic_messages.on_surface(path):
        schema, description = "AnthropicErrorResponse", _RETRY_LATER[status][1]
    return {
        "description": description,
        "headers": {
            "Retry-After": {
                "description": "Seconds to wait before retrying.",
                "schema": {"type": "integer"},
            }
        },
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


def _document_errors_as_sent(app: FastAPI) -> None:
    """Drop the 422 that FastAPI declares on every route with parameters (its
    ``HTTPValidationError`` body): the handlers below answer a bad parameter with a 400 in
    OpenAI's shape, and a 422 only for a JSON body that does not parse, which the routes that
    take one declare themselves (``error_responses(..., 422)``). Declare the 503 every ``/v1``
    route answers while the database is unavailable, and the key gate's 429 (``api.key_gate``)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            for path, operations in document.get("paths", {}).items():
                for operation in operations.values():
                    declared = operation.get("responses", {}).get("422", {})
                    if "HTTPValidationError" in str(declared.get("content")):
                        del operation["responses"]["422"]
                    if path.startswith("/v1/"):
                        operation["responses"]["503"] = _retry_later_response(path, 503)
                    if path.startswith("/v1/") and not path.startswith("/v1/admin/"):
                        operation["responses"]["429"] = _retry_later_response(path, 429)
            schemas = document.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
        return app.openapi_schema or {}

    app.openapi = openapi  # type: ignore[method-assign]


def _respond(
    request: Request,
    body: dict[str, Any],
    status_code: int,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error answer: OpenAI's ``body`` as it is, or, on Anthropic's surface
    (``/v1/messages…``), the same message in Anthropic's shape (``{"type": "error", "error":
    {type, message}}``, the type from the status), which the ``anthropic`` SDK reads."""
    if anthropic_messages.on_surface(request.url.path):
        body = anthropic_messages.error_body(status_code, str(body["error"]["message"]))
    return JSONResponse(body, status_code=status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Render ``ApiError``, request validation and routing errors in OpenAI's shape (and say
    so in the OpenAPI document)."""
    _document_errors_as_sent(app)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else {}
        headers.update(exc.headers)
        return _respond(request, exc.body(), status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = tuple(first.get("loc", ()))
        # A body that is not JSON at all is malformed (422); a missing or wrong value is a
        # bad value (400), as OpenAI answers.
        if first.get("type") == "json_invalid":
            body = error_object(
                "The request body is not valid JSON.", param=None, code="invalid_json"
            )
            return _respond(request, body, status_code=422)
        param = _param_from_loc(loc)
        kind = first.get("type", "")
        if param is None:
            message = "The request body must be a JSON object."
            return _respond(request, error_object(message, code="invalid_value"), status_code=400)
        if kind == "missing":
            message = f"Missing required parameter: '{param}'."
            code = "missing_required_parameter"
        else:
            message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}."
            code = "invalid_value"
        return _respond(request, error_object(message, param=param, code=code), status_code=400)

    @app.exception_handler(DataError)
    async def _data_error(request: Request, _exc: DataError) -> JSONResponse:
        # The database refused a value the client sent (a NUL character, an over-long string):
        # a bad value, not a server fault. The session has already rolled back.
        message = "A value in the request cannot be stored or looked up (e.g. a NUL character)."
        return _respond(request, error_object(message, code="invalid_value"), status_code=400)

    async def _database_unavailable(request: Request, exc: Exception) -> JSONResponse:
        # The database is down, restarting or out of connections: nothing the client sent is
        # wrong and a retry will do, so a 503 it retries rather than a 500. Any other error of
        # these classes is our bug, raised on to the 500 and its traceback.
        if not is_unavailable(exc):
            raise exc
        log_unavailable(request.method, request.url.path, exc)
        body = error_object(
            DATABASE_UNAVAILABLE,
            type="server_error",
            code="database_unavailable",
        )
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return _respond(request, body, status_code=503, headers=headers)

    for unavailable in (OperationalError, InterfaceError, PoolTimeoutError):
        app.add_exception_handler(unavailable, _database_unavailable)

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
        # The object store did not answer within the blob store's retries: as for the
        # database, a 503 the SDKs retry by themselves, never a 500.
        log.warning(
            "file store unavailable: %s %s answered 503 (%s)", request.method, request.url.path, exc
        )
        body = error_object(STORE_UNAVAILABLE, type="server_error", code="store_unavailable")
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)}
        return _respond(request, body, status_code=503, headers=headers)

    @app.exception_handler(UnicodeEncodeError)
    async def _unencodable(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # A string the database driver cannot encode as UTF-8 holds a lone UTF-16 surrogate,
        # which only a client's value can (``api.surrogates`` refuses such JSON bodies before
        # the app reads them; this is the net under it). Any other encoding failure is our bug.
        if exc.reason != "surrogates not allowed":
            raise exc
        log.warning("refused an unencodable value: %s", exc)
        body = error_object(
            "A string in the request is not valid Unicode text (it holds a lone UTF-16 surrogate).",
            code="invalid_value",
        )
        return _respond(request, body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        body = error_object(str(exc.detail), param=None, code=code)
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
        return _respond(request, body, status_code=exc.status_code, headers=headers or None)


def _allowed_methods(request: Request) -> str:
    """``Allow`` of a 405 (RFC 9110 section 15.5.6): every method some route serves at this
    path. Starlette's own header names only the first route that matched the path (``POST``
    for ``PUT /v1/batches``, though ``GET`` is served there too)."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        if isinstance(route, Route) and route.methods:
            match, _ = route.matches(request.scope)
            if match is not Match.NONE:
                methods |= route.methods
    return ", ".join(sorted(methods))
