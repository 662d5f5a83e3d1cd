"""The reads users poll answer from plain dicts (``api.schemas.batches.batch_json``,
``api.schemas.files.file_json``, written by orjson: ``api.responses.WireJSON``) and from rows
rather than ORM objects: their bytes must be what the pydantic models (``BatchObject``,
``FileObject``, which the routes declare and create and cancel still answer with) serialize to,
field for field, type for type (a float where the model has a float), in the model's order."""

from __future__ import annotations

import io
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.schemas.batches import BatchObject, batch_json
from api.schemas.common import column_values
from api.schemas.files import FileObject, file_json
from api.services import files as files_service
from offpeak.billing import Bill
from offpeak.settings import Settings
from storage.blobs import CHUNK_BYTES, get_blob_store
from storage.db import read, session_scope
from storage.models import Batch, File
from storage.repositories import batches as batches_repo
from storage.repositories import files as files_repo
from tests.test_api import LINE

T0 = 1_764_000_000


def _batch(**changes: Any) -> Batch:
    values: dict[str, Any] = dict(
        id="batch_wire",
        tenant_id="t",
        endpoint="/v1/chat/completions",
        model="m",
        input_file_id="file-in",
        completion_window="24h",
        status="completed",
        output_file_id="file-out",
        error_file_id=None,
        errors=None,
        metadata_=None,
        created_at=T0,
        in_progress_at=T0 + 1,
        expires_at=T0 + 86_400,
        finalizing_at=T0 + 5,
        completed_at=T0 + 6,
        failed_at=None,
        expired_at=None,
        cancelling_at=None,
        cancelled_at=None,
        total=200,
        completed=199,
        failed=1,
        input_tokens=12_345,
        cached_tokens=100,
        output_tokens=6_789,
        estimated_completion_at=None,
        estimate=None,
    )
    values.update(changes)
    return Batch(**values)


#: Odd strings JSON writers may escape differently: controls, quotes, non-ASCII, U+2028 (no
#: NUL: PostgreSQL's JSONB refuses it, so no row can hold one).
ODD = 'a"b\\c/d\x01\x1f\x7f\u00e9\u2028\u2029\U0001f600\t\n'

#: Batches that differ where the wire format has choices: errors, metadata, estimate, schedule.
CHANGES: list[dict[str, Any]] = [
    {},
    dict(
        status="failed",
        output_file_id=None,
        failed_at=T0 + 2,
        errors=[
            {"code": "invalid_json_line", "message": ODD, "line": 3},
            {"code": "empty_file", "message": "m", "param": "input_file_id", "line": None},
            {"code": "x", "message": "extra keys are dropped", "param": None, "extra": 1},
        ],
    ),
    dict(metadata_={"k": ODD, ODD: "v", "": ""}),
    # Running, with the scheduler's estimate; a float eta and a whole-number one.
    dict(status="in_progress", completed_at=None, estimated_completion_at=T0 + 1000.75),
    dict(status="in_progress", completed_at=None, estimated_completion_at=float(T0 + 90_000)),
    # An estimate whose prices are whole numbers in JSON (0, 1) and whose counts are floats.
    dict(
        estimate={
            "prompt_tokens": 12.0,
            "max_completion_tokens": 20_000,
            "price_low": 0,
            "price_high": 1,
            "requests": 200,
            "invalid_requests": 0.0,
            "unknown": "ignored",
        }
    ),
    dict(
        estimate={
            "prompt_tokens": 1,
            "max_completion_tokens": 2,
            "price_low": 4.31e-05,
            "price_high": 1e22,
            "requests": 1,
            "invalid_requests": 0,
        }
    ),
    dict(status="validating", in_progress_at=None, completed_at=None, total=0, completed=0),
]
BATCHES = [_batch(**changes) for changes in CHANGES]

BILLS = [
    None,
    # A live estimate with no engine time yet: whole-number amounts (billing.bill's sums).
    Bill(gpu_seconds=0, cost=0, price=0, realtime_price=0, tokens=0),
    Bill(
        gpu_seconds=3.1234567,
        cost=4.31e-05,
        price=0.0012345,
        realtime_price=0.002469,
        tokens=19_134,
        billed_at=T0 + 7.25,
    ),  # fmt: skip
    Bill(gpu_seconds=1e-7, cost=1e-10, price=123456.5, realtime_price=246913, tokens=5),
]


@pytest.mark.parametrize("bill", BILLS, ids=lambda b: "no bill" if b is None else repr(b.cost))
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"{b.status}-{len(b.errors or ())}")
def test_batch_json_is_the_models_json(batch: Batch, bill: Bill | None) -> None:
    model = BatchObject.of(batch, bill).model_dump_json().encode()
    assert orjson.dumps(batch_json(column_values(batch), bill)) == model


def test_file_json_is_the_models_json() -> None:
    for expires_at in (None, T0 + 3600):
        file = File(
            id="file-x",
            tenant_id="t",
            filename=ODD,
            purpose="batch_output",
            bytes=120_000,
            status="processed",
            blob_key="files/file-x",
            created_at=T0,
            expires_at=expires_at,
            deleted=False,
        )
        assert (
            orjson.dumps(file_json(column_values(file)))
            == FileObject.of(file).model_dump_json().encode()
        )


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
