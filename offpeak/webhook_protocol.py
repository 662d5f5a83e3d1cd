"""The protocol of one webhook, as OpenAI sends them: the event body, its Standard Webhooks
signature, the check that a target is a public HTTPS address, one attempt over httpx, and the
retry schedule. No storage: the outbox and its retries are ``workers.webhook_delivery``.

Used by the API (endpoint management, the test event) and by the workers (the delivery).

Sources: OpenAI's webhook events (``{id, object: "event", type, created_at, data: {id}}``,
https://platform.openai.com/docs/guides/webhooks) and the Standard Webhooks specification
(https://www.standardwebhooks.com: headers ``webhook-id``, ``webhook-timestamp`` and
``webhook-signature`` = space-separated ``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``,
secrets ``whsec_<base64>``), signed with the ``standardwebhooks`` library, so that
``openai.OpenAI().webhooks.unwrap(body, headers, secret=...)`` accepts them.
"""

from __future__ import annotations

import base64
import ipaddress
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import urlsplit

import httpx
import orjson
from standardwebhooks.webhooks import Webhook

from offpeak.statuses import BatchStatus

#: The batch events a tenant can subscribe to (OpenAI's names).
EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")
#: The event a batch's final status sends.
EVENT_OF_STATUS = {
    BatchStatus.COMPLETED: "batch.completed",
    BatchStatus.FAILED: "batch.failed",
    BatchStatus.EXPIRED: "batch.expired",
    BatchStatus.CANCELLED: "batch.cancelled",
}
SECRET_PREFIX = "whsec_"
#: Random bytes in a secret: 24 encode to 32 base64 characters without padding (what Svix and
#: OpenAI issue; the openai SDK decodes the secret without adding padding).
SECRET_BYTES = 24
#: Characters of an answer's body kept in the delivery log, for the tenant to see why it failed.
MAX_LOGGED_BODY = 500


def new_secret() -> str:
    """A fresh signing secret, ``whsec_`` + base64 of 24 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_hint(secret: str) -> str:
    """A masked form to tell secrets apart in listings: ``whsec_…`` and its last 4 characters."""
    return f"{SECRET_PREFIX}…{secret[-4:]}"


def event_body(event_id: str, event_type: str, created_at: int, object_id: str) -> bytes:
    """The JSON body of an event, in OpenAI's shape; the exact bytes that are signed and sent
    (stored once, so every retry sends the same bytes)."""
    return orjson.dumps(
        {
            "id": event_id,
            "object": "event",
            "type": event_type,
            "created_at": created_at,
            "data": {"id": object_id},
        }
    )


def signed_headers(event_id: str, body: bytes, signing_secrets: Sequence[str], at: float) -> dict:
    """The Standard Webhooks headers for one attempt at unix second ``at``: ``webhook-id`` (the
    event's id, the same on every retry so a receiver can drop duplicates), ``webhook-timestamp``
    and ``webhook-signature`` with one ``v1,…`` per secret (during a rotation's grace period the
    old and the new secret both sign, so a receiver holding either accepts it)."""
    stamp = datetime.fromtimestamp(int(at), tz=UTC)
    text = body.decode()
    signatures = " ".join(Webhook(s).sign(event_id, stamp, text) for s in signing_secrets)
    return {
        "content-type": "application/json",
        "user-agent": "Offpeak-Webhooks/1",
        "webhook-id": event_id,
        "webhook-timestamp": str(int(at)),
        "webhook-signature": signatures,
    }


class TargetRefused(ValueError):
    """An endpoint URL this server will not call; the message says why."""


Resolver = Callable[[str, int], Iterable[str]]


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is loopback, whatever Python's version says
    return ip.is_global and not ip.is_multicast


def check_url(url: str, *, allow_http: bool, allow_private: bool) -> None:
    """The scheme and form of an endpoint URL, without a network look-up (create, update).

    Raises ``TargetRefused``: not ``https://`` (``http://`` too with ``allow_http``), no host,
    credentials in the URL, or a literal private address without ``allow_private``.
    """
    parts = urlsplit(url)
    schemes = ("https", "http") if allow_http else ("https",)
    if parts.scheme not in schemes:
        raise TargetRefused(f"The URL must start with {' or '.join(s + '://' for s in schemes)}.")
    if not parts.hostname:
        raise TargetRefused("The URL has no host.")
    if parts.username or parts.password:
        raise TargetRefused("The URL must not carry a user name or password.")
    try:
        literal = ipaddress.ip_address(parts.hostname)
    except ValueError:
        return
    if not allow_private and not _public(str(literal)):
        raise TargetRefused(f"{parts.hostname} is not a public address.")


def check_target(
    url: str, *, allow_http: bool, allow_private: bool, resolve: Resolver = _resolve
) -> None:
    """``check_url``, then resolve the host and refuse it when any of its addresses is private,
    loopback, link-local, multicast or reserved (``ipaddress``'s ``is_global``), unless
    ``allow_private``. Run before every attempt, since a name can resolve elsewhere later.

    Raises ``TargetRefused`` (also when the host does not resolve).
    """
    check_url(url, allow_http=allow_http, allow_private=allow_private)
    if allow_private:
        return
    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        addresses = list(resolve(host, parts.port or (443 if parts.scheme == "https" else 80)))
    except OSError as exc:
        raise TargetRefused(f"{host} does not resolve ({exc}).") from None
    refused = [a for a in addresses if not _public(a)]
    if refused or not addresses:
        raise TargetRefused(f"{host} resolves to a non-public address ({', '.join(refused)}).")


@dataclass(frozen=True)
class Attempt:
    """One delivery attempt: the receiver's status code (``None`` when no answer came), the
    seconds it took and, when it failed, why (``error``, a line of text)."""

    status_code: int | None
    latency_seconds: float
    error: str | None = None

    @property
    def delivered(self) -> bool:
        """A 2xx answer (Standard Webhooks: any other answer, redirects included, is a failure)."""
        return self.status_code is not None and 200 <= self.status_code < 300


def post(url: str, body: bytes, headers: dict, timeout: float) -> Attempt:
    """POST ``body`` to ``url`` once, without following redirects; never raises for a network
    failure (it is an ``Attempt`` with ``status_code=None``)."""
    started = time.perf_counter()
    try:
        response = httpx.post(
            url, content=body, headers=headers, timeout=timeout, follow_redirects=False
        )
    except httpx.HTTPError as exc:
        return Attempt(None, time.perf_counter() - started, f"{type(exc).__name__}: {exc}"[:500])
    latency = time.perf_counter() - started
    if 200 <= response.status_code < 300:
        return Attempt(response.status_code, latency)
    return Attempt(response.status_code, latency, response.text[:MAX_LOGGED_BODY] or None)


def retry_delay(attempts: int, base_seconds: float, max_seconds: float) -> float:
    """Seconds to wait after the ``attempts``-th failed attempt: ``base × 2^(attempts−1)``, at
    most ``max_seconds`` (5 s, 10 s, 20 s … 1 h with the defaults)."""
    return float(min(max_seconds, base_seconds * 2 ** max(0, attempts - 1)))
