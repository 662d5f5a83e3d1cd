"""A batch's breaker (``failure_limit``, an Offpeak extension of create sent with the SDK's
``extra_body``) on real PostgreSQL: the runner on the instant engine, finalize, billing, the
in-process API through the official SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

import migrations
from offpeak.failure_limit import FailureLimit
from offpeak.settings import ModelConfig, Settings
from storage.blobs import get_blob_store
from tests.support.batches import check_billed_once, files_of, line, tenant_client
from workers.engine.instant import InstantEngine
from workers.finalize import finalize
from workers.runner import Runner
from workers.validation import run_validation

MODEL = "breaker-model"


@pytest.fixture(params=["postgresql", "sqlite"])
def settings(
    request: pytest.FixtureRequest, settings: Settings, tmp_path: Path
) -> Iterator[Settings]:
    """PostgreSQL (the check is one statement of the write-back's pipeline) and the embedded
    default, SQLite (the same rule in Python). Small chunks written back often: the breaker
    trips while most lines are still pending."""
    update: dict[str, Any] = {
        "models": {MODEL: ModelConfig(engine="instant", max_num_seqs=8)},
        "flush_seconds": 0.01,
        "chunk_size": 8,
    }
    if request.param == "postgresql":
        yield settings.model_copy(update=update)
        return
    url = f"sqlite:///{tmp_path / 'offpeak.db'}"
    migrations.upgrade(url)
    yield settings.model_copy(update={**update, "database_url": url, "data_dir": tmp_path})
    from storage.db import get_engine

    get_engine(url).dispose()


def lines(total: int, poison_every: int) -> list[bytes]:
    """``total`` lines, every ``poison_every``-th one a line that fails its own 400
    (``temperature`` out of range)."""
    return [
        line(f"l{i}", model=MODEL, body_temperature=5)
        if i % poison_every == 0
        else line(f"l{i}", model=MODEL)
        for i in range(total)
    ]


def create(sdk: OpenAI, settings: Settings, data: list[bytes], **extra: Any) -> str:
    """Upload, create through the SDK (``extra`` as ``extra_body``) and validate in-process."""
    file = sdk.files.create(file=("in.jsonl", b"\n".join(data) + b"\n"), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_body=extra or None,
    )
    run_validation(settings, get_blob_store(settings.resolved_blob_url), batch.id)
    return batch.id


def run(settings: Settings, batch_id: str) -> None:
    Runner(settings, InstantEngine(MODEL), "w1", lambda _b: None).drain()
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done


def test_a_poison_heavy_batch_trips_and_fails_with_the_rest_unrun(settings: Settings) -> None:
    _, sdk = tenant_client(settings)
    total = 3000
    batch_id = create(
        sdk, settings, lines(total, poison_every=2),
        failure_limit={"fraction": 0.2, "after_lines": 40},
    )  # fmt: skip
    created = sdk.batches.retrieve(batch_id)
    assert created.model_extra["failure_limit"] == {"fraction": 0.2, "after_lines": 40}
    run(settings, batch_id)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "failed" and batch.failed_at and batch.cancelling_at
    assert batch.errors is not None and len(batch.errors.data) == 1
    error = batch.errors.data[0]
    assert error.code == "failure_limit_exceeded" and error.param == "failure_limit"
    assert "failure_limit" in error.message and "cancelled" in error.message
    output, errors = files_of(sdk, batch)
    cancelled = [e for e in errors if e["error"] and e["error"]["code"] == "batch_cancelled"]
    refused = [e for e in errors if e["response"] and e["response"]["status_code"] == 400]
    # It stopped early: most lines never ran, and every line is in a file once.
    assert len(cancelled) > total // 2
    assert len(output) + len(refused) + len(cancelled) == total
    ids = [x["custom_id"] for x in output + errors]
    assert sorted(ids) == sorted(f"l{i}" for i in range(total))
    counts = batch.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (
        total,
        len(output),
        total - len(output),
    )
    # Billed for what ran: the answered lines' tokens, nothing for the cancelled ones.
    assert batch.usage.output_tokens == sum(
        o["response"]["body"]["usage"]["completion_tokens"] for o in output
    )
    check_billed_once(settings.resolved_database_url, batch)
    assert batch.model_extra["billed_at"] is not None


def test_a_batch_under_its_bound_completes(settings: Settings) -> None:
    _, sdk = tenant_client(settings)
    batch_id = create(
        sdk, settings, lines(200, poison_every=10),
        failure_limit={"fraction": 0.2, "after_lines": 40},
    )  # fmt: skip
    run(settings, batch_id)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.errors is None
    assert batch.request_counts is not None and batch.request_counts.failed == 20


def test_the_server_default_applies_unless_the_create_says_otherwise(settings: Settings) -> None:
    strict = settings.model_copy(
        update={"failure_limit": FailureLimit(fraction=0.1, after_lines=10)}
    )
    _, sdk = tenant_client(strict)
    poisoned = lines(400, poison_every=2)
    by_default = create(sdk, strict, poisoned)
    assert sdk.batches.retrieve(by_default).model_extra["failure_limit"] == {
        "fraction": 0.1, "after_lines": 10,
    }  # fmt: skip
    run(strict, by_default)
    assert sdk.batches.retrieve(by_default).status == "failed"
    # ``null`` turns the breaker off for this batch: every line runs.
    without = create(sdk, strict, poisoned, failure_limit=None)
    run(strict, without)
    batch = sdk.batches.retrieve(without)
    assert batch.status == "completed" and batch.model_extra["failure_limit"] is None


@pytest.mark.parametrize(
    ("limit", "param"),
    [
        ({"fraction": 1.5, "after_lines": 10}, "failure_limit.fraction"),
        ({"fraction": 0.2, "after_lines": 0}, "failure_limit.after_lines"),
        ({"fraction": 0.2}, "failure_limit.after_lines"),
        ({"fraction": 0.2, "after_lines": 10, "other": 1}, "failure_limit.other"),
        ("often", "failure_limit"),
    ],
)
def test_a_bad_failure_limit_is_a_400_naming_it(
    settings: Settings, limit: object, param: str
) -> None:
    _, sdk = tenant_client(settings)
    file = sdk.files.create(file=("in.jsonl", line("a", model=MODEL) + b"\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(
            input_file_id=file.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            extra_body={"failure_limit": limit},
        )
    assert refused.value.body["param"] == param  # type: ignore[index]
    assert "failure_limit" in refused.value.body["message"]  # type: ignore[index]
