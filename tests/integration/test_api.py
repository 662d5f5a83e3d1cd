"""The HTTP contract through the official OpenAI SDK against the in-process API: files, batches,
errors in OpenAI's shape, pagination and tenant isolation. No worker runs here."""

from __future__ import annotations

import io

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.app import create_app
from offpeak.settings import Settings
from tests.support.database import new_key

LINE = (
    b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
    b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}}\n'
)


def upload(sdk: OpenAI, data: bytes = LINE, name: str = "in.jsonl"):  # type: ignore[no-untyped-def]
    return sdk.files.create(file=(name, io.BytesIO(data)), purpose="batch")


def error_of(exc: openai.APIStatusError) -> dict[str, object]:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_file_lifecycle(sdk: OpenAI) -> None:
    file = upload(sdk)
    assert file.id.startswith("file-") and file.bytes == len(LINE) and file.purpose == "batch"
    assert file.filename == "in.jsonl" and file.expires_at == file.created_at + 30 * 86400
    assert sdk.files.retrieve(file.id).bytes == len(LINE)
    assert sdk.files.content(file.id).read() == LINE
    assert sdk.files.delete(file.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(file.id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.content(file.id)


def test_files_pagination(sdk: OpenAI) -> None:
    ids = [upload(sdk).id for _ in range(5)]
    page = sdk.files.list(limit=2, order="asc")
    assert [f.id for f in page.data] == ids[:2] and page.has_more
    second = sdk.files.list(limit=2, order="asc", after=page.data[-1].id)
    assert [f.id for f in second.data] == ids[2:4] and second.has_more
    assert [f.id for f in page] == ids  # the SDK follows has_more/after by itself
    assert [f.id for f in sdk.files.list(order="desc")] == ids[::-1]
    assert [f.id for f in sdk.files.list(purpose="batch_output")] == []


def test_upload_not_utf8_is_400_and_stores_nothing(sdk: OpenAI) -> None:
    utf16 = LINE.decode().encode("utf-16")
    with pytest.raises(openai.BadRequestError) as info:
        upload(sdk, utf16)
    error = error_of(info.value)
    assert "UTF-8" in str(error["message"]) and "UTF-16" in str(error["message"])
    assert sdk.files.list().data == []


def test_upload_bad_purpose(sdk: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.files.create(file=("x.jsonl", io.BytesIO(LINE)), purpose="fine-tune")
    assert error_of(info.value)["param"] == "purpose"


def test_upload_over_limit_is_413(settings: Settings) -> None:
    small = settings.model_copy(update={"max_file_bytes": 100})
    with TestClient(create_app(small)) as http:
        sdk = OpenAI(
            base_url="http://testserver/v1", api_key=new_key(small), http_client=http, max_retries=0
        )
        with pytest.raises(openai.APIStatusError) as info:
            upload(sdk, LINE * 3)
        assert info.value.status_code == 413
        assert sdk.files.list().data == []


def test_auth(http: TestClient) -> None:
    assert http.get("/v1/files").status_code == 401
    response = http.get("/v1/files", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


def test_tenant_isolation(sdk: OpenAI, http: TestClient, settings: Settings) -> None:
    file = upload(sdk)
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    other = OpenAI(
        base_url="http://testserver/v1", api_key=new_key(settings), http_client=http, max_retries=0
    )
    for call in (
        lambda: other.files.retrieve(file.id),
        lambda: other.files.content(file.id),
        lambda: other.files.delete(file.id),
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    # Another tenant's file is an unknown one: as at OpenAI the batch is created and its
    # validation fails it (tests/integration/test_quotas.py), reading nothing of the file.
    taken = other.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert taken.status == "validating"
    assert other.files.list().data == []
    assert [b.id for b in other.batches.list().data] == [taken.id]
    assert sdk.files.retrieve(file.id).id == file.id  # untouched by the other tenant


def test_batch_create_and_shape(sdk: OpenAI) -> None:
    file = upload(sdk)
    batch = sdk.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"team": "search"},
    )
    assert batch.id.startswith("batch_") and batch.status == "validating"
    assert batch.expires_at == batch.created_at + 86400
    assert batch.metadata == {"team": "search"}
    assert batch.request_counts.total == 0 and batch.usage.total_tokens == 0
    assert batch.errors is None and batch.output_file_id is None
    assert sdk.batches.retrieve(batch.id).model_dump() == batch.model_dump()


@pytest.mark.parametrize(
    ("change", "status", "param"),
    [
        ({"completion_window": "5m"}, 400, "completion_window"),
        ({"endpoint": "/v1/moderations"}, 400, "endpoint"),
        ({"endpoint": "/v2/nothing"}, 400, "endpoint"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
        ({"metadata": {"k": "v" * 513}}, 400, "metadata"),
        ({"metadata": {"k": 3}}, 400, "metadata"),
    ],
)
def test_batch_create_errors(
    sdk: OpenAI, change: dict[str, object], status: int, param: str
) -> None:
    file = upload(sdk)
    args: dict[str, object] = {
        "input_file_id": file.id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **change,
    }
    with pytest.raises(openai.APIStatusError) as info:
        sdk.batches.create(**args)  # type: ignore[arg-type]
    assert info.value.status_code == status
    assert error_of(info.value)["param"] == param
    assert sdk.batches.list().data == []


def test_batch_create_malformed_bodies(http: TestClient, api_key: str) -> None:
    headers = {"Authorization": f"Bearer {api_key}"}
    missing = http.post("/v1/batches", json={"endpoint": "/v1/chat/completions"}, headers=headers)
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "input_file_id"
    garbage = http.post(
        "/v1/batches", content=b"{not json", headers={**headers, "Content-Type": "application/json"}
    )
    assert garbage.status_code == 422
    assert garbage.json()["error"]["message"]


def test_batch_list_pagination(sdk: OpenAI) -> None:
    file = upload(sdk)
    ids = [
        sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(5)
    ]
    page = sdk.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    assert [b.id for b in page] == ids[::-1]
    with pytest.raises(openai.BadRequestError):
        sdk.batches.list(limit=101)


def test_cancel_states(sdk: OpenAI, settings: Settings) -> None:
    file = upload(sdk)
    batch = sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    cancelled = sdk.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at is not None
    assert sdk.batches.cancel(batch.id).status == "cancelling"  # idempotent
    from storage.db import session_scope
    from storage.repositories import batches as batches_repo

    for ended in ("cancelled", "completed"):  # finished: 409, as the contract says
        with session_scope(settings.resolved_database_url) as session:
            row = batches_repo.get_any(session, batch.id)
            assert row is not None
            row.status = ended
        with pytest.raises(openai.ConflictError):
            sdk.batches.cancel(batch.id)


def test_models(sdk: OpenAI) -> None:
    # The chat model and the embedding model (/v1/embeddings), both served by default.
    assert [m.id for m in sdk.models.list()] == ["SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"]


def test_unknown_route_is_404_in_openai_shape(http: TestClient, api_key: str) -> None:
    response = http.get("/v1/nothing", headers={"Authorization": f"Bearer {api_key}"})
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_oversized_bodies_are_refused_before_they_are_read(settings: Settings) -> None:
    small = settings.model_copy(update={"max_file_bytes": 100})
    with TestClient(create_app(small)) as http:
        headers = {"Authorization": f"Bearer {new_key(small)}"}
        declared = http.post(
            "/v1/files", headers={**headers, "Content-Length": str(10**9)}, content=b"x" * 10
        )
        assert declared.status_code == 413
        assert declared.json()["error"]["code"] == "request_too_large"

        def stream():  # a well-formed multipart upload with no Content-Length (chunked)
            yield (
                b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
                b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'
                b"Content-Type: application/octet-stream\r\n\r\n"
            )
            for _ in range(200):
                yield LINE * 4
            yield b"\r\n--b--\r\n"

        multipart = {**headers, "Content-Type": "multipart/form-data; boundary=b"}
        chunked = http.post("/v1/files", headers=multipart, content=stream())
        # refused by the limit on the stream (request_too_large), not after spooling the whole
        # upload (the service's file_too_large)
        assert chunked.status_code == 413
        assert chunked.json()["error"]["code"] == "request_too_large"
        big_json = http.post(
            "/v1/batches",
            headers=headers,
            content=b" " * (2 << 20),
        )
        assert big_json.status_code == 413


def test_nul_characters_are_client_errors(sdk: OpenAI, http: TestClient, api_key: str) -> None:
    headers = {"Authorization": f"Bearer {api_key}"}
    for path in (
        "/v1/batches/batch_%00",
        "/v1/files/file-%00",
        "/v1/batches?after=%00",
        "/v1/files?purpose=%00",
    ):
        response = http.get(path, headers=headers)
        assert response.status_code in (400, 404), (path, response.text)
        assert response.json()["error"]["message"]
    file = upload(sdk)
    response = http.post(
        "/v1/batches",
        headers=headers,
        json={
            "input_file_id": file.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"k": "a\x00b"},
        },
    )
    assert response.status_code == 400
    long_name = http.post(
        "/v1/files",
        headers=headers,
        data={"purpose": "batch"},
        files={"file": ("n" * 600 + ".jsonl", LINE)},
    )
    assert long_name.status_code == 400 and long_name.json()["error"]["param"] == "file"


def test_body_that_is_not_an_object(http: TestClient, api_key: str) -> None:
    response = http.post("/v1/batches", headers={"Authorization": f"Bearer {api_key}"}, json=[1, 2])
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "The request body must be a JSON object."


def test_api_refuses_to_start_on_an_unmigrated_database(tmp_path) -> None:  # type: ignore[no-untyped-def]
    empty = Settings(database_url=f"sqlite:///{tmp_path / 'empty.db'}", data_dir=tmp_path)
    with pytest.raises(RuntimeError, match="offpeak migrate"), TestClient(create_app(empty)):
        pass
