"""The protocol of one webhook, as OpenAI sends them: the event body, its Standard Webhooks
signature and the retry schedule. Where an attempt may go and how it is sent are
``offpeak.webhook_target``; the outbox and its retries are ``workers.webhook_delivery``.

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
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime

import orjson
from standardwebhooks.webhooks import Webhook

from offpeak.statuses import BatchStatus

#: The batch events a tenant can subscribe to: OpenAI's names, then Offpeak's extensions (a
#: batch paused or resumed, ``POST /v1/batches/{id}/pause``), in the same shape.
EVENT_TYPES = (
    "batch.completed",
    "batch.failed",
    "batch.expired",
    "batch.cancelled",
    "batch.paused",
    "batch.resumed",
)
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


def retry_delay(attempts: int, base_seconds: float, max_seconds: float) -> float:
    """Seconds to wait after the ``attempts``-th failed attempt: ``base × 2^(attempts−1)``, at
    most ``max_seconds`` (5 s, 10 s, 20 s … 1 h with the defaults)."""
    return float(min(max_seconds, base_seconds * 2 ** max(0, attempts - 1)))
