"""Dependencies: settings, the session (commits on success, rolls back on error), the reader
(a poll's read-only statements, on the event loop), the blob store and the calling tenant.

Those that do no I/O are ``async def``: FastAPI runs a plain ``def`` dependency on its threadpool,
one round trip through it each, which a status poll paid five times over (see ``Reader``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from api import key_gate
from api.errors import Unauthorized
from offpeak.settings import Settings
from storage.blobs import BlobStore, get_blob_store
from storage.db import read, session_scope
from storage.models import Tenant

T = TypeVar("T")


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def get_session(settings: SettingsDep) -> Iterator[Session]:
    with session_scope(settings.resolved_database_url) as session:
        yield session


# "function" scope: commit before the response is sent, so a client that acts on a response
# (create a batch from the file it just uploaded) always finds the rows it names.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


#: Threads ``Reader`` runs reads on, per API process: a read holds one for a sub-millisecond
#: round trip, so a few keep PostgreSQL busy; more only take turns at the GIL.
READ_THREADS = 8


class Reader:
    """Runs a read-only function on a connection of its own (``storage.db.read``: autocommit,
    no pre-ping, Core rows), for the endpoints users poll (``async def`` routes).

    On PostgreSQL a poll's read runs on the event loop: its one or two indexed statements cost
    less than handing them to a thread and back (``offpeak bench polls``, docs/benchmarks.md).
    The price: an unresponsive database stalls every route of the process, not only its polls.
    Reads that wait on more than the database (``in_thread``: the blob store) and SQLite's (its
    writer's lock) run on the executor, asyncio's plain one: cheaper to cross than Starlette's.
    """

    def __init__(self, database_url: str, threads: int = READ_THREADS) -> None:
        self.database_url = database_url
        #: Reads run on the event loop (PostgreSQL) rather than on the executor.
        self.on_loop = not database_url.startswith("sqlite")
        self._threads = threads
        self._executor = self._new_executor()

    def _new_executor(self) -> ThreadPoolExecutor:
        # Its threads start on first use, so an idle executor costs nothing.
        return ThreadPoolExecutor(self._threads, thread_name_prefix="offpeak-read")

    async def __call__(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(connection, *args, **kwargs)``, on the event loop on PostgreSQL (``fn`` must
        only run statements: no other I/O); raises what it raises (``api.errors`` for the
        client)."""
        if self.on_loop:
            return read(self.database_url, fn, *args, **kwargs)
        return await self.in_thread(fn, *args, **kwargs)

    async def in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(connection, *args, **kwargs)`` on the reader's executor: for a read that also
        waits on something other than the database; raises what it raises."""
        call = partial(read, self.database_url, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """Let the threads go once the reads under way are done (the app's shutdown); a read
        after it starts new ones (an app's lifespan may run again, as tests do)."""
        done, self._executor = self._executor, self._new_executor()
        done.shutdown(wait=False)


async def get_reader(request: Request) -> Reader:
    """The app's reader (``create_app`` makes one per app, on ``app.state.reader``)."""
    reader: Reader = request.app.state.reader
    return reader


ReadDep = Annotated[Reader, Depends(get_reader)]


async def get_blobs(request: Request) -> BlobStore:
    """The app's blob store, looked up on first use and kept on ``app.state``: its URL
    (``Settings.resolved_blob_url``) resolves a path on disk, which cost each download a
    ``realpath`` (5% of an API process's time under the poll mix)."""
    state = request.app.state
    blobs: BlobStore | None = getattr(state, "blobs", None)
    if blobs is None:
        blobs = state.blobs = get_blob_store(state.settings.resolved_blob_url)
    return blobs


BlobsDep = Annotated[BlobStore, Depends(get_blobs)]


#: ``Authorization: Bearer <key>``, declared as the OpenAPI security scheme ``ApiKey`` (not as a
#: header parameter); a missing or non-bearer header gives ``None`` and our own 401.
api_key_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="ApiKey",
    description="A tenant's API key, `sk-offpeak-…` (`offpeak keys create` makes one).",
)
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(api_key_scheme)]


def _gated_tenant(request: Request) -> Tenant:
    """The tenant ``api.key_gate.KeyGateMiddleware`` found for the request's key; 401 when the
    request did not pass the key gate (an app built without it fails closed)."""
    tenant: Tenant | None = getattr(request.state, "tenant", None)
    if tenant is None:
        raise Unauthorized(key_gate.WRONG_KEY)
    return tenant


async def get_tenant(request: Request, _credentials: BearerDep) -> Tenant:
    """The tenant whose key is in ``Authorization: Bearer <key>`` (checked by the key gate before
    the body was read; the parameter declares the security scheme). A copy that belongs to no
    session (read its columns)."""
    return _gated_tenant(request)


CurrentTenant = Annotated[Tenant, Depends(get_tenant)]


async def get_tenant_or_operator(request: Request, _credentials: BearerDep) -> Tenant | None:
    """The calling tenant, or ``None`` for the operator: the admin key, on the paths that take
    it beside a tenant's (``api.key_gate.OPERATOR_TOO``)."""
    if getattr(request.state, "admin", None) is True:
        return None
    return _gated_tenant(request)


TenantOrOperator = Annotated[Tenant | None, Depends(get_tenant_or_operator)]


#: Anthropic's ``x-api-key`` header (the ``anthropic`` SDK sends it), declared as the OpenAPI
#: security scheme ``XApiKey``; the same keys as ``Authorization: Bearer``.
x_api_key_scheme = APIKeyHeader(
    name="x-api-key",
    auto_error=False,
    scheme_name="XApiKey",
    description="A tenant's API key, `sk-offpeak-…`, as Anthropic's clients send it.",
)
XApiKeyDep = Annotated[str | None, Depends(x_api_key_scheme)]


async def get_anthropic_tenant(
    request: Request, _x_api_key: XApiKeyDep, _bearer: BearerDep
) -> Tenant:
    """The tenant whose key is in ``x-api-key`` (or, as the ``anthropic`` SDK sends an
    ``auth_token``, ``Authorization: Bearer``), checked by the key gate in Anthropic's wording."""
    return _gated_tenant(request)


AnthropicTenant = Annotated[Tenant, Depends(get_anthropic_tenant)]


@dataclass(frozen=True)
class Poll:
    """What a read users poll needs, from one dependency: the calling tenant (the key gate's), the
    settings and the reader.

    One dependency where a poll route had four (reader, settings, tenant and, under them, the
    settings again): FastAPI solves each of a request's dependencies anew (its parameters,
    headers, cookies), which cost a poll more CPU than building its answer."""

    tenant: Tenant
    settings: Settings
    read: Reader


async def get_poll(request: Request, _credentials: BearerDep) -> Poll:
    state = request.app.state
    return Poll(_gated_tenant(request), state.settings, state.reader)


PollDep = Annotated[Poll, Depends(get_poll)]
