"""Making, waiting for and checking batches: request lines, in-process validation, a batch
submitted through the SDK, and the checks every finished batch must pass, whatever its input."""

from __future__ import annotations

import io
import os
import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
from openai import OpenAI
from openai.types import Batch
from sqlalchemy import func, select

from api.schemas.batches import CreateBatch
from api.services import batches as batches_service
from api.services import files as files_service
from api.services import keys
from offpeak.cli.client import read_lines
from offpeak.cli.demo import QUICKSTART as QUICKSTART  # the README's example batch
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import RequestLine
from storage.repositories import batches as batches_repo
from workers.validation import run_validation

#: Input cases from users' bug reports, copied from the workspace's shared/cases so a clone
#: carries them; OFFPEAK_CASES_DIR points the tests at another copy.
CASES = Path(os.environ.get("OFFPEAK_CASES_DIR", Path(__file__).resolve().parents[1] / "cases"))
#: The default model, as the end-to-end tests' lines name it.
MODEL = "SmolLM2-135M-Instruct"
ENDED = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, content: str, **params: Any) -> bytes:
    """A chat request line for the default model: one user turn, ``params`` in the body."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **params}
    return orjson.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    )


def submit(client: OpenAI, lines: list[bytes], endpoint: str = "/v1/chat/completions") -> Batch:
    """Upload ``lines`` and create a 24 h batch of them; the created batch."""
    file = client.files.create(file=("in.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    return client.batches.create(
        input_file_id=file.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )


def wait_for_end(
    client: OpenAI, batch_id: str, stack: ServiceProcesses | None = None, timeout: float = 600
) -> Batch:
    """Poll a batch until it ends; fail with the stack's logs when it does not within
    ``timeout`` seconds (or when one of the stack's processes died)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        if stack is not None:
            stack.check_alive()
        time.sleep(0.25)
    logs = "" if stack is None else "\n".join(f"== {n}\n{stack.tail(n)}" for n in stack.procs)
    raise AssertionError(f"batch {batch_id} did not end in {timeout} s ({batch.status})\n{logs}")


def files_of(client: OpenAI, batch: Batch) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)


def check_ran_batch(
    client: OpenAI, batch: Batch, input_custom_ids: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every custom_id exactly once across the two files; counts and usage match the lines;
    every line has the contract's shape. Returns the output and error lines."""
    output, errors = files_of(client, batch)
    seen = Counter(line["custom_id"] for line in output + errors)
    assert sorted(seen) == sorted(input_custom_ids), "custom_ids differ from the input's"
    assert set(seen.values()) == {1}, f"custom_ids not exactly once: {seen}"
    counts = batch.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (
        len(input_custom_ids),
        len(output),
        len(errors),
    )
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] in ("chat.completion", "text_completion")
        assert body["usage"]["total_tokens"] == (
            body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
        )
    for line in errors:
        assert line["id"].startswith("batch_req_")
        if line["response"] is not None:
            assert line["response"]["status_code"] >= 400 and line["error"] is None
            assert set(line["response"]["body"]["error"]) >= {"message", "type", "param", "code"}
        else:
            assert set(line["error"]) == {"code", "message"}
    usage = batch.usage
    assert usage is not None
    bodies = [line["response"]["body"] for line in output]
    assert usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert usage.input_tokens_details.cached_tokens == sum(
        b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies
    )
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    return output, errors


def line(custom_id: str = "r", model: str = "validation-model", **changes: object) -> bytes:
    """A chat request line; ``changes`` replace (or, with None, drop) top-level keys or, as
    ``body_<key>``, keys of the body."""
    record: dict[str, object] = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": "Hi"}]},
    }
    for key, value in changes.items():
        if key.startswith("body_"):
            body = dict(record["body"])  # type: ignore[call-overload]
            if value is None:
                body.pop(key[5:], None)
            else:
                body[key[5:]] = value
            record["body"] = body
        elif value is None:
            record.pop(key, None)
        else:
            record[key] = value
    return orjson.dumps(record)


def validate(
    settings: Settings,
    data: bytes,
    endpoint: str = "/v1/chat/completions",
    tenant_name: str | None = None,
):  # type: ignore[no-untyped-def]
    """Upload ``data``, create a batch and run its validation; returns the batch row and the
    number of request rows stored."""
    blobs = get_blob_store(settings.resolved_blob_url)
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.ensure_tenant(session, tenant_name or f"v-{secrets.token_hex(4)}")
        file = files_service.upload(
            session,
            blobs,
            settings,
            tenant_id=tenant.id,
            stream=io.BytesIO(data),
            filename="in.jsonl",
            purpose="batch",
            expires_after_seconds=None,
        )
        batch = batches_service.create(
            session,
            settings,
            tenant.id,
            CreateBatch(input_file_id=file.id, endpoint=endpoint, completion_window="24h"),
        )
        session.info.pop("after_commit", None)  # this test runs the validation itself
    run_validation(settings, blobs, batch.id)
    with session_scope(settings.resolved_database_url) as session:
        batch = batches_repo.get_any(session, batch.id)
        rows = session.scalar(select(func.count()).where(RequestLine.batch_id == batch.id))
    return batch, rows


def tenant_client(settings: Settings) -> tuple[str, OpenAI]:
    """A new tenant's name and the official SDK on the in-process API, with a key of its own."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from tests.support.database import new_key

    key = new_key(settings)
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.tenant_for_key(session, key)
        assert tenant is not None
        name = tenant.name
    client = TestClient(create_app(settings))
    return name, OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=client, max_retries=0
    )


def check_billed_once(url: str, batch: Batch) -> None:
    """Nothing of ``batch`` is billed twice: the engine-time shares recorded for it count each
    answered line's tokens once (a line run twice, or a result recorded twice, would add more
    than the batch's usage), and its bill, once written, bills exactly those lines."""
    from storage.models import EngineChunkBatch, LedgerEntry

    usage, counts = batch.usage, batch.request_counts
    assert usage is not None and counts is not None
    with session_scope(url) as session:
        shares = session.execute(
            select(
                func.coalesce(func.sum(EngineChunkBatch.requests), 0),
                func.coalesce(func.sum(EngineChunkBatch.prompt_tokens), 0),
                func.coalesce(func.sum(EngineChunkBatch.completion_tokens), 0),
            ).where(EngineChunkBatch.batch_id == batch.id)
        ).one()
        bills = session.scalars(select(LedgerEntry).where(LedgerEntry.batch_id == batch.id)).all()
    assert tuple(shares) == (counts.completed, usage.input_tokens, usage.output_tokens)
    assert len(bills) <= 1
    for bill in bills:
        assert (bill.requests, bill.input_tokens, bill.output_tokens) == (
            counts.completed,
            usage.input_tokens,
            usage.output_tokens,
        )


def line_statuses(settings: Settings, batch_id: str) -> dict[str, int]:
    """How many of the batch's request lines are in each status (``{"running": 3, ...}``; a
    status no line has is absent), read from the database. It shows a claim (``running``) as it
    happens; ``request_counts`` counts a line only once its result is written back, seconds
    after it ran (a write-back every ``flush_seconds``, after the chunk's prefill)."""
    with session_scope(settings.resolved_database_url) as session:
        rows = session.execute(
            select(RequestLine.status, func.count())
            .where(RequestLine.batch_id == batch_id)
            .group_by(RequestLine.status)
        )
        return {status: n for status, n in rows}


def story_batch(client: OpenAI, model: str, ids: list[str], base_tokens: int) -> str:
    """Create a chat batch of one story request per ``custom_id`` in ``ids`` (``max_tokens``
    ``base_tokens`` × 1, 2 or 3 in turn, temperature 0) through ``client``; returns its id."""
    lines = [
        orjson.dumps(
            {
                "custom_id": custom_id,
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": model,
                    "messages": [{"role": "user", "content": f"Tell story {i} about a ship."}],
                    "max_tokens": base_tokens * (1 + i % 3),
                    "temperature": 0,
                },
            }
        )
        for i, custom_id in enumerate(ids)
    ]
    file = client.files.create(file=("in.jsonl", b"\n".join(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return batch.id
