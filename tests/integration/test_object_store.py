"""The blob store on an S3-protocol server: the service's processes (API, control worker, engine
worker on the instant engine) with ``OFFPEAK_BLOB_URL=s3://…`` and only the standard AWS
variables, through a link the test can cut (``tests/support/object_store.py``).

- A batch's input, output and error files are objects in the bucket, uploaded and downloaded
  through the OpenAI SDK; no blob is on the local disk.
- The store going away mid-upload: a 503 in OpenAI's error shape, no object and no file row; the
  same upload succeeds once the store is back.
- The store going away mid-batch: the lines finish, the output waits, and once the store is back
  it is written with every line once, billed once.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI
from sqlalchemy import func, select

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from storage.blobs import PART_BYTES, BlobStore
from storage.db import session_scope
from storage.models import LedgerEntry, RequestLine
from tests.support.batches import chat_line, check_ran_batch, submit, wait_for_end
from tests.support.database import fresh_database, new_key, settings_from
from tests.support.object_store import BUCKET, Link, S3Server, s3_env
from tests.support.processes import instant_stack_env, running, wait_until
from tests.support.servers import free_port

PREFIX = "blobs"


@pytest.fixture(scope="module")
def link(own_s3: S3Server) -> Iterator[Link]:
    link = Link(own_s3.port)
    yield link
    link.cut()


@pytest.fixture(scope="module")
def stack_env(
    base_env: dict[str, str], run_id: str, link: Link, data_dir: Path
) -> Iterator[dict[str, str]]:
    """The stack's environment: its own database, queue prefix and data dir, blobs on S3."""
    with fresh_database(f"offpeak_{run_id}_s3") as url:
        more = {**s3_env(link.endpoint, PREFIX), "OFFPEAK_DATA_DIR": str(data_dir / "s3-stack")}
        yield instant_stack_env(base_env, url, f"{run_id}-s3", **more)


@pytest.fixture(scope="module")
def s3_settings(stack_env: dict[str, str]) -> Settings:
    return settings_from(stack_env)


@pytest.fixture(scope="module")
def stack(
    stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    logs = tmp_path_factory.mktemp("s3-logs")
    with running(ServiceProcesses(stack_env, free_port(), logs)) as processes:
        yield processes


@pytest.fixture()
def client(stack: ServiceProcesses, s3_settings: Settings) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=new_key(s3_settings), max_retries=0)


def test_a_batch_reads_and_writes_its_files_as_objects(
    client: OpenAI,
    stack: ServiceProcesses,
    own_s3: S3Server,
    s3_settings: Settings,
) -> None:
    ids = [f"r{i}" for i in range(12)]
    lines = [chat_line(i, f"question {i}", max_tokens=3) for i in ids]
    batch = wait_for_end(client, submit(client, lines).id, stack, timeout=120)
    assert batch.status == "completed"
    check_ran_batch(client, batch, ids)
    keys = own_s3.keys(f"{PREFIX}/")
    assert f"{PREFIX}/files/{batch.input_file_id}" in keys
    assert f"{PREFIX}/outputs/{batch.id}/output.jsonl" in keys
    body = own_s3.body(f"{PREFIX}/outputs/{batch.id}/output.jsonl")
    assert body == client.files.content(batch.output_file_id).content
    assert not (s3_settings.data_dir / "blobs").exists(), "a blob went to the local disk"


def test_the_store_going_away_mid_upload_answers_503_and_stores_nothing(
    client: OpenAI,
    stack: ServiceProcesses,
    own_s3: S3Server,
    link: Link,
) -> None:
    """The upload spans several parts; the link is cut half-way through the second."""
    data = b"".join(chat_line(f"u{i}", "x" * 1000) + b"\n" for i in range(3 * PART_BYTES // 1100))
    before = set(own_s3.keys(f"{PREFIX}/files/"))
    link.cut_after(PART_BYTES + PART_BYTES // 2)
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            client.files.create(file=("big.jsonl", data), purpose="batch")
    finally:
        link.restore()
    assert raised.value.status_code == 503
    error = raised.value.response.json()["error"]
    assert error["code"] == "store_unavailable" and error["type"] == "server_error"
    assert set(error) == {"message", "type", "param", "code"}
    assert raised.value.response.headers["Retry-After"]
    assert set(own_s3.keys(f"{PREFIX}/files/")) == before, "a half-written object is visible"
    assert client.files.list().data == [], "a file row without its bytes"
    # The store is back: the same upload is whole.
    file = client.files.create(file=("big.jsonl", data), purpose="batch")
    assert own_s3.body(f"{PREFIX}/files/{file.id}") == data
    assert client.files.content(file.id).content == data


def test_the_store_going_away_mid_batch_loses_nothing_and_runs_nothing_twice(
    client: OpenAI,
    stack: ServiceProcesses,
    own_s3: S3Server,
    link: Link,
    s3_settings: Settings,
) -> None:
    """Validated with the store up, run with it down (the runner keeps results in the
    database), finalized once it is back."""
    stack.kill("engine")  # the lines wait until the store is gone
    ids = [f"m{i}" for i in range(30)]
    created = submit(client, [chat_line(i, f"q {i}", max_tokens=2) for i in ids])
    wait_until(lambda: client.batches.retrieve(created.id).status == "in_progress", 60, "validated")
    link.cut()
    try:
        stack.start_worker("engine")
        url = s3_settings.resolved_database_url

        def lines_left() -> int:
            with session_scope(url) as session:
                return int(
                    session.scalar(
                        select(func.count())
                        .select_from(RequestLine)
                        .where(RequestLine.batch_id == created.id)
                        .where(RequestLine.status.in_(("pending", "running")))
                    )
                    or 0
                )

        wait_until(lambda: lines_left() == 0, 120, "every line run", stack.tail("engine"))
        wait_until(
            lambda: "finalize waits for the file store" in stack.tail("control", 400),
            120,
            "a finalize that found the store away",
            stack.tail("control"),
        )
        assert client.batches.retrieve(created.id).status in ("in_progress", "finalizing")
    finally:
        link.restore()
    batch = wait_for_end(client, created.id, stack, timeout=180)
    assert batch.status == "completed"
    check_ran_batch(client, batch, ids)
    assert f"{PREFIX}/outputs/{batch.id}/output.jsonl" in own_s3.keys(f"{PREFIX}/outputs/")
    with session_scope(s3_settings.resolved_database_url) as session:
        bills = session.scalars(select(LedgerEntry).where(LedgerEntry.batch_id == batch.id)).all()
        assert [b.requests for b in bills] == [len(ids)]


def test_an_object_appears_whole_at_its_key_without_a_copy(
    own_s3: S3Server, link: Link, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts go up while the block runs, yet no reader sees the key before it ends; no rename
    (a copy on S3) is ever made."""
    for name, value in s3_env(link.endpoint, PREFIX).items():
        monkeypatch.setenv(name, value)
    store = BlobStore(f"s3://{BUCKET}/{PREFIX}", retry_seconds=5)

    def no_copy(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the store copied an object")

    for method in ("mv", "copy", "cp_file"):
        monkeypatch.setattr(store.fs, method, no_copy)
    piece = b"x" * (1 << 20)
    key = f"outputs/whole-{secrets.token_hex(4)}.jsonl"
    with store.writer(key) as out:
        for _ in range(2 * PART_BYTES // len(piece) + 1):
            out.write(piece)
        assert f"{PREFIX}/{key}" not in own_s3.keys(f"{PREFIX}/outputs/")
        uploads = own_s3.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
        assert f"{PREFIX}/{key}" in {upload["Key"] for upload in uploads}
    assert own_s3.body(f"{PREFIX}/{key}") == piece * (2 * PART_BYTES // len(piece) + 1)
    assert b"".join(store.iter_chunks(key)) == own_s3.body(f"{PREFIX}/{key}")
