"""The runner's background write-back (``workers.runner.writeback``, issue 14 part 3).

The store is a recording fake (the test is about the writer's threading and bookkeeping, not
the database: the database path runs in tests/test_scheduler.py and ``bench overhead``). It
blocks a write until the test lets it go, so "in flight" is a state the test holds, not a race.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from offpeak.endpoints import records
from offpeak.settings import Settings
from storage.repositories.requests import ClaimedRequest, FinishedLine, TokenCounts
from workers import serving
from workers.engine.base import Completion, EngineResult
from workers.engine.instant import InstantEngine
from workers.runner import results
from workers.runner.writeback import RENEW_FRACTION, ResultWriter
from workers.scheduler.store import WriteBack, WriteBackReport


class GatedStore:
    """``write_back`` records each write and waits for ``gate``; raises ``fail`` if set."""

    def __init__(self) -> None:
        self.writes: list[WriteBack] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail: BaseException | None = None

    def write_back(self, write: WriteBack) -> WriteBackReport:
        self.entered.set()
        assert self.gate.wait(30)
        if self.fail is not None:
            raise self.fail
        self.writes.append(write)
        return WriteBackReport({b: ("in_progress", 1e12) for b in write.batch_ids}, [])


def _line(i: int) -> FinishedLine:
    return FinishedLine(i, "batch_x", "succeeded", 1.0, 200, "{}", TokenCounts(10, 0, 5))


def _writer(store: GatedStore, lease_seconds: int = 120) -> ResultWriter:
    settings = Settings(lease_seconds=lease_seconds)
    return ResultWriter(settings, store, "w", "m", "cpu", 0.0, export_metrics=False)  # type: ignore[arg-type]


def _renewing_write(writer: ResultWriter, store: GatedStore, at: float) -> None:
    """The first write-back renews (due): on this thread, whatever ``background`` says."""
    store.gate.set()
    assert writer.write(at, [1], {"batch_x"}, background=True) is not None
    assert store.writes[-1].held_ids == [1]
    store.gate.clear()
    store.entered.clear()


def test_background_write_returns_at_once_and_its_lines_stay_pending_until_stored() -> None:
    store = GatedStore()
    writer = _writer(store)
    _renewing_write(writer, store, 10.0)
    writer.add(_line(1))
    writer.busy_seconds = 2.0
    assert writer.write(11.0, [2], {"batch_x"}, background=True) is None  # started, not waited
    assert store.entered.wait(30)
    assert writer.row_ids() == [1]  # in flight: still this worker's
    writer.add(_line(2))  # the loop goes on stepping meanwhile
    writer.busy_seconds += 0.5
    # A second periodic write while one is in flight does nothing.
    assert writer.write(12.0, [], {"batch_x"}, background=True) is None
    store.gate.set()
    report = writer.write(13.0, [], {"batch_x"})  # a sync write waits for it, then writes
    assert report is not None and report.statuses == {"batch_x": ("in_progress", 1e12)}
    background, sync = store.writes[-2:]
    assert [r.id for r in background.results] == [1] and background.busy_seconds == 2.0
    assert background.held_ids == []  # not due: the heartbeat renews between
    assert [r.id for r in sync.results] == [2] and sync.busy_seconds == 0.5
    assert writer.pending == [] and writer.busy_seconds == 0.0


def test_background_outage_keeps_lines_and_seconds_for_the_next_write() -> None:
    store = GatedStore()
    writer = _writer(store)
    _renewing_write(writer, store, 10.0)
    writer.add(_line(1))
    writer.busy_seconds = 3.0
    store.fail = OperationalError("UPDATE", {}, Exception("server closed the connection"))
    writer.write(11.0, [], {"batch_x"}, background=True)
    store.gate.set()
    assert writer.write(12.0, [], {"batch_x"}) is None  # waited: the outage, then again down
    assert writer.row_ids() == [1] and writer.busy_seconds == pytest.approx(3.0)
    store.fail = None
    assert writer.write(13.0, [], {"batch_x"}) is not None
    assert [r.id for r in store.writes[-1].results] == [1]
    assert store.writes[-1].busy_seconds == pytest.approx(3.0)  # billed once, in full
    assert writer.pending == []


def test_background_refusal_is_raised_on_the_loop_thread_with_nothing_lost() -> None:
    store = GatedStore()
    writer = _writer(store)
    _renewing_write(writer, store, 10.0)
    writer.add(_line(1))
    writer.busy_seconds = 1.5
    store.fail = IntegrityError("UPDATE", {}, Exception("violates a constraint"))
    writer.write(11.0, [], {"batch_x"}, background=True)
    store.gate.set()
    with pytest.raises(IntegrityError):
        writer.write(12.0, [], {"batch_x"})
    assert writer.row_ids() == [1] and writer.busy_seconds == pytest.approx(1.5)


def test_leases_renewed_by_a_write_back_only_when_due() -> None:
    store = GatedStore()
    store.gate.set()
    writer = _writer(store, lease_seconds=100)
    due: list[Any] = []
    for at in (0.0, 1.0, 2.0, 100 * RENEW_FRACTION + 0.5, 100 * RENEW_FRACTION + 1.5):
        report = writer.write(at, [7], {"batch_x"})
        assert report is not None
        due.append((store.writes[-1].held_ids, report.renewed))
    assert due == [([7], True), ([], False), ([], False), ([7], True), ([], False)]


def test_a_write_with_nothing_held_goes_to_the_background_though_a_renewal_is_due() -> None:
    """An engine that empties every step (the instant engine) holds no line at its periodic
    write-backs: with nothing to renew, the write need not stay on the loop thread, and a
    renewal stays due for the first write that holds lines."""
    store = GatedStore()
    writer = _writer(store)
    writer.add(_line(1))
    assert writer.write(10.0, [], {"batch_x"}, background=True) is None  # started, not waited
    assert store.entered.wait(30) and writer.row_ids() == [1]
    store.gate.set()
    report = writer.write(11.0, [3], {"batch_x"})  # waits for it; lines held: renews
    assert report is not None and report.renewed
    first, renewing = store.writes
    assert [r.id for r in first.results] == [1] and first.held_ids == []
    assert renewing.held_ids == [3]


def test_answered_lines_get_their_records_built_by_the_background_write() -> None:
    """An answered line is held unbuilt (``results.Answered``); the periodic write builds its
    record on the writer's thread, with the token counts the runner counted from the start."""
    engine = InstantEngine("m")
    row = ClaimedRequest(4, "batch_x", "r4", "{}", 1)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    prepared = serving.prepare("4", "/v1/chat/completions", body, engine)
    result = EngineResult(
        "4", 9, 2, [Completion("ab", [1, 2], "stop"), Completion("c", [3], "stop")]
    )
    built_on: list[str] = []
    line = results.answered(row, prepared, result, 1_700_000_000, 5.0)
    assert line.tokens == TokenCounts(9, 2, 3) and line.status == "succeeded"

    class Watched(results.Answered):
        def line(self) -> FinishedLine:
            built_on.append(threading.current_thread().name)
            return super().line()

    watched = Watched(*(getattr(line, f) for f in line.__dataclass_fields__))
    store = GatedStore()
    writer = _writer(store)
    _renewing_write(writer, store, 10.0)
    writer.add(watched)
    writer.busy_seconds = 1.0
    writer.write(11.0, [], {"batch_x"}, background=True)
    store.gate.set()
    assert writer.write(12.0, [], {"batch_x"}) is not None  # waits for the background one
    assert built_on and all(name.startswith("write-back") for name in built_on)
    write = next(w for w in store.writes if w.results)
    (stored,) = write.results
    assert isinstance(stored, FinishedLine) and stored.tokens == line.tokens
    expected = results.succeeded(row, prepared, result, 1_700_000_000, 5.0)
    same = ("id", "batch_id", "status", "finished_at", "status_code", "tokens")
    assert [getattr(stored, f) for f in same] == [getattr(expected, f) for f in same]
    answer = records.load(stored.result or "")
    assert isinstance(answer, records.Answer) and answer.completion_tokens == 3
    assert write.per_batch["batch_x"].completion_tokens == 3 and writer.pending == []
