"""The batch endpoints' records through finalize on the database: a second finalize writes the same
bytes."""

from __future__ import annotations

import time

import orjson
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.app import create_app
from api.services import batches as batches_service
from offpeak.settings import ModelConfig, Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from storage.repositories import requests as requests_repo
from tests.support.batches import check_ran_batch, line, validate
from tests.support.database import new_key
from workers import engine_io
from workers import finalize as finalize_module
from workers.engine.instant import InstantEngine
from workers.engine_io import LineError
from workers.finalize import _write_files, finalize
from workers.runner import results

MODEL = "endpoints-model"


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"models": {MODEL: ModelConfig(engine="instant")}})


@pytest.fixture()
def sdk(settings: Settings) -> OpenAI:
    key = new_key(settings)
    client = TestClient(create_app(settings))
    return OpenAI(base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0)


def _file_bytes(settings: Settings, batch_id: str) -> tuple[bytes, bytes]:
    blobs = get_blob_store(settings.resolved_blob_url)
    out, err = (f"outputs/{batch_id}/{name}.jsonl" for name in ("output", "errors"))
    return b"".join(blobs.iter_chunks(out)), b"".join(blobs.iter_chunks(err))


def test_finalizing_again_writes_the_same_bytes(
    settings: Settings, sdk: OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three lines run (two answered, one failed alone), two never run (the batch is cancelled):
    writing the files a second time — a finalize that crashed after writing them — must not
    change a byte, ids included; nor the size of the pieces the lines are written in (the
    second time one line a piece)."""
    lines = [
        line("ok", model=MODEL, body_logprobs=True, body_n=2),
        line("hot", model=MODEL, body_temperature=5),
        line("done", model=MODEL),
        line("never-1", model=MODEL),
        line("never-2", model=MODEL),
    ]
    tenant_name = _tenant_of(settings, sdk)
    batch, _ = validate(settings, b"\n".join(lines), tenant_name=tenant_name)
    url, blobs, at = (
        settings.resolved_database_url,
        get_blob_store(settings.resolved_blob_url),
        time.time(),
    )
    engine = InstantEngine(MODEL)
    with session_scope(url) as session:
        claimed = requests_repo.claim(
            session, model=MODEL, limit=3, owner="w1", lease_until=at + 60, at=at,
            batch_ids=[batch.id],
        )  # fmt: skip
    finished, ready = [], {}
    for row in claimed:
        body = orjson.loads(row.line_json)["body"]
        try:
            prepared = engine_io.prepare(str(row.id), CHAT, body, engine)
        except LineError as exc:
            finished.append(results.failed(row, exc, at))
            continue
        engine.add(prepared.request)
        ready[prepared.request.request_id] = (row, prepared)
    for result in engine.step():
        row, prepared = ready[result.request_id]
        finished.append(results.succeeded(row, prepared, result, 1_700_000_000, at))
    with session_scope(url) as session:
        requests_repo.write_results(session, "w1", finished)
    with session_scope(url) as session:
        batches_service.cancel(session, settings, batch.tenant_id, batch.id)
        session.info.pop("after_commit", None)
    assert finalize(settings, blobs, batch.id).done
    ended = sdk.batches.retrieve(batch.id)
    output, errors = check_ran_batch(sdk, ended, ["ok", "hot", "done", "never-1", "never-2"])
    assert ended.status == "cancelled" and len(output) == 2 and len(errors) == 3
    assert len(output[0]["response"]["body"]["choices"]) == 2
    first = _file_bytes(settings, batch.id)
    monkeypatch.setattr(finalize_module._Lines, "PIECE_LINES", 1)
    with session_scope(url) as session:
        again = batches_repo.lock(session, batch.id)
        assert again is not None
        _write_files(session, blobs, again)
        assert (again.output_file_id, again.error_file_id) == (
            ended.output_file_id,
            ended.error_file_id,
        )
    assert _file_bytes(settings, batch.id) == first
    served = sdk.files.content(ended.output_file_id).content  # type: ignore[arg-type]
    assert served == first[0]


def _tenant_of(settings: Settings, sdk: OpenAI) -> str:
    from api.services.keys import tenant_for_key

    with session_scope(settings.resolved_database_url) as session:
        tenant = tenant_for_key(session, sdk.api_key)
        assert tenant is not None
        return tenant.name
