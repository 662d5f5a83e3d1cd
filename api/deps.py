"""Dependencies: settings, the session (commits on success, rolls back on error), the blob
store and the calling tenant."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api.errors import Unauthorized
from api.services import keys
from offpeak.settings import Settings
from storage.blobs import BlobStore, get_blob_store
from storage.db import session_scope
from storage.models import Tenant


def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    with session_scope(settings.resolved_database_url) as session:
        yield session


# "function" scope: commit before the response is sent, so a client that acts on a response
# (create a batch from the file it just uploaded) always finds the rows it names.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def get_blobs(settings: SettingsDep) -> BlobStore:
    return get_blob_store(settings.resolved_blob_url)


BlobsDep = Annotated[BlobStore, Depends(get_blobs)]


#: ``Authorization: Bearer <key>``, declared as the OpenAPI security scheme ``ApiKey`` (not as a
#: header parameter); a missing or non-bearer header gives ``None`` and our own 401.
api_key_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="A tenant's API key, `sk-offpeak-…` (`offpeak keys create` makes one).",
)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(api_key_scheme)]


def get_tenant(session: SessionDep, credentials: BearerDep) -> Tenant:
    """The tenant whose key is in ``Authorization: Bearer <key>``; 401 otherwise."""
    if credentials is None:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'; "
            "`offpeak keys create` makes one."
        )
    tenant = keys.tenant_for_key(session, credentials.credentials.strip())
    if tenant is None:
        raise Unauthorized("Incorrect API key provided.")
    return tenant


CurrentTenant = Annotated[Tenant, Depends(get_tenant)]


#: Anthropic's ``x-api-key`` header (the ``anthropic`` SDK sends it), declared as the OpenAPI
#: security scheme ``XApiKey``; the same keys as ``Authorization: Bearer``.
x_api_key_scheme = APIKeyHeader(
    name="x-api-key",
    auto_error=False,
    scheme_name="XApiKey",
    description="A tenant's API key, `sk-offpeak-…`, as Anthropic's clients send it.",
)
XApiKeyDep = Annotated[str | None, Depends(x_api_key_scheme)]


def get_anthropic_tenant(session: SessionDep, x_api_key: XApiKeyDep, bearer: BearerDep) -> Tenant:
    """The tenant whose key is in ``x-api-key`` (or, as the ``anthropic`` SDK sends an
    ``auth_token``, ``Authorization: Bearer``); 401 in Anthropic's wording otherwise."""
    key = x_api_key if x_api_key is not None else (bearer.credentials if bearer else None)
    if key is None:
        raise Unauthorized("x-api-key header is required")
    tenant = keys.tenant_for_key(session, key.strip())
    if tenant is None:
        raise Unauthorized("invalid x-api-key")
    return tenant


AnthropicTenant = Annotated[Tenant, Depends(get_anthropic_tenant)]
