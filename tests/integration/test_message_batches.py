"""Anthropic's Message Batches API through the official ``anthropic`` SDK, against the API in
process, without an engine: the envelope checks at create, the MessageBatch object, pages,
cancel, delete, results, auth by ``x-api-key``, errors in Anthropic's shape, and the
``/v1/messages`` endpoint module (params checked per request, the Message object rendered from
records, the result lines) with the instant engine standing in for the model.

The same lifecycle on the real model is in ``test_message_batches_engine.py``."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import orjson
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from api.schemas.message_batches import rfc3339
from offpeak.endpoints.errors import LineError
from offpeak.settings import Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import LedgerEntry, RequestLine
from storage.repositories import batches as batches_repo
from storage.repositories import requests as requests_repo
from tests.support.database import new_key
from workers import engine_io
from workers.billing import bill_batch
from workers.engine.instant import InstantEngine
from workers.finalize import finalize
from workers.runner import results
from workers.validation import run_validation


def _client(http: TestClient, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key=key, http_client=http, max_retries=0
    )


@pytest.fixture()
def claude(http: TestClient, api_key: str) -> anthropic.Anthropic:
    """The official Anthropic SDK on the in-process API (it sends the key as ``x-api-key``)."""
    return _client(http, api_key)


def _model(settings: Settings) -> str:
    return next(iter(settings.models))


def _request(custom_id: str, model: str, **params: Any) -> Any:
    body = {"model": model, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    return {"custom_id": custom_id, "params": {**body, **params}}


# --- The endpoint module: params, engine input, rendering -------------------------------------


# --- The API through the SDK ------------------------------------------------------------------


def test_create_retrieve_and_the_message_batch_object(
    claude: anthropic.Anthropic, settings: Settings
) -> None:
    model = _model(settings)
    batch = claude.messages.batches.create(
        requests=[_request("a", model), _request("b-2_x", model, stream=True)],  # type: ignore[list-item]
        extra_headers={"anthropic-version": "2023-06-01"},
    )
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress"
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored) == (2, 0, 0)
    assert (counts.canceled, counts.expired) == (0, 0)
    assert (batch.expires_at - batch.created_at).total_seconds() == 86_400
    assert batch.ended_at is None and batch.cancel_initiated_at is None
    assert batch.archived_at is None and batch.results_url is None
    again = claude.messages.batches.retrieve(batch.id)
    assert again.id == batch.id and again.created_at == batch.created_at
    assert rfc3339(0) == "1970-01-01T00:00:00Z"


@pytest.mark.parametrize(
    ("requests", "words"),
    [
        ([], "requests: List should have at least 1 item"),
        ([{"custom_id": "has space", "params": {}}], "requests.0.custom_id: must match"),
        ([{"custom_id": "x" * 65, "params": {}}], "requests.0.custom_id: must match"),
        (
            [{"custom_id": "a", "params": {}}, {"custom_id": "a", "params": {}}],
            "requests.1.custom_id",
        ),
        ([{"custom_id": "a"}], "requests.0.params: Field required"),
    ],
)
def test_a_bad_envelope_is_refused_in_anthropics_shape(
    claude: anthropic.Anthropic, requests: list[dict[str, Any]], words: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith(words)


def test_more_than_the_request_limit_is_refused(claude: anthropic.Anthropic) -> None:
    requests = [{"custom_id": f"r{i}", "params": {}} for i in range(100_001)]
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    assert "at most 100000 items" in caught.value.message


def test_auth_is_x_api_key_with_the_same_keys(http: TestClient, settings: Settings) -> None:
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _client(http, "sk-offpeak-wrong").messages.batches.list()
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid x-api-key"},
    }
    raw = http.get("/v1/messages/batches")
    assert (
        raw.status_code == 401 and raw.json()["error"]["message"] == "x-api-key header is required"
    )
    key = new_key(settings)
    bearer = anthropic.Anthropic(
        base_url="http://testserver", auth_token=key, http_client=http, max_retries=0
    )
    assert bearer.messages.batches.list().data == []
    # One key serves both surfaces.
    OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http).models.list()


def test_an_unknown_batch_is_anthropics_404(claude: anthropic.Anthropic, http: TestClient) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.batches.retrieve("msgbatch_nope")
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "No message batch found with id 'msgbatch_nope'.",
        },
    }
    with pytest.raises(anthropic.NotFoundError):  # an unknown path under the surface, too
        claude.get("/v1/messages/batches/msgbatch_nope/nothing", cast_to=object)


def test_list_is_newest_first_with_both_cursors(
    claude: anthropic.Anthropic, settings: Settings
) -> None:
    model = _model(settings)
    made = [claude.messages.batches.create(requests=[_request("a", model)]).id for _ in range(5)]  # type: ignore[list-item]
    newest = list(reversed(made))
    first = claude.messages.batches.list(limit=2)
    assert [b.id for b in first.data] == newest[:2] and first.has_more
    assert (first.first_id, first.last_id) == (newest[0], newest[1])
    assert [b.id for b in claude.messages.batches.list(limit=2)] == newest  # the SDK pages on
    after = claude.messages.batches.list(limit=10, after_id=newest[1])
    assert [b.id for b in after.data] == newest[2:] and not after.has_more
    before = claude.messages.batches.list(limit=2, before_id=newest[4])
    assert [b.id for b in before.data] == newest[2:4] and before.has_more
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.batches.list(limit=1001)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.batches.list(limit=0)


def test_each_surface_shows_only_its_own_batches(
    claude: anthropic.Anthropic, http: TestClient, api_key: str, settings: Settings
) -> None:
    import openai

    batch = claude.messages.batches.create(requests=[_request("a", _model(settings))])  # type: ignore[list-item]
    client = OpenAI(
        base_url="http://testserver/v1", api_key=api_key, http_client=http, max_retries=0
    )
    assert client.batches.list().data == []
    with pytest.raises(openai.NotFoundError) as caught:
        client.batches.retrieve(batch.id)
    assert caught.value.body["message"] == f"No batch found with id '{batch.id}'."  # type: ignore[index]
    assert caught.value.body["code"] == "not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        file = client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch")
        client.batches.create(
            input_file_id=file.id,
            endpoint="/v1/messages",  # type: ignore[arg-type]
            completion_window="24h",
        )


def _run_instant(settings: Settings, batch_id: str, model: str, limit: int) -> None:
    """What an engine worker does with ``limit`` lines of the batch, the instant engine standing
    in for the model (``InstantEngine``: a fixed answer at once)."""
    url, at = settings.resolved_database_url, time.time()
    engine = InstantEngine(model)
    with session_scope(url) as session:
        claimed = requests_repo.claim(
            session, model=model, limit=limit, owner="w1", lease_until=at + 60, at=at,
            batch_ids=[batch_id],
        )  # fmt: skip
    finished, ready = [], {}
    for row in claimed:
        line = orjson.loads(row.line_json)
        try:
            prepared = engine_io.prepare(str(row.id), line["url"], line["body"], engine)
        except LineError as exc:
            finished.append(results.failed(row, exc, at))
            continue
        engine.add(prepared.request)
        ready[prepared.request.request_id] = (row, prepared)
    for result in engine.step():
        row, prepared = ready[result.request_id]
        finished.append(results.succeeded(row, prepared, result, int(at), at))
    with session_scope(url) as session:
        requests_repo.write_results(session, "w1", finished)


def test_a_batch_runs_ends_and_bills_only_its_succeeded_requests(
    claude: anthropic.Anthropic, settings: Settings
) -> None:
    """Validation, claims, finalize and billing, unchanged, on a Message Batch: a request with
    ``stream``, one with tools and one naming another model error alone; the rest succeed; the
    results parse with the SDK; the bill counts the succeeded requests' tokens only."""
    model = _model(settings)
    batch = claude.messages.batches.create(
        requests=[
            _request("ok-1", model),
            _request("stream", model, stream=True),
            _request("tools", model, tools=[{"type": "web_search_20250305", "name": "web_search"}]),
            _request("other", "claude-opus-9"),
            _request("ok-2", model, system="Be brief.", stop_sequences=["END"]),
        ]  # type: ignore[list-item]
    )
    blobs = get_blob_store(settings.resolved_blob_url)
    assert run_validation(settings, blobs, batch.id) == model
    _run_instant(settings, batch.id, model, limit=10)
    assert finalize(settings, blobs, batch.id).done
    ended = claude.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.ended_at is not None
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled) == (0, 2, 3, 0)
    assert ended.results_url == f"http://testserver/v1/messages/batches/{batch.id}/results"
    lines = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    assert set(lines) == {"ok-1", "stream", "tools", "other", "ok-2"}
    assert lines["ok-1"].type == "succeeded"
    assert lines["ok-1"].message.content[0].text == "OK"  # type: ignore[union-attr]
    assert lines["ok-1"].message.stop_reason == "end_turn"
    for custom_id, param in (("stream", "stream"), ("tools", "tools.0.type")):
        result = lines[custom_id]
        assert result.type == "errored" and result.error.error.type == "invalid_request_error"
        assert result.error.error.message.startswith(f"{param}: ")
    assert lines["other"].type == "errored" and lines["other"].error.error.type == "not_found_error"
    bill_batch(settings, batch.id)
    usage = [lines[c].message.usage for c in ("ok-1", "ok-2")]  # type: ignore[union-attr]
    with session_scope(settings.resolved_database_url) as session:
        bill = session.query(LedgerEntry).filter_by(batch_id=batch.id).one()
        assert bill.requests == 2
        assert bill.input_tokens == sum(
            u.input_tokens + (u.cache_read_input_tokens or 0) for u in usage
        )
        assert bill.output_tokens == sum(u.output_tokens for u in usage)


def test_cancel_then_results_then_delete(claude: anthropic.Anthropic, settings: Settings) -> None:
    """Cancel mid-run: the requests that finished keep their result, the others are canceled;
    a batch still processing cannot be deleted; an ended one can, with its lines and files."""
    model = _model(settings)
    batch = claude.messages.batches.create(
        requests=[_request(f"r{i}", model) for i in range(4)]  # type: ignore[list-item]
    )
    blobs = get_blob_store(settings.resolved_blob_url)
    assert run_validation(settings, blobs, batch.id) == model
    _run_instant(settings, batch.id, model, limit=1)
    canceling = claude.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling" and canceling.cancel_initiated_at is not None
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.batches.delete(batch.id)
    assert "cancel it first" in caught.value.message
    assert finalize(settings, blobs, batch.id).done
    ended = claude.messages.batches.retrieve(batch.id)
    counts = ended.request_counts
    assert (ended.processing_status, counts.succeeded, counts.canceled) == ("ended", 1, 3)
    assert claude.messages.batches.cancel(batch.id).processing_status == "ended"
    kinds = sorted(r.result.type for r in claude.messages.batches.results(batch.id))
    assert kinds == ["canceled", "canceled", "canceled", "succeeded"]
    with session_scope(settings.resolved_database_url) as session:
        row = batches_repo.get_any(session, batch.id)
        assert row is not None
        keys = [row.input_file_id, row.output_file_id]
    deleted = claude.messages.batches.delete(batch.id)
    assert (deleted.id, deleted.type) == (batch.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve(batch.id)
    assert batch.id not in [b.id for b in claude.messages.batches.list()]
    with session_scope(settings.resolved_database_url) as session:
        assert session.query(RequestLine).filter_by(batch_id=batch.id).count() == 0
        from storage.models import File

        files = session.query(File).filter(File.id.in_(keys)).all()
        assert len(files) == 2 and all(f.deleted for f in files)
        assert not any(blobs.exists(f.blob_key) for f in files)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.delete(batch.id)


def test_a_batch_cancelled_before_validation_cancels_every_request(
    claude: anthropic.Anthropic, settings: Settings
) -> None:
    batch = claude.messages.batches.create(
        requests=[_request(f"r{i}", _model(settings)) for i in range(3)]  # type: ignore[list-item]
    )
    claude.messages.batches.cancel(batch.id)
    blobs = get_blob_store(settings.resolved_blob_url)
    run_validation(settings, blobs, batch.id)
    assert finalize(settings, blobs, batch.id).done
    ended = claude.messages.batches.retrieve(batch.id)
    assert ended.request_counts.canceled == 3 and ended.request_counts.processing == 0
    results_ = list(claude.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results_) == ["r0", "r1", "r2"]
    assert {r.result.type for r in results_} == {"canceled"}


def test_results_before_the_end_are_refused(
    claude: anthropic.Anthropic, http: TestClient, api_key: str, settings: Settings
) -> None:
    batch = claude.messages.batches.create(requests=[_request("a", _model(settings))])  # type: ignore[list-item]
    with pytest.raises(anthropic.AnthropicError, match="Has it finished processing"):
        claude.messages.batches.results(batch.id)  # the SDK itself needs results_url
    raw = http.get(f"/v1/messages/batches/{batch.id}/results", headers={"x-api-key": api_key})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"


def test_an_idempotency_key_makes_the_create_safe_to_retry(
    claude: anthropic.Anthropic, settings: Settings
) -> None:
    """The Idempotency-Key hook (``api.services.idempotency``) on the Anthropic create: a retry
    with the same key and body answers the first batch again and makes no second one; the same
    key with another body is refused in Anthropic's shape."""
    requests = [_request("a", _model(settings))]
    headers = {"Idempotency-Key": "retry-1"}
    first = claude.messages.batches.create(requests=requests, extra_headers=headers)  # type: ignore[arg-type]
    again = claude.messages.batches.with_raw_response.create(
        requests=requests,  # type: ignore[arg-type]
        extra_headers=headers,
    )
    assert again.parse().id == first.id and again.headers["Idempotent-Replayed"] == "true"
    assert [b.id for b in claude.messages.batches.list()] == [first.id]
    with pytest.raises(anthropic.UnprocessableEntityError) as caught:
        claude.messages.batches.create(
            requests=[_request("b", _model(settings))],  # type: ignore[list-item]
            extra_headers=headers,
        )
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert "different payload" in caught.value.body["error"]["message"]  # type: ignore[index]


def test_a_large_create_is_accepted_and_a_lone_surrogate_refused_in_anthropics_shape(
    claude: anthropic.Anthropic, http: TestClient, api_key: str, settings: Settings
) -> None:
    """The inline requests may make a body far over the 1 MiB other JSON bodies get (up to
    256 MiB); the body checks before the app still answer in Anthropic's shape here."""
    text = "x" * 300_000
    big = [_request(f"r{i}", _model(settings), system=text) for i in range(8)]  # ~2.4 MB
    assert claude.messages.batches.create(requests=big).request_counts.processing == 8  # type: ignore[arg-type]
    raw = http.post(
        "/v1/messages/batches",
        content=b'{"requests": [{"custom_id": "a", "params": {"system": "\\ud800"}}]}',
        headers={"x-api-key": api_key, "content-type": "application/json"},
    )
    assert raw.status_code == 400
    assert raw.json()["type"] == "error" and raw.json()["error"]["type"] == "invalid_request_error"
    assert "surrogate" in raw.json()["error"]["message"]


def test_openai_wording_of_an_unserved_model_line(settings: Settings) -> None:
    """A line naming a model not served fails the OpenAI batch with
    ``model_not_found`` in OpenAI's recorded wording, which clients match on."""
    from tests.support.batches import line, validate

    batch, _ = validate(settings, line("a", model="gpt-9"))
    assert batch.status == "failed"
    error = batch.errors[0]
    assert (error["code"], error["param"], error["line"]) == ("model_not_found", "body.model", 1)
    assert error["message"].startswith(
        "The provided model 'gpt-9' is not supported by the Batch API."
    )
