"""The FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import migrations
from api.body_limits import BodyLimitMiddleware
from api.deps import Reader
from api.errors import install_error_handlers
from api.key_gate import KeyGateMiddleware
from api.routes import (
    admin,
    admin_keys,
    batches,
    dashboard,
    files,
    health,
    message_batches,
    metrics,
    models,
    usage,
    webhooks,
)
from api.services import keys
from api.surrogates import LoneSurrogateMiddleware
from offpeak import __version__
from offpeak.settings import Settings, get_settings
from storage import sealing
from storage.db import session_scope


def create_app(settings: Settings | None = None) -> FastAPI:
    """The intake app. Expects a migrated database (``offpeak migrate``). Raises
    ``storage.sealing.MissingKeyError`` for a server database without ``secret_keys``."""
    settings = settings or get_settings()
    sealing.configure(sealing.keys_for(settings))
    reader = Reader(settings.resolved_database_url)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        current, head = migrations.revisions(settings.resolved_database_url)
        if current != head:
            # Refuse to serve on a schema the code does not match: every request would fail.
            raise RuntimeError(
                f"the database is at schema revision {current}, this code needs {head}: "
                "run `offpeak migrate` first"
            )
        if settings.local_api_key:
            with session_scope(settings.resolved_database_url) as session:
                keys.ensure_key(session, "local", settings.local_api_key)
        yield
        reader.close()

    app = FastAPI(title="Offpeak", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.reader = reader
    install_error_handlers(app)
    # Added first, so it runs inside the body limit: it buffers only bodies under that limit.
    app.add_middleware(LoneSurrogateMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_file_bytes=settings.max_file_bytes)
    # Outermost: no body is read, buffered or parsed before the key is checked.
    app.add_middleware(KeyGateMiddleware, settings=settings)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(webhooks.router)
    app.include_router(message_batches.router)
    app.include_router(models.router)
    app.include_router(admin.router)
    app.include_router(admin.tenants_router)
    app.include_router(admin.adapters_router)
    app.include_router(admin_keys.router)
    app.include_router(usage.router)
    app.include_router(metrics.router)
    app.include_router(dashboard.router)
    app.include_router(health.router)
    return app
