"""The embedded broker (``offpeak.broker``) under the races that killed kombu's filesystem
transport: a consumer reading a message file another process is still writing (celery/kombu#1551),
two consumers on one queue, an exchange table read while it is created, unreadable and orphaned
files. Writers and readers are separate processes, as the API, beat and workers are.

Each race is run against kombu's own transport too (the ``*_kombu_*`` controls): they show the
harness reproduces the fault, so the tests of ``offpeak.broker`` can fail. If a control starts
failing, kombu has fixed that race upstream. The controls widen the writer's window on purpose
(``_pause_after_create``): left to chance, 20,000 messages once passed without a hit in CI.
"""

from __future__ import annotations

import builtins
import io
import json
import logging
import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

import offpeak.broker
from offpeak.celery_app import make_celery
from offpeak.settings import Settings

OURS = "offpeak.broker:Transport"
KOMBU = "kombu.transport.filesystem:Transport"
# Processes start clean (no pytest state, no inherited locks or threads).
SPAWN = multiprocessing.get_context("spawn")


def _options(folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    return {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(folder / "control"),
        "processed_folder": str(folder / "processed"),
    }


def _connect(folder: Path, transport: str) -> Connection:
    return Connection("filesystem://", transport=transport, transport_options=_options(folder))


@pytest.fixture
def queue_name() -> str:
    """A queue name per test: kombu's in-process broker state remembers bindings by name, so a
    name reused with another folder would skip writing that folder's exchange table."""
    return f"race.{uuid.uuid4().hex[:8]}"


# Files a transport creates for a message or an exchange table: kombu's own names, and ours
# (``offpeak.broker`` writes a hidden ``….tmp`` sibling, then renames it into place).
_WRITTEN_SUFFIXES = (".msg", ".exchange", ".tmp")


def _pause_after_create(seconds: float) -> None:
    """In this (writer) process, wait ``seconds`` after creating a message or exchange file,
    before its first byte is written: the window kombu's writer leaves between ``open`` and
    ``write`` (microseconds, so a race with a reader is left to chance), made wide enough that a
    reader polling the folder lands in it every time. Both ``open``s: kombu writes messages with
    the builtin and exchange tables through ``Path.open`` (``io.open``)."""
    real_open = io.open

    def opener(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        if ("w" in mode or "x" in mode) and str(file).endswith(_WRITTEN_SUFFIXES):
            time.sleep(seconds)
        return handle

    builtins.open = io.open = opener  # type: ignore[assignment]


def _produce(
    folder: Path, transport: str, name: str, start: int, count: int, pause: float = 0.0
) -> None:
    if pause:
        _pause_after_create(pause)
    with _connect(folder, transport) as conn:
        queue = conn.SimpleQueue(name)
        for i in range(start, start + count):
            # ~2 kB: a validate/drain message is smaller, but a longer write widens nothing in
            # kombu's race (the file is empty between create and write), it only costs time.
            queue.put({"i": i, "pad": "x" * 2000})


def _consume(
    folder: Path, transport: str, name: str, writers_done: Any, stop_at_first_error: bool
) -> tuple[list[int], list[str]]:
    """Take messages until the writers are done and the queue is empty: (ids, errors)."""
    ids: list[int] = []
    errors: list[str] = []
    with _connect(folder, transport) as conn:
        queue = conn.SimpleQueue(name)
        while True:
            try:
                message = queue.get(block=False)
            except queue.Empty:
                if writers_done.is_set() and queue.qsize() == 0:
                    return ids, errors
                continue
            except Exception as exc:  # what kombu's transport raises mid-race
                errors.append(f"{type(exc).__name__}: {exc}")
                if stop_at_first_error:
                    return ids, errors
                continue
            ids.append(message.payload["i"])
            message.ack()


def _consume_to_file(folder: Path, transport: str, name: str, writers_done: Any, out: Path) -> None:
    ids, errors = _consume(folder, transport, name, writers_done, stop_at_first_error=False)
    out.write_text(json.dumps({"ids": ids, "errors": errors}))


def test_kombu_filesystem_transport_reads_half_written_messages(
    tmp_path: Path, queue_name: str
) -> None:
    """Control: with kombu's transport a consumer racing a writer hits an empty message file."""
    writers_done = SPAWN.Event()
    writer = SPAWN.Process(target=_produce, args=(tmp_path, KOMBU, queue_name, 0, 200, 0.05))
    writer.start()
    _set_when_ended([writer], writers_done)  # so the consumer ends if the race never hits
    try:
        _, errors = _consume(tmp_path, KOMBU, queue_name, writers_done, stop_at_first_error=True)
    finally:
        writer.kill()
        writer.join()
    assert errors and errors[0].startswith("JSONDecodeError"), errors


def test_atomic_transport_never_shows_a_message_being_written(
    tmp_path: Path, queue_name: str
) -> None:
    """The control's race, widened the same way, against ``offpeak.broker``: the consumer never
    sees a message before it is whole, and takes every one once."""
    writers_done = SPAWN.Event()
    writer = SPAWN.Process(target=_produce, args=(tmp_path, OURS, queue_name, 0, 100, 0.05))
    writer.start()
    _set_when_ended([writer], writers_done)
    ids, errors = _consume(tmp_path, OURS, queue_name, writers_done, stop_at_first_error=True)
    writer.join()
    assert writer.exitcode == 0
    assert errors == []
    assert sorted(ids) == list(range(100))


def _set_when_ended(procs: list[Any], event: Any) -> None:
    """Set ``event`` from a thread once every process of ``procs`` has ended."""

    def watch() -> None:
        for proc in procs:
            proc.join()
        event.set()

    threading.Thread(target=watch, daemon=True).start()


def test_atomic_transport_delivers_every_message_exactly_once(
    tmp_path: Path, queue_name: str
) -> None:
    """Two writers and two consumers on one queue: every message arrives once, nothing raises."""
    per_writer = 1_000
    writers_done = SPAWN.Event()
    writers = [
        SPAWN.Process(
            target=_produce, args=(tmp_path, OURS, queue_name, n * per_writer, per_writer)
        )
        for n in range(2)
    ]
    other_out = tmp_path / "other-consumer.json"
    other = SPAWN.Process(
        target=_consume_to_file, args=(tmp_path, OURS, queue_name, writers_done, other_out)
    )
    for proc in (*writers, other):
        proc.start()

    _set_when_ended(writers, writers_done)  # this process consumes too
    ids, errors = _consume(tmp_path, OURS, queue_name, writers_done, stop_at_first_error=False)
    other.join()
    assert all(proc.exitcode == 0 for proc in (*writers, other))
    theirs = json.loads(other_out.read_text())

    assert errors == [] and theirs["errors"] == []
    received = ids + theirs["ids"]
    assert sorted(received) == list(range(2 * per_writer))  # each once: none lost, none twice
    assert ids and theirs["ids"]  # both consumers took part
    assert os.listdir(tmp_path / ".claimed") == []


def _bind_exchanges(folder: Path, transport: str, count: int, pause: float = 0.0) -> None:
    if pause:
        _pause_after_create(pause)
    with _connect(folder, transport) as conn:
        channel = conn.default_channel
        for k in range(count):
            channel._queue_bind(f"ex{k}", f"rk{k}", "", f"q{k}")


def _read_tables_while_created(
    folder: Path, transport: str, count: int, pause: float = 0.0
) -> tuple[int, list[str]]:
    """Read each exchange table as soon as its file appears, while another process creates
    ``count`` of them (as a publish looks up the table of the exchange a new worker just
    declared), pausing ``pause`` seconds after creating each file. Stops at the fifth error:
    (reads, errors)."""
    writer = SPAWN.Process(target=_bind_exchanges, args=(folder, transport, count, pause))
    writer.start()
    reads, errors, k = 0, [], 0
    control = folder / "control"
    with _connect(folder, transport) as conn:
        channel = conn.default_channel
        while writer.is_alive() and len(errors) < 5:
            if (control / f"ex{k + 1}.exchange").exists():
                k += 1
            if not (control / f"ex{k}.exchange").exists():
                continue
            try:
                channel.get_table(f"ex{k}")
                reads += 1
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    writer.kill()
    writer.join()
    return reads, errors


def test_kombu_exchange_table_is_read_half_created(tmp_path: Path) -> None:
    """Control: kombu creates an exchange table empty, then writes it; a reader sees it empty."""
    _, errors = _read_tables_while_created(tmp_path, KOMBU, 200, pause=0.05)
    assert errors and errors[0].startswith("JSONDecodeError"), errors


@pytest.mark.parametrize(("count", "pause"), [(1_000, 0.0), (100, 0.05)])
def test_atomic_exchange_tables_are_never_read_partial(
    tmp_path: Path, count: int, pause: float
) -> None:
    reads, errors = _read_tables_while_created(tmp_path, OURS, count, pause)
    assert errors == [] and reads > 0
    # Every table the writer finished holds its binding, and no temporary file is left.
    with _connect(tmp_path, OURS) as conn:
        for name in os.listdir(tmp_path / "control"):
            assert not name.endswith(".tmp"), name
            if name.endswith(".exchange"):
                k = name.removesuffix(".exchange").removeprefix("ex")
                table = conn.default_channel.get_table(f"ex{k}")
                assert [tuple(row) for row in table] == [(f"rk{k}", "", f"q{k}")]


def test_concurrent_binds_to_one_exchange_keep_every_binding(tmp_path: Path) -> None:
    """Workers starting together each bind their queue to one fanout exchange (Celery's remote
    control does): every binding is kept, so a broadcast reaches every queue."""
    exchange_name = f"fan-{uuid.uuid4().hex[:8]}"
    procs = [
        SPAWN.Process(target=_declare_fanout_queue, args=(tmp_path, exchange_name, n))
        for n in range(4)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    assert all(proc.exitcode == 0 for proc in procs)
    with _connect(tmp_path, OURS) as conn:
        exchange = Exchange(exchange_name, type="fanout")
        conn.Producer().publish({"hello": 1}, exchange=exchange)
        for n in range(4):
            queue = Queue(f"{exchange_name}-q{n}", exchange)
            message = conn.SimpleQueue(queue).get(block=False)
            assert message.payload == {"hello": 1}


def _declare_fanout_queue(folder: Path, exchange_name: str, n: int) -> None:
    with _connect(folder, OURS) as conn:
        Queue(f"{exchange_name}-q{n}", Exchange(exchange_name, type="fanout"))(
            conn.default_channel
        ).declare()


def _message_name(queue: str, stamp: int) -> str:
    return f"{stamp}_{uuid.uuid4()}.{queue}.msg"


def test_unreadable_message_is_skipped_put_back_then_set_aside(
    tmp_path: Path, queue_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A file that does not parse never kills the consumer: while young it is put back (a
    non-atomic writer may still be writing it), once old it is moved aside with an error."""
    with _connect(tmp_path, OURS) as conn:
        queue = conn.SimpleQueue(queue_name)
        queue.put({"i": 1})
        # An empty file sorted before the good one, as kombu's own writer leaves it mid-write.
        broken = tmp_path / _message_name(queue_name, 0)
        broken.write_bytes(b"")

        assert queue.get(block=False).payload == {"i": 1}
        assert broken.exists()  # young: back in place, untouched

        old = time.time() - offpeak.broker.UNREADABLE_AFTER_SECONDS - 5
        os.utime(broken, (old, old))
        with caplog.at_level(logging.ERROR, "offpeak.broker"), pytest.raises(queue.Empty):
            queue.get(block=False)
        assert not broken.exists()
        assert (tmp_path / ".unreadable" / broken.name).exists()
        assert "does not parse" in caplog.text


def test_message_left_claimed_by_a_dead_consumer_is_restored(
    tmp_path: Path, queue_name: str
) -> None:
    with _connect(tmp_path, OURS) as conn:
        conn.SimpleQueue(queue_name).put({"i": 7})
    (name,) = [n for n in os.listdir(tmp_path) if n.endswith(".msg")]
    claimed = tmp_path / ".claimed" / name
    os.rename(tmp_path / name, claimed)  # what a consumer killed right after its claim leaves
    old = time.time() - offpeak.broker.ORPHAN_CLAIM_SECONDS - 5
    os.utime(claimed, (old, old))

    with _connect(tmp_path, OURS) as conn:
        assert conn.SimpleQueue(queue_name).get(block=False).payload == {"i": 7}


def test_embedded_celery_app_uses_the_atomic_transport(tmp_path: Path) -> None:
    app = make_celery(Settings(data_dir=tmp_path, broker_url=""))
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, offpeak.broker.Transport)
        assert conn.transport_options["data_folder_in"] == str(tmp_path.resolve() / "broker" / "in")
