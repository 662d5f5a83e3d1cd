"""The API while its database is down, for real: this module's own PostgreSQL server
(``tests.support.servers.own_postgres``) is stopped under an API in process, and started again.

- Every ``/v1`` route that needs the database answers 503 in the surface's error shape, with
  ``Retry-After``, and logs one warning line (no traceback); the official SDKs read it as a
  retryable server error.
- An upload refused by the outage leaves nothing: no File row, no stored bytes.
- Once the server is back, the same process answers again (its pools drop the dead
  connections), with what was stored before intact.
- Which database errors mean "unavailable" (``storage.errors.is_unavailable``), on errors the
  server really raises: a refused connection, a dropped one, an exhausted pool; a statement that
  is wrong is not one of them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import psycopg
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import create_engine, func, select, text
from sqlalchemy.exc import (
    DBAPIError,
    IntegrityError,
    OperationalError,
    ProgrammingError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout

import migrations
from api.app import create_app
from offpeak.settings import Settings
from storage.db import get_engine, get_read_engine, session_scope
from storage.errors import is_unavailable
from storage.models import Batch, File
from tests.support.database import new_key
from tests.support.servers import PostgresServer

LINE = (
    b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}}\n'
)


@pytest.fixture(scope="module")
def outage_settings(
    settings: Settings,
    run_id: str,
    own_postgres: PostgresServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Settings]:
    """Settings on a database of the module's own server (migrated), a data folder and a queue
    prefix of its own (no worker consumes the tasks the API sends)."""
    url = own_postgres.create_database("offpeak_outage")
    migrations.upgrade(url)
    yield settings.model_copy(
        update={
            "database_url": url,
            "queue_prefix": f"{run_id}-outage",
            "data_dir": tmp_path_factory.mktemp("outage-data"),
        }
    )
    # This process's pools, before the module's server goes away.
    get_engine(url).dispose()
    get_read_engine(url).dispose()


@pytest.fixture()
def database_up(own_postgres: PostgresServer) -> Iterator[PostgresServer]:
    """The module's server, started again after the test whatever happened in it."""
    yield own_postgres
    if not own_postgres.running():
        own_postgres.start()


def stored_blobs(settings: Settings) -> list[str]:
    """Every file under the blob store's folder, temporary ones included."""
    root = Path(settings.resolved_blob_url)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def openai_503(response: Any) -> str:
    """The message of a 503 in OpenAI's shape with ``Retry-After``."""
    assert response.status_code == 503, response.text
    assert 1 <= int(response.headers["Retry-After"]) <= 30
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == "database_unavailable"
    assert error["param"] is None and "retry" in error["message"].lower()
    return str(error["message"])


def test_database_outage_answers_503_and_the_api_recovers(
    outage_settings: Settings, database_up: PostgresServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = outage_settings
    url = settings.resolved_database_url
    # Server errors answered as the client sees them (a 500), not raised into the test.
    with TestClient(create_app(settings), raise_server_exceptions=False) as http:
        key, unused_key = new_key(settings), new_key(settings)
        auth = {"Authorization": f"Bearer {key}"}
        sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0)
        claude = anthropic.Anthropic(
            base_url="http://testserver", api_key=key, http_client=http, max_retries=0
        )
        file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch").id
        batch = sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        files_before = [f.id for f in sdk.files.list().data]
        blobs_before = stored_blobs(settings)
        create = {
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }

        database_up.stop("fast")
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            # The official SDK: a 503 is an InternalServerError (it would retry it by itself).
            with pytest.raises(openai.InternalServerError) as caught:
                sdk.batches.retrieve(batch.id)
            assert caught.value.status_code == 503
            openai_503(caught.value.response)
            openai_503(http.get("/v1/batches", headers=auth))
            openai_503(http.get("/v1/files", headers=auth))
            openai_503(
                http.post(
                    "/v1/files",
                    headers=auth,
                    files={"file": ("again.jsonl", LINE)},
                    data={"purpose": "batch"},
                )
            )
            openai_503(http.post("/v1/batches", headers=auth, json=create))
            # A key this process has not cached: the outage, not a 401.
            openai_503(http.get("/v1/models", headers={"Authorization": f"Bearer {unused_key}"}))
            # Anthropic's surface: its own error shape.
            with pytest.raises(anthropic.InternalServerError) as anthropic_caught:
                claude.messages.batches.list()
            response = anthropic_caught.value.response
            assert response.status_code == 503 and int(response.headers["Retry-After"]) >= 1
            assert response.json() == {
                "type": "error",
                "error": {"type": "api_error", "message": response.json()["error"]["message"]},
            }
            assert "retry" in response.json()["error"]["message"].lower()
        refused = [r for r in caplog.records if r.name.startswith("api.")]
        assert len(refused) == 7, [r.getMessage() for r in caplog.records]
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in refused)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        # The refused upload left no bytes behind (nor a temporary file).
        assert stored_blobs(settings) == blobs_before

        database_up.start()
        # The same process, the same requests: its pools drop the dead connections by themselves.
        assert sdk.batches.retrieve(batch.id).id == batch.id
        assert [b.id for b in sdk.batches.list().data] == [batch.id]
        assert [f.id for f in sdk.files.list().data] == files_before
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {unused_key}"}).is_success
        assert claude.messages.batches.list().data == []
        with session_scope(url) as session:
            assert session.scalar(select(func.count()).select_from(File)) == 1
            assert session.scalar(select(func.count()).select_from(Batch)) == 1
        assert sdk.files.content(file_id).content == LINE
        # The client's retry of what the outage refused now succeeds.
        again = sdk.files.create(file=("again.jsonl", io.BytesIO(LINE)), purpose="batch")
        assert sdk.files.content(again.id).content == LINE
        assert sdk.batches.create(**create).input_file_id == file_id  # type: ignore[arg-type]


def raised(call: Any) -> SQLAlchemyError:
    with pytest.raises(SQLAlchemyError) as caught:
        call()
    return caught.value


def test_which_database_errors_mean_unavailable(
    outage_settings: Settings, database_up: PostgresServer
) -> None:
    url = outage_settings.resolved_database_url
    engine = create_engine(url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        with engine.connect() as connection:
            # Statements that are wrong: our bugs, never a 503.
            assert not is_unavailable(raised(lambda: connection.execute(text("SELECT nope"))))
            connection.rollback()
            insert = text("INSERT INTO tenants (id, name, created_at) VALUES ('x', 'x', 0)")
            connection.execute(insert)
            error = raised(lambda: connection.execute(insert))
            assert isinstance(error, IntegrityError) and not is_unavailable(error)
            connection.rollback()
            assert not is_unavailable(raised(lambda: connection.execute(text("SELECT 1/0"))))
            connection.rollback()
            # The pool's one connection is taken: the pool's TimeoutError.
            pool_error = raised(engine.connect)
            assert isinstance(pool_error, PoolTimeout) and is_unavailable(pool_error)
            # Dropped under an open connection: SQLAlchemy sees it and invalidates it.
            pid = connection.scalar(text("SELECT pg_backend_pid()"))
            with psycopg.connect(database_up.url("offpeak_outage", driver="postgresql")) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            dropped = raised(lambda: connection.execute(text("SELECT 1")))
            assert is_unavailable(dropped)
        database_up.stop("fast")
        refused = raised(engine.connect)
        assert isinstance(refused, DBAPIError) and is_unavailable(refused)
        assert isinstance(refused.orig, psycopg.OperationalError)
    finally:
        engine.dispose()
    assert not is_unavailable(ProgrammingError("SELECT", {}, Exception("bug")))


def test_only_an_unavailable_database_is_a_503(settings: Settings) -> None:
    """The handler's two ways, on errors of the classes it catches: a deadlock (psycopg's
    ``OperationalError``, SQLSTATE 40P01) is a fault of ours and stays a 500; a refused
    connection is a 503."""
    app = create_app(settings)
    deadlock = psycopg.errors.DeadlockDetected("deadlock detected")
    refused = psycopg.OperationalError("connection failed: Connection refused")

    def raise_(error: Exception) -> Any:
        def route() -> None:
            raise OperationalError("SELECT 1", {}, error)

        return route

    # Outside /v1, so no key is needed (``api.key_gate``): the routes are about the handler.
    app.add_api_route("/probe/deadlock", raise_(deadlock))
    app.add_api_route("/probe/refused", raise_(refused))
    http = TestClient(app, raise_server_exceptions=False)  # no lifespan: no database needed
    assert http.get("/probe/deadlock").status_code == 500
    openai_503(http.get("/probe/refused"))


class SilentProxy:
    """A TCP proxy on 127.0.0.1 to ``port``; once ``silence()``d it still takes connections but
    passes nothing either way, as a hung host or a half-open network does."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.silent = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.sockets: list[socket.socket] = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            self.sockets.append(client)
            if self.silent.is_set():
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if self.silent.is_set():
                    return
                sink.sendall(data)

    def silence(self) -> None:
        self.silent.set()

    def close(self) -> None:
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.close()


def test_a_database_that_never_answers_is_a_503_not_a_hung_request(
    outage_settings: Settings, own_postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database's host stops answering while the API runs (a hung host, a half-open
    network: a proxy in front of the module's server takes connections and passes nothing).
    libpq would wait for the server's first message forever, holding the request's thread;
    with ``storage.db.CONNECT_TIMEOUT_SECONDS`` (1 s here) the request answers 503 instead. The
    request runs in a thread, so that a hang fails the test rather than stalling the run."""
    from storage import db

    monkeypatch.setattr(db, "CONNECT_TIMEOUT_SECONDS", 1)
    proxy = SilentProxy(own_postgres.port)
    database = outage_settings.resolved_database_url.rsplit("/", 1)[1]
    url = f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{database}"
    answers: list[Any] = []
    try:
        settings = outage_settings.model_copy(update={"database_url": url})
        key = new_key(settings)
        with TestClient(create_app(settings), raise_server_exceptions=False) as http:
            headers = {"Authorization": f"Bearer {key}"}
            assert http.get("/v1/batches", headers=headers).status_code == 200
            get_engine(url).dispose()  # the pools' next connections are new ones
            get_read_engine(url).dispose()
            proxy.silence()

            def poll() -> None:
                answers.append(http.get("/v1/batches", headers=headers))

            thread = threading.Thread(target=poll, daemon=True)
            thread.start()
            thread.join(timeout=60)
    finally:
        proxy.close()
        get_engine(url).dispose()
        get_read_engine(url).dispose()
    assert answers, "the request hung on a database that never answers"
    response = answers[0]
    assert response.status_code == 503 and response.headers["retry-after"] == "5"
    assert response.json()["error"]["code"] == "database_unavailable"


def test_an_api_starting_on_a_database_that_never_answers_fails_instead_of_hanging(
    outage_settings: Settings, own_postgres: PostgresServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API's start reads the schema revision (``migrations.revisions``, an engine of its
    own): on a silent database it fails with the connect timeout (1 s here) and says why,
    rather than waiting forever before its first request."""
    from storage import db

    monkeypatch.setattr(db, "CONNECT_TIMEOUT_SECONDS", 1)
    proxy = SilentProxy(own_postgres.port)
    proxy.silence()
    database = outage_settings.resolved_database_url.rsplit("/", 1)[1]
    url = f"postgresql+psycopg://postgres@127.0.0.1:{proxy.port}/{database}"
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            with TestClient(create_app(outage_settings.model_copy(update={"database_url": url}))):
                outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    try:
        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        thread.join(timeout=60)
    finally:
        proxy.close()
    assert outcome, "the API's start hung on a database that never answers"
    assert isinstance(outcome[0], OperationalError), outcome
