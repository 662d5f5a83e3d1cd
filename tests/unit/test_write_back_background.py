"""The runner's background write-back (``workers.runner.write_back``).

The store is a recording fake (the test is about the writer's threading and bookkeeping, not the
database: the database path runs in ``tests/integration/test_scheduler.py`` and ``bench
overhead``). It blocks a write until the test lets it go, so "in flight" is a state the test
holds, not a race.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from offpeak.endpoints import records
from offpeak.settings import Settings
from storage.repositories.requests import ClaimedRequest, FinishedLine, TokenCounts
from workers import engine_io
from workers.engine.base import Completion, EngineResult
from workers.engine.instant import InstantEngine
from workers.runner import results
from workers.runner.write_back import RENEW_FRACTION, ResultWriter
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


def test_background_writes_return_at_once_two_in_flight_and_lines_stay_pending_until_stored() -> (
    None
):
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
    # A second periodic write starts beside the first, with the line the first does not hold.
    assert writer.write(12.0, [], {"batch_x"}, background=True) is None
    assert writer.unsent() == 0
    writer.add(_line(3))
    writer.busy_seconds += 0.25
    # A third, with MAX_IN_FLIGHT (two) in flight, does nothing.
    assert writer.write(12.5, [], {"batch_x"}, background=True) is None
    assert writer.row_ids() == [1, 2, 3] and writer.unsent() == 1
    store.gate.set()
    report = writer.write(13.0, [], {"batch_x"})  # a sync write waits for both, then writes
    assert report is not None and report.statuses == {"batch_x": ("in_progress", 1e12)}
    by_line = {tuple(r.id for r in w.results): w for w in store.writes[1:]}
    assert sorted(by_line) == [(1,), (2,), (3,)], "each line in one write, once"
    assert by_line[(1,)].busy_seconds == 2.0 and by_line[(2,)].busy_seconds == 0.5
    assert by_line[(3,)].busy_seconds == 0.25 and store.writes[-1] is by_line[(3,)]
    assert by_line[(1,)].held_ids == []  # not due: the heartbeat renews between
    assert writer.pending == [] and writer.busy_seconds == 0.0


def test_the_older_of_two_writes_in_flight_fails_and_nothing_is_lost_or_stored_twice() -> None:
    """Fault injected: of two writes in flight, the older meets an outage and the younger is
    stored. The younger's lines leave ``pending``; the older's stay (ahead of the younger's
    in the list) with their engine seconds, and the next write stores them, once."""

    class FirstWriteDown(GatedStore):
        def write_back(self, write: WriteBack) -> WriteBackReport:
            if [r.id for r in write.results] == [1] and self.fail is not None:
                self.entered.set()
                assert self.gate.wait(30)
                fail, self.fail = self.fail, None
                raise fail
            self.writes.append(write)
            return WriteBackReport({b: ("in_progress", 1e12) for b in write.batch_ids}, [])

    store = FirstWriteDown()
    store.fail = OperationalError("UPDATE", {}, Exception("server closed the connection"))
    writer = _writer(store)
    writer.add(_line(1))
    writer.busy_seconds = 3.0
    writer.write(10.0, [], {"batch_x"}, background=True)
    assert store.entered.wait(30)
    writer.add(_line(2))
    writer.busy_seconds += 1.0
    writer.write(11.0, [], {"batch_x"}, background=True)  # the younger: stored at once
    deadline = time.monotonic() + 30
    while not store.writes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [[r.id for r in w.results] for w in store.writes] == [[2]]
    # Applied oldest first: the younger's report waits for the older's outcome.
    assert writer.write(11.5, [], set(), background=True) is None
    assert writer.row_ids() == [1, 2]
    store.gate.set()
    assert writer.write(12.0, [], {"batch_x"}) is not None  # waits, then writes what is left
    assert [[r.id for r in w.results] for w in store.writes] == [[2], [1]]
    assert store.writes[0].busy_seconds == pytest.approx(1.0)
    assert store.writes[1].busy_seconds == pytest.approx(3.0)  # given back, billed once
    assert writer.pending == [] and writer.unsent() == 0 and writer.busy_seconds == 0.0


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
    prepared = engine_io.prepare("4", "/v1/chat/completions", body, engine)
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


def test_held_bytes_follow_the_lines_and_settle_waits_for_every_write_in_flight() -> None:
    """``held_bytes`` (the loop's ``MAX_HELD_BYTES`` bound) counts every line held, the
    writes in flight's included, and drops with the lines stored, not with those an outage
    kept. ``settle`` (past that bound) applies every write in flight before the next starts."""
    store = GatedStore()
    writer = _writer(store)
    for i in (1, 2, 3):
        writer.add(_line(i))
    assert writer.held_bytes == 3 * len("{}")
    writer.write(10.0, [], {"batch_x"}, background=True)
    assert store.entered.wait(30)
    writer.add(_line(4))
    writer.write(11.0, [], {"batch_x"}, background=True)
    assert writer.held_bytes == 4 * len("{}")  # in flight: still held
    writer.add(FinishedLine(5, "batch_x", "failed", 1.0, 400, '{"a": 1}', TokenCounts()))
    releaser = threading.Timer(0.2, store.gate.set)
    releaser.start()
    # Two in flight: ``settle`` applies both (waiting for room alone would apply the older
    # and leave line 4 held), then starts the next, with line 5, in the background.
    assert writer.write(12.0, [], {"batch_x"}, background=True, settle=True) is not None
    assert writer.row_ids() == [5] and writer.held_bytes == len('{"a": 1}')
    assert writer.write(13.0, [], {"batch_x"}) is not None  # waits for line 5's write
    assert sorted(r.id for w in store.writes for r in w.results) == [1, 2, 3, 4, 5]
    assert writer.held_bytes == 0 and writer.pending == []
    writer.add(_line(6))
    store.fail = OperationalError("UPDATE", {}, Exception("server closed the connection"))
    assert writer.write(14.0, [], {"batch_x"}) is None  # the outage: line 6 stays held
    assert writer.held_bytes == len("{}") and writer.row_ids() == [6]
    store.fail = None
    assert writer.write(15.0, [], {"batch_x"}) is not None
    assert writer.held_bytes == 0 and writer.pending == []
