"""The key gate: the API key is checked from the headers before anything reads a body.

FastAPI reads and parses a route's body before it solves the route's dependencies, so a key
checked by a dependency lets an anonymous client make the API buffer, spool or parse whatever
it sends. This middleware answers every ``/v1/…`` request without a valid key from its headers
alone, and leaves the tenant (or the admin's pass) on the request's state for the dependencies
of ``api.deps`` to pick up. Repeated wrong keys from one client address are answered 429, and
so is a key past its requests per minute (``api.rate_limits``; the admin API has no limit), so a
limited client costs neither a body read nor a database query. A batch create past its
tenant's batch creates per minute is answered 429 here too, before its body is read, so a
refused create leaves nothing behind.
"""

from __future__ import annotations

import hmac
import math
import re
import threading
import time
from collections import OrderedDict

import orjson
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import rate_limits
from api.errors import DATABASE_UNAVAILABLE, RETRY_AFTER_SECONDS, log_unavailable
from api.services import keys
from offpeak import tenant_limits
from offpeak.endpoints import anthropic_messages
from offpeak.settings import Settings
from offpeak.wire import error_object
from storage.errors import is_unavailable
from storage.models import Tenant

#: Paths under this prefix need a key; the rest (``/healthz``, ``/metrics``, the dashboard's
#: page) are public.
API_PREFIX = "/v1/"
ADMIN_PREFIX = "/v1/admin/"
#: Tenant paths that also take the admin key, showing the operator every tenant's figures.
OPERATOR_TOO = frozenset({"/v1/dashboard"})
#: Paths of one batch that take the admin key too (the operator pauses any tenant's batch).
OPERATOR_TOO_BATCH = re.compile(r"/v1/batches/[^/]+/(pause|resume)")
#: The batch creates, counted against ``batch_creates_per_minute``.
BATCH_CREATES = frozenset({"/v1/batches", "/v1/messages/batches"})
#: Client addresses whose failures are remembered at most (least recently failed go first).
FAILURE_TABLE_SIZE = 10_000

NO_KEY = (
    "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'; "
    "`offpeak keys create` makes one."
)
WRONG_KEY = "Incorrect API key provided."
NO_ANTHROPIC_KEY = "x-api-key header is required"
WRONG_ANTHROPIC_KEY = "invalid x-api-key"
ADMIN_OFF = "The admin API is off: set OFFPEAK_ADMIN_API_KEY where the API runs to turn it on."
WRONG_ADMIN_KEY = "Incorrect admin API key provided."


class Refused(Exception):
    """An answer the key gate gives instead of the route: ``status`` with ``message``."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        headers: dict[str, str] | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}
        self.kind = kind


class FailureThrottle:
    """Wrong keys per client address in fixed windows: after ``allowed`` in one window of
    ``window_seconds``, the address is refused until the window ends. Thread-safe, bounded."""

    def __init__(self, allowed: int, window_seconds: float) -> None:
        self.allowed = allowed
        self.window_seconds = window_seconds
        self._windows: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again, or ``None`` while it is under the limit."""
        with self._lock:
            entry = self._windows.get(address)
        if entry is None:
            return None
        started, failures = entry
        left = started + self.window_seconds - time.monotonic()
        return left if failures >= self.allowed and left > 0 else None

    def failed(self, address: str) -> None:
        now = time.monotonic()
        with self._lock:
            started, failures = self._windows.get(address, (now, 0))
            if now - started >= self.window_seconds:
                started, failures = now, 0
            self._windows[address] = (started, failures + 1)
            self._windows.move_to_end(address)
            while len(self._windows) > FAILURE_TABLE_SIZE:
                self._windows.popitem(last=False)


def _routed(scope: Scope) -> bool:
    """Whether a route of the app takes this method on this path."""
    return any(route.matches(scope)[0] is Match.FULL for route in scope["app"].router.routes)


def _bearer(headers: Headers) -> str | None:
    scheme, _, credentials = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


class KeyGateMiddleware:
    """401 (in the surface's error shape) for a ``/v1/…`` request without a valid key, before
    its body is read; 429 with ``Retry-After`` for an address past its wrong-key allowance.

    On success ``scope["state"]`` holds ``tenant`` (a ``Tenant`` in no session) or, under
    ``/v1/admin/`` and on ``OPERATOR_TOO`` with the admin key, ``admin`` = ``True``."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.throttle = FailureThrottle(
            settings.auth_failures_allowed, settings.auth_failure_window_seconds
        )
        self.limiter = rate_limits.limiter_for(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not scope["path"].startswith(API_PREFIX)
            or not _routed(scope)
        ):
            # A 404 or 405 reads no body and tells nothing a key would guard.
            await self.app(scope, receive, send)
            return
        address = scope["client"][0] if scope.get("client") else ""
        verdict = None
        try:
            state = scope.setdefault("state", {})
            if scope["path"].startswith(ADMIN_PREFIX):
                self._check_admin(Headers(scope=scope))
                state["admin"] = True
            elif _operator_too(scope["path"]) and self._is_admin(Headers(scope=scope)):
                state["admin"] = True
            else:
                tenant, key = await self._tenant(scope, Headers(scope=scope), address)
                state["tenant"] = tenant
                verdict = await self._rate(tenant, key)
                if scope["method"] == "POST" and scope["path"].rstrip("/") in BATCH_CREATES:
                    await self._creates(tenant)
        except Refused as refused:
            await _answer(send, scope["path"], refused)
            return
        if verdict is None:
            await self.app(scope, receive, send)
            return
        extra = [(name.encode(), value.encode()) for name, value in verdict.headers().items()]

        async def send_with_limits(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_limits)

    async def _rate(self, tenant: Tenant, key: str) -> rate_limits.Verdict | None:
        """The key's rate-limit verdict (``None``: no limit applies); raises ``Refused`` (429,
        OpenAI's ``rate_limit_exceeded`` of type ``requests``) past it."""
        limit = tenant_limits.one(
            "requests_per_minute", tenant.requests_per_minute, self.settings.limits
        )
        if limit is None:
            return None
        verdict = await self.limiter.check(keys.hash_key(key), limit)
        if not verdict.allowed:
            wait = verdict.headers()["retry-after"]
            raise Refused(
                429,
                f"Rate limit reached for requests per min (RPM) on this API key: Limit {limit}, "
                f"Used {limit}, Requested 1. Please try again in {wait}s.",
                "rate_limit_exceeded",
                verdict.headers(),
                kind="requests",
            )
        return verdict

    async def _creates(self, tenant: Tenant) -> None:
        """Count one batch create against the tenant's ``batch_creates_per_minute`` (the same
        GCRA as the keys' rate, on a key of the tenant's); raises ``Refused`` (429,
        ``rate_limit_exceeded`` with ``Retry-After``) past it."""
        limit = tenant_limits.one(
            "batch_creates_per_minute", tenant.batch_creates_per_minute, self.settings.limits
        )
        if limit is None:
            return
        verdict = await self.limiter.check(f"creates:{tenant.id}", limit)
        if verdict.allowed:
            return
        headers = verdict.headers()
        wait = headers["retry-after"]
        raise Refused(
            429,
            f"Rate limit reached for batch creates per minute on this organization: Limit "
            f"{limit}. Please try again in {wait}s.",
            "rate_limit_exceeded",
            {"retry-after": wait, "retry-after-ms": headers["retry-after-ms"]},
            kind="requests",
        )

    async def _tenant(self, scope: Scope, headers: Headers, address: str) -> tuple[Tenant, str]:
        anthropic = anthropic_messages.on_surface(scope["path"])
        key = _bearer(headers)
        if anthropic:
            x_api_key = headers.get("x-api-key")
            key = x_api_key.strip() if x_api_key is not None else key
        if not key:
            raise Refused(401, NO_ANTHROPIC_KEY if anthropic else NO_KEY, "invalid_api_key")
        tenant = keys.cached_tenant(key)
        if tenant is not None:
            return tenant, key
        # Only lookups are throttled: a key this process found in the last few seconds
        # (``keys.KEY_CACHE_SECONDS``) still passes from a throttled address.
        wait = self.throttle.retry_after(address)
        if wait is not None:
            raise Refused(
                429,
                "Too many requests with an incorrect API key from this address; "
                f"try again in {math.ceil(wait)} s.",
                "rate_limit_exceeded",
                {"Retry-After": str(math.ceil(wait))},
                kind="requests",
            )
        try:
            tenant = await scope["app"].state.reader(keys.tenant_for_key, key)
        except Exception as exc:
            # The same 503 the app's handlers give (``api.errors``): a retry will do.
            if not is_unavailable(exc):
                raise
            log_unavailable(scope["method"], scope["path"], exc)
            raise Refused(
                503,
                DATABASE_UNAVAILABLE,
                "database_unavailable",
                {"Retry-After": str(RETRY_AFTER_SECONDS)},
                kind="server_error",
            ) from exc
        if tenant is None:
            self.throttle.failed(address)
            raise Refused(401, WRONG_ANTHROPIC_KEY if anthropic else WRONG_KEY, "invalid_api_key")
        return tenant, key

    def _check_admin(self, headers: Headers) -> None:
        if not self.settings.admin_api_key:
            raise Refused(401, ADMIN_OFF, "invalid_api_key")
        if not self._is_admin(headers):
            raise Refused(401, WRONG_ADMIN_KEY, "invalid_api_key")

    def _is_admin(self, headers: Headers) -> bool:
        """Whether ``Authorization: Bearer`` holds the admin key (never while it is unset)."""
        expected = self.settings.admin_api_key
        given = _bearer(headers) or ""
        return bool(expected) and hmac.compare_digest(given.encode(), expected.encode())


def _operator_too(path: str) -> bool:
    """Whether ``path`` takes the admin key beside a tenant's."""
    return path in OPERATOR_TOO or OPERATOR_TOO_BATCH.fullmatch(path) is not None


def is_operator(headers: Headers, settings: Settings) -> bool:
    """Whether ``Authorization: Bearer`` holds the metrics token or the admin key (neither is
    accepted while unset): what ``/metrics`` needs, and what ``/healthz`` answers in full."""
    given = (_bearer(headers) or "").encode()
    return any(
        hmac.compare_digest(given, expected.encode())
        for expected in (settings.metrics_token, settings.admin_api_key)
        if expected
    )


def presented_key(headers: Headers) -> str | None:
    """The tenant key a request carries (``x-api-key`` or ``Authorization: Bearer``), if any."""
    x_api_key = headers.get("x-api-key")
    return x_api_key.strip() if x_api_key else _bearer(headers)


async def _answer(send: Send, path: str, refused: Refused) -> None:
    if anthropic_messages.on_surface(path):
        body = orjson.dumps(anthropic_messages.error_body(refused.status, refused.message))
    else:
        body = orjson.dumps(error_object(refused.message, refused.kind, None, refused.code))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if refused.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    headers += [(k.lower().encode(), v.encode()) for k, v in refused.headers.items()]
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
