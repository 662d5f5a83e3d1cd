"""``GET /v1/batches/{id}/results`` (an Offpeak extension) on real PostgreSQL, through the
official SDK on the in-process API: the lines ended so far, page by page while the batch runs,
whose union is the final output and error files line for line."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from openai import OpenAI

import migrations
from offpeak.endpoints import records
from offpeak.endpoints.errors import LineError
from offpeak.settings import ModelConfig, Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.repositories import requests as requests_repo
from storage.repositories.requests import ClaimedRequest, FinishedLine, TokenCounts
from tests.support.batches import files_of, line, tenant_client, validate
from workers.engine.instant import InstantEngine
from workers.finalize import finalize
from workers.runner import Runner
from workers.runner.results import failed

MODEL = "results-model"


@pytest.fixture(params=["postgresql", "sqlite"])
def settings(
    request: pytest.FixtureRequest, settings: Settings, tmp_path: Path
) -> Iterator[Settings]:
    """PostgreSQL and the embedded default, SQLite (whose results order is the same counter)."""
    update: dict[str, Any] = {"models": {MODEL: ModelConfig(engine="instant")}}
    update["flush_seconds"] = 0.05
    if request.param == "postgresql":
        yield settings.model_copy(update=update)
        return
    url = f"sqlite:///{tmp_path / 'offpeak.db'}"
    migrations.upgrade(url)
    yield settings.model_copy(update={**update, "database_url": url, "data_dir": tmp_path})
    from storage.db import get_engine

    get_engine(url).dispose()


def make(settings: Settings, tenant: str, lines: list[bytes]) -> str:
    batch, _ = validate(settings, b"\n".join(lines), tenant_name=tenant)
    assert batch.status == "in_progress", batch.errors
    return batch.id


def claim(settings: Settings, batch_id: str, limit: int, owner: str = "w1") -> list[ClaimedRequest]:
    """Lease up to ``limit`` lines of the batch (of no other test's batch)."""
    at = time.time()
    with session_scope(settings.resolved_database_url) as session:
        return requests_repo.claim(
            session,
            model=MODEL,
            limit=limit,
            owner=owner,
            lease_until=at + 60,
            at=at,
            batch_ids=[batch_id],
        )


def answered(row: ClaimedRequest) -> FinishedLine:
    line_id, request_id = records.new_line_ids()
    record = records.Answer(
        endpoint="/v1/chat/completions",
        model=MODEL,
        created=int(time.time()),
        line_id=line_id,
        request_id=request_id,
        response_id=f"chatcmpl-{row.id}",
        prompt_tokens=3,
        cached_tokens=0,
        completions=[records.CompletionRecord(text="OK", finish_reason="stop", tokens=2)],
    )
    return FinishedLine(
        row.id, row.batch_id, "succeeded", time.time(), 200, records.dump(record),
        TokenCounts(3, 0, 2),
    )  # fmt: skip


def finish(settings: Settings, lines: list[FinishedLine], owner: str = "w1") -> None:
    with session_scope(settings.resolved_database_url) as session:
        assert len(requests_repo.write_results(session, owner, lines)) == len(lines)


def results_page(sdk: OpenAI, batch_id: str, **params: Any) -> dict[str, Any]:
    page = sdk.get(f"/batches/{batch_id}/results", cast_to=object, options={"params": params})
    assert isinstance(page, dict)
    return page


def read_all(sdk: OpenAI, batch_id: str, after: str | None, limit: int) -> list[dict[str, Any]]:
    """Every line readable now after ``after``, page by page; checks each page's list fields."""
    lines: list[dict[str, Any]] = []
    while True:
        params: dict[str, Any] = {"limit": limit} | ({"after": after} if after else {})
        page = results_page(sdk, batch_id, **params)
        assert page["object"] == "list" and len(page["data"]) <= limit
        if page["data"]:
            assert page["first_id"] == page["data"][0]["id"]
            assert page["last_id"] == page["data"][-1]["id"]
            after = page["last_id"]
        else:
            assert page["first_id"] is None and page["last_id"] is None
        lines += page["data"]
        if not page["has_more"]:
            return lines


def check_union(sdk: OpenAI, batch_id: str, lines: list[dict[str, Any]]) -> None:
    """The lines read are the output and error files' lines, each once."""
    output, errors = files_of(sdk, sdk.batches.retrieve(batch_id))
    ids = [line["id"] for line in lines]
    assert len(ids) == len(set(ids))
    key = orjson.dumps
    assert sorted(map(key, lines)) == sorted(map(key, output + errors))


def test_pages_while_running_add_up_to_the_files(settings: Settings) -> None:
    tenant, sdk = tenant_client(settings)
    lines = [line(f"r{i}", model=MODEL) for i in range(30)]
    batch_id = make(settings, tenant, lines)
    assert results_page(sdk, batch_id) == {
        "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False,
    }  # fmt: skip
    rows = claim(settings, batch_id, 12)
    bad = LineError("temperature must be at most 2.", "temperature", "invalid_value")
    finish(
        settings,
        [answered(r) for r in rows[:8]] + [failed(r, bad, time.time()) for r in rows[8:10]],
    )
    seen = read_all(sdk, batch_id, None, limit=3)
    assert len(seen) == 10
    assert sum(1 for s in seen if s["response"]["status_code"] == 400) == 2
    # Lines still running are not there yet; they show after the cursor once they end.
    finish(settings, [answered(r) for r in rows[10:]])
    more = read_all(sdk, batch_id, seen[-1]["id"], limit=3)
    assert [m["custom_id"] for m in more] == [r.custom_id for r in rows[10:]]
    seen += more
    Runner(settings, InstantEngine(MODEL), "w2", lambda _b: None).drain()
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done
    assert sdk.batches.retrieve(batch_id).status == "completed"
    seen += read_all(sdk, batch_id, seen[-1]["id"], limit=7)
    check_union(sdk, batch_id, seen)
    # From the top again, in one page: the same lines in the same order.
    assert read_all(sdk, batch_id, None, limit=1000) == seen


def test_a_cancelled_batch_pages_through_its_lines_that_never_ran(settings: Settings) -> None:
    tenant, sdk = tenant_client(settings)
    batch_id = make(settings, tenant, [line(f"c{i}", model=MODEL) for i in range(12)])
    rows = claim(settings, batch_id, 4)
    finish(settings, [answered(r) for r in rows])
    seen = read_all(sdk, batch_id, None, limit=3)
    sdk.batches.cancel(batch_id)
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done
    assert sdk.batches.retrieve(batch_id).status == "cancelled"
    # Pages of two, so later pages start after a line that never ran.
    seen += read_all(sdk, batch_id, seen[-1]["id"], limit=2)
    assert [s["error"]["code"] for s in seen[4:]] == ["batch_cancelled"] * 8
    check_union(sdk, batch_id, seen)


def test_another_tenants_batch_and_a_bad_cursor(settings: Settings) -> None:
    tenant, sdk = tenant_client(settings)
    batch_id = make(settings, tenant, [line("only", model=MODEL)])
    _, other = tenant_client(settings)
    with pytest.raises(Exception) as caught:
        results_page(other, batch_id)
    assert getattr(caught.value, "status_code", None) == 404
    with pytest.raises(Exception) as caught:
        results_page(sdk, batch_id, after="batch_req_nothere")
    assert getattr(caught.value, "status_code", None) == 400
    with pytest.raises(Exception) as caught:
        results_page(sdk, batch_id, limit=0)
    assert getattr(caught.value, "status_code", None) == 400


def test_cli_appends_results_and_resumes_after_its_last_line(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    from offpeak import cli

    tenant, sdk = tenant_client(settings)
    batch_id = make(settings, tenant, [line(f"k{i}", model=MODEL) for i in range(20)])
    monkeypatch.setattr(cli, "_client", lambda: sdk)
    out = tmp_path / "results.jsonl"
    rows = claim(settings, batch_id, 6)
    finish(settings, [answered(r) for r in rows[:5]])

    def partial() -> str:
        result = CliRunner().invoke(cli.app, ["download", batch_id, "--partial", "-o", str(out)])
        assert result.exit_code == 0, result.output
        return result.output

    assert "appended 5 lines" in partial()
    assert "appended 0 lines" in partial()
    finish(settings, [answered(rows[5])])
    # A write cut short mid-line: the partial line goes, and the next run writes it whole.
    with out.open("ab") as handle:
        handle.write(b'{"id": "batch_req_cut')
    assert "appended 1 lines" in partial()
    Runner(settings, InstantEngine(MODEL), "w2", lambda _b: None).drain()
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done
    result = CliRunner().invoke(cli.app, ["watch", batch_id, "--results", str(out)])
    assert result.exit_code == 0, result.output
    lines = [orjson.loads(text) for text in out.read_bytes().splitlines()]
    assert len(lines) == 20
    check_union(sdk, batch_id, lines)


def test_pages_read_while_the_live_stack_runs_the_batch_add_up(
    instant_sdk: OpenAI, instant_stack: Any
) -> None:
    """On the instant stack (API, control and engine workers, results written back every
    second): a batch paused at create shows no line; resumed, pages read in a loop while the
    workers write results back add up to the files, nothing twice, nothing missed."""
    from openai.types import Batch

    from tests.support.batches import chat_line, submit, wait_for_end

    custom_ids = [f"s{i}" for i in range(3000)]
    batch = submit(instant_sdk, [chat_line(c, "hi", max_tokens=2) for c in custom_ids])
    instant_sdk.post(f"/batches/{batch.id}/pause", cast_to=Batch)
    deadline = time.monotonic() + 180
    while instant_sdk.batches.retrieve(batch.id).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert read_all(instant_sdk, batch.id, None, limit=10) == []
    instant_sdk.post(f"/batches/{batch.id}/resume", cast_to=Batch)
    seen: list[dict[str, Any]] = []
    after: str | None = None
    while len(seen) < len(custom_ids):
        got = read_all(instant_sdk, batch.id, after, limit=251)
        if got:
            seen += got
            after = got[-1]["id"]
        assert time.monotonic() < deadline, len(seen)
        time.sleep(0.05)
    wait_for_end(instant_sdk, batch.id, instant_stack)
    assert read_all(instant_sdk, batch.id, after, limit=251) == []
    assert sorted(s["custom_id"] for s in seen) == sorted(custom_ids)
    check_union(instant_sdk, batch.id, seen)
