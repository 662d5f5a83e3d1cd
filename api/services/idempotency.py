"""Idempotent creates: the ``Idempotency-Key`` request header, with the semantics of the IETF
httpapi draft "The Idempotency-Key HTTP Header Field"
(https://datatracker.ietf.org/doc/draft-ietf-httpapi-idempotency-key-header/).

- The key is the client's, per tenant, kept ``idempotency_key_hours`` (24 h).
- The request's fingerprint is the SHA-256 of its method, path and body (for a JSON body its
  parsed form with sorted keys; for a multipart upload its fields and the SHA-256 of the file's
  bytes, since a client's retry builds a new multipart boundary).
- The first request with a key runs and its answer (status code and body) is stored in the same
  transaction as the object it created; a retry with the same key and fingerprint gets that
  answer again, byte for byte, with ``Idempotent-Replayed: true``, and creates nothing.
- The same key with another fingerprint: 422 ``idempotency_key_reused`` ("Idempotency-Key is
  already used with a different payload"); while the first request is still running: 409
  ``idempotency_key_in_flight``. A malformed key: 400.
- A first request that fails (any error answer) releases its key, so the client may retry, with
  the same or another body; one whose process died is taken over after
  ``idempotency_in_flight_seconds``.

The hook is reusable by any create route, the Anthropic Message Batches create included: take
``IdempotencyDep`` as a parameter and return ``idempotency.run(session, material, produce)``,
where ``material`` is what identifies the request's body (any JSON-serializable value) and
``produce`` creates the object and returns its response model (or a JSON-serializable dict).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from fastapi import Depends, Header, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import Response
from sqlalchemy.orm import Session

from api.deps import CurrentTenant, SettingsDep
from api.errors import BadRequest, Conflict, UnprocessableContent
from offpeak.settings import Settings
from storage.db import session_scope
from storage.repositories import idempotency as idempotency_repo

HEADER = "Idempotency-Key"
#: Longest key accepted (the column's width; the draft sets no limit, UUIDs are 36).
MAX_KEY_LENGTH = 255
REPLAYED_HEADER = "Idempotent-Replayed"


def parse_key(raw: str | None) -> str | None:
    """The key of an ``Idempotency-Key`` header: the draft's Structured Field string
    (``"8e03978e-…"``) or, as most clients send it, the bare value. ``None`` when absent.

    Raises ``BadRequest`` for an empty, over-long or non-printable key.
    """
    if raw is None:
        return None
    key = raw.strip()
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1].replace('\\"', '"').replace("\\\\", "\\")
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise BadRequest(
            f"The {HEADER} header must be 1 to {MAX_KEY_LENGTH} printable characters.",
            param=HEADER,
            code="invalid_idempotency_key",
        )
    return key


def fingerprint(method: str, path: str, material: object) -> str:
    """SHA-256 (hex) of the method, the path and ``material`` as canonical JSON."""
    digest = hashlib.sha256()
    digest.update(f"{method.upper()}\n{path}\n".encode())
    digest.update(orjson.dumps(material, option=orjson.OPT_SORT_KEYS))
    return digest.hexdigest()


def _json_response(body: bytes, status_code: int, replayed: bool) -> Response:
    headers = {REPLAYED_HEADER: "true"} if replayed else None
    return Response(body, status_code=status_code, media_type="application/json", headers=headers)


@dataclass
class Idempotency:
    """One request's idempotency context (``IdempotencyDep``): the tenant, the key (``None``:
    the client sent none, and ``run`` just produces) and where the request went."""

    settings: Settings
    tenant_id: str
    key: str | None
    method: str
    path: str

    def run(
        self,
        session: Session,
        material: object,
        produce: Callable[[], Any],
        *,
        status_code: int = 200,
    ) -> Response:
        """Answer a create once per key: ``produce()`` the first time, the stored answer after.

        ``session`` is the request's own session: the answer is stored in it, so it commits with
        the created object. Raises ``UnprocessableContent`` (422, key used with another body),
        ``Conflict`` (409, first request still running) and whatever ``produce`` raises (the key
        is released first).
        """
        if self.key is None:
            return _json_response(_encode(produce()), status_code, replayed=False)
        key, print_ = self.key, fingerprint(self.method, self.path, material)
        url, at = self.settings.resolved_database_url, time.time()
        with session_scope(url) as reserving:  # committed now: seen while this request runs
            held = idempotency_repo.reserve(
                reserving,
                tenant_id=self.tenant_id,
                key=key,
                fingerprint=print_,
                at=at,
                locked_until=at + self.settings.idempotency_in_flight_seconds,
                expires_at=at + self.settings.idempotency_key_hours * 3600,
            )
            if held is not None:
                held_print, state = held.fingerprint, held.state
                stored_code, stored_body = held.status_code, held.response_body
        if held is not None:
            if held_print != print_:
                raise UnprocessableContent(
                    f"{HEADER} is already used with a different payload.",
                    param=HEADER,
                    code="idempotency_key_reused",
                )
            if state != idempotency_repo.DONE or stored_body is None or stored_code is None:
                raise Conflict(
                    f"A request is outstanding for this {HEADER}; retry once it has answered.",
                    param=HEADER,
                    code="idempotency_key_in_flight",
                )
            return _json_response(stored_body.encode(), stored_code, replayed=True)
        try:
            body = _encode(produce())
            idempotency_repo.complete(
                session,
                tenant_id=self.tenant_id,
                key=key,
                status_code=status_code,
                body=body.decode(),
            )
        except BaseException:
            session.rollback()
            with session_scope(url) as releasing:
                idempotency_repo.release(
                    releasing, tenant_id=self.tenant_id, key=key, fingerprint=print_
                )
            raise
        return _json_response(body, status_code, replayed=False)


def _encode(answer: Any) -> bytes:
    """The JSON bytes FastAPI would send for ``answer`` (a pydantic model or plain data)."""
    return orjson.dumps(jsonable_encoder(answer))


def get_idempotency(
    request: Request,
    settings: SettingsDep,
    tenant: CurrentTenant,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias=HEADER,
            description="Makes the create safe to retry: a retry with the same key and body "
            "returns the first answer and creates nothing (kept 24 h, per tenant).",
        ),
    ] = None,
) -> Idempotency:
    return Idempotency(
        settings=settings,
        tenant_id=tenant.id,
        key=parse_key(idempotency_key),
        method=request.method,
        path=request.url.path,
    )


#: A route's idempotency context: ``idempotency.run(session, material, produce)``.
IdempotencyDep = Annotated[Idempotency, Depends(get_idempotency)]
