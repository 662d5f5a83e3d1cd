"""The wire JSON on the database and the in-process API: a row gives what its ORM object gives,
retrieve answers the bytes create and cancel answer, file content streams."""

from __future__ import annotations

import io

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.schemas.batches import BatchObject, batch_json
from api.schemas.common import column_values
from api.services import files as files_service
from offpeak.settings import Settings
from storage.blobs import CHUNK_BYTES, get_blob_store
from storage.db import read, session_scope
from storage.models import File
from storage.repositories import batches as batches_repo
from storage.repositories import files as files_repo
from tests.integration.test_api import LINE
from tests.unit.test_wire_json import CHANGES, ODD, T0, _batch


def test_a_row_gives_what_its_orm_object_gives(
    http: TestClient, sdk: OpenAI, settings: Settings
) -> None:
    """The poll's Core row (``batches.poll_row``, with the bill's columns) and the ``Batch`` of
    the same database row give the same dict: the row's columns are named as the model's
    attributes, JSON columns come back as the same values."""
    tenant_id = _tenant_of(settings, sdk)
    url = settings.resolved_database_url
    headers = {"Authorization": f"Bearer {sdk.api_key}"}
    for n, changes in enumerate(CHANGES):
        batch_id = f"batch_wirerow{n}{tenant_id[-8:]}"
        with session_scope(url) as session:
            session.add(_batch(**changes, id=batch_id, tenant_id=tenant_id))
        row = read(url, batches_repo.poll_row, tenant_id, batch_id)
        assert row is not None and row["billed_at"] is None
        with session_scope(url) as session:
            stored = batches_repo.get(session, tenant_id, batch_id)
            assert stored is not None
            assert batch_json(row) == batch_json(column_values(stored))
            # The same statement through SQLAlchemy (a session: no driver's cursor) gives the
            # same values of the same types.
            through = batches_repo.poll_row(session, tenant_id, batch_id)
            assert through is not None
            assert list(through.items()) == list(row.items())
            assert [type(v) for v in through.values()] == [type(v) for v in row.values()]
        polled = http.get(f"/v1/batches/{batch_id}", headers=headers)
        assert polled.status_code == 200
        expected = BatchObject.of(_batch(**changes)).model_dump()
        assert polled.json()["metadata"] == expected["metadata"]
        assert polled.json()["errors"] == expected["errors"]
        assert polled.json()["estimate"] == expected["estimate"]


def _tenant_of(settings: Settings, sdk: OpenAI) -> str:
    file = sdk.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
    with session_scope(settings.resolved_database_url) as session:
        stored = files_repo.get_any(session, file.id)
        assert stored is not None
        return stored.tenant_id


def test_retrieve_answers_the_bytes_create_and_cancel_answer(http: TestClient, sdk: OpenAI) -> None:
    """Create and cancel answer through the pydantic model; retrieve, right after each, must
    answer the same bytes (the same batch, nothing changed in between)."""
    headers = {"Authorization": f"Bearer {sdk.api_key}"}
    file = sdk.files.create(file=("in.jsonl", io.BytesIO(LINE)), purpose="batch")
    body = {
        "input_file_id": file.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": {"team": ODD},
    }
    created = http.post("/v1/batches", json=body, headers=headers)
    assert created.status_code == 200
    batch_id = created.json()["id"]
    retrieved = http.get(f"/v1/batches/{batch_id}", headers=headers)
    assert retrieved.content == created.content
    assert retrieved.headers["content-type"] == created.headers["content-type"]
    listed = http.get("/v1/batches?limit=1", headers=headers)
    assert listed.json()["data"] == [created.json()]
    assert listed.content.startswith(b'{"object":"list","data":[' + created.content + b"]")
    cancelled = http.post(f"/v1/batches/{batch_id}/cancel", headers=headers)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    assert http.get(f"/v1/batches/{batch_id}", headers=headers).content == cancelled.content
    uploaded = http.post(
        "/v1/files",
        files={"file": ("in.jsonl", io.BytesIO(LINE))},
        data={"purpose": "batch"},
        headers=headers,
    )
    assert uploaded.status_code == 200
    got = http.get(f"/v1/files/{uploaded.json()['id']}", headers=headers)
    assert got.content == uploaded.content


@pytest.mark.parametrize(
    "size",
    [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES, 2 * CHUNK_BYTES + 7],
)
def test_content_reads_ahead_and_streams_the_rest(
    http: TestClient, sdk: OpenAI, settings: Settings, size: int
) -> None:
    """Content reads up to ``READ_AHEAD`` pieces with the file's row and streams the rest: every
    size around the pieces' edges comes back whole. A file read whole with its row is answered
    in one response that states its length; a longer one is streamed."""
    data = (LINE * (size // len(LINE) + 1))[:size]
    file_id = _stored_file(settings, sdk, data)
    response = http.get(
        f"/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {sdk.api_key}"}
    )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.content == data
    head, rest = read(
        settings.resolved_database_url,
        files_service.content,
        get_blob_store(settings.resolved_blob_url),
        _tenant_of(settings, sdk),
        file_id,
    )
    streamed = b"".join(head) + (b"".join(rest) if rest is not None else b"")
    assert streamed == data
    # All read with the row when its end came within READ_AHEAD reads (the last found nothing).
    assert (rest is None) == (size <= (files_service.READ_AHEAD - 1) * CHUNK_BYTES)
    if rest is None:
        assert response.headers["content-length"] == str(size)
    else:  # streamed: its length is not known when the answer starts
        assert "content-length" not in response.headers


def _stored_file(settings: Settings, sdk: OpenAI, data: bytes) -> str:
    """A file of the tenant's with these bytes, written as finalize writes output files (any
    bytes, any size: uploads insist on UTF-8 JSONL)."""
    tenant_id = _tenant_of(settings, sdk)
    file_id = f"file-wire{len(data)}{tenant_id[-6:]}"
    blobs = get_blob_store(settings.resolved_blob_url)
    with blobs.writer(f"files/{file_id}") as out:
        out.write(data)
    with session_scope(settings.resolved_database_url) as session:
        files_repo.add(
            session,
            File(id=file_id, tenant_id=tenant_id, filename="out.jsonl", purpose="batch_output",
                 bytes=len(data), status="processed", blob_key=f"files/{file_id}",
                 created_at=T0, expires_at=None, deleted=False),
        )  # fmt: skip
    return file_id


def test_content_of_a_file_whose_bytes_are_gone_is_404(
    http: TestClient, sdk: OpenAI, settings: Settings
) -> None:
    file_id = _stored_file(settings, sdk, b"gone\n")
    get_blob_store(settings.resolved_blob_url).delete(f"files/{file_id}")
    response = http.get(
        f"/v1/files/{file_id}/content", headers={"Authorization": f"Bearer {sdk.api_key}"}
    )
    assert response.status_code == 404
    assert response.json()["error"] == {
        "message": f"The content of {file_id} is no longer stored.",
        "type": "invalid_request_error",
        "param": "file_id",
        "code": "not_found",
    }
