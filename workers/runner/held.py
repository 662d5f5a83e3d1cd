"""The request lines a runner holds in memory, and how they join the engine.

A held line was claimed (its lease is this worker's) and prepared; it is either *queued* here,
waiting for room in the engine, or *running* inside it. ``HeldLines`` is the one place that
knows which, so yields, cancels, lease losses and hand-backs all take lines from it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from storage.repositories.requests import ClaimedRequest
from workers.engine.base import Engine, EngineFault
from workers.engine_io import LineError, Prepared

#: A line claimed this many times is a suspect: it was inside an engine (or a worker) that died
#: at least once. Suspects run one at a time beside clean lines, so a line that kills the engine
#: again is the only line charged with it (``Settings.max_line_attempts``).
SUSPECT_ATTEMPTS = 2


@dataclass
class HeldLine:
    """A claimed request line and the engine request prepared from it."""

    row: ClaimedRequest
    prepared: Prepared

    @property
    def request_id(self) -> str:
        """The engine's id for it (the row id as text)."""
        return self.prepared.request.request_id

    @property
    def suspect(self) -> bool:
        return self.row.attempts >= SUSPECT_ATTEMPTS


class HeldLines:
    """Queued lines (in claim order, ordered by prefix per chunk) and running ones (by request
    id). Not thread-safe, except ``row_ids``, which the lease heartbeat reads."""

    def __init__(self) -> None:
        self.queued: deque[HeldLine] = deque()
        self.running: dict[str, HeldLine] = {}
        #: Batches of lines held (a superset: cleared whenever nothing is held).
        self._batch_ids: set[str] = set()

    def __len__(self) -> int:
        return len(self.queued) + len(self.running)

    def all(self) -> list[HeldLine]:
        return [*self.running.values(), *self.queued]

    def row_ids(self) -> list[int]:
        """Ids of every held row. Safe from another thread: copying a deque or a dict's values
        holds the GIL throughout."""
        return [h.row.id for h in (*tuple(self.queued), *tuple(self.running.values()))]

    def batch_ids(self) -> set[str]:
        """Batches whose status the write-back should report back (see ``note_batches``)."""
        if not self.queued and not self.running:
            self._batch_ids.clear()
        return set(self._batch_ids)

    def note_batches(self, batch_ids: Iterable[str]) -> None:
        self._batch_ids.update(batch_ids)

    def forget_batches(self, batch_ids: Iterable[str]) -> None:
        self._batch_ids -= set(batch_ids)

    def queue(self, lines: Iterable[HeldLine]) -> None:
        """Queue ``lines`` (a claimed chunk, in its order) behind the queued lines; those of a
        batch with no line held go ahead of the queued lines of other batches (behind urgent
        ones, whose priority is below the default 0): a batch that just started waits for the
        engine's room, not for what other batches have queued."""
        if not self.queued:
            self.queued.extend(lines)
            return
        lines = list(lines)
        held = {h.row.batch_id for h in (*self.queued, *self.running.values())}
        starting = [h for h in lines if h.row.batch_id not in held]
        if not starting:
            self.queued.extend(lines)
            return
        urgent = 0
        while urgent < len(self.queued) and self.queued[urgent].prepared.request.priority < 0:
            urgent += 1
        self.queued.rotate(-urgent)
        self.queued.extendleft(reversed(starting))
        self.queued.rotate(urgent)
        self.queued.extend(h for h in lines if h.row.batch_id in held)

    def finished(self, request_id: str) -> HeldLine | None:
        """The running line ``request_id``, no longer running; ``None`` if it was aborted."""
        return self.running.pop(request_id, None)

    def take_queued(self, which: Callable[[HeldLine], bool]) -> list[HeldLine]:
        """Remove and return the queued lines ``which`` selects."""
        taken = [h for h in self.queued if which(h)]
        if taken:
            self.queued = deque(h for h in self.queued if not which(h))
        return taken

    def take_running(self, which: Callable[[HeldLine], bool]) -> list[HeldLine]:
        """Remove and return the running lines ``which`` selects (the caller aborts them)."""
        taken = [h for h in self.running.values() if which(h)]
        for h in taken:
            del self.running[h.request_id]
        return taken

    def engine_needs(self) -> list[tuple[int, int]]:
        """``(prompt tokens, max new tokens)`` per sequence held, for sizing: what each line's
        endpoint says it needs (``Endpoint.engine_needs``; ``n`` sequences for text)."""
        return [need for h in self.all() for need in h.prepared.needs]

    def admit(
        self,
        engine: Engine,
        feed: int,
        admissible: Callable[[str], bool],
        refused: Callable[[HeldLine, LineError], None],
    ) -> None:
        """Move queued lines into ``engine`` until ``feed`` run or the next line's batch is not
        ``admissible``. A suspect (see ``SUSPECT_ATTEMPTS``) joins only while no other suspect
        runs; it keeps its place at the front of the queue meanwhile. A line the engine refuses
        (``ValueError``: a verdict on the request) goes to ``refused``.

        Raises ``EngineFault`` when ``add`` fails with anything else: the engine is broken, and
        the line being added counts as running (a line that breaks ``add`` every time is caught
        by the attempts cap instead of looping forever).
        """
        # Looked up only when a suspect is next in line: suspects are rare, admissions are not.
        suspect_running: bool | None = None
        waiting: list[HeldLine] = []
        try:
            while self.queued and len(self.running) < feed:
                if not admissible(self.queued[0].row.batch_id):
                    break
                held = self.queued.popleft()
                if held.suspect:
                    if suspect_running is None:
                        suspect_running = any(h.suspect for h in self.running.values())
                    if suspect_running:
                        waiting.append(held)
                        continue
                    suspect_running = True
                try:
                    engine.add(held.prepared.request)
                except ValueError as exc:
                    # RequestRefused names the field and code when the engine knows them.
                    param, code = getattr(exc, "param", None), getattr(exc, "code", None)
                    refused(held, LineError(str(exc), param, code))
                    continue
                except Exception as exc:
                    self.running[held.request_id] = held
                    raise EngineFault(
                        f"engine refused a request: {exc!r}", list(self.running)
                    ) from exc
                self.running[held.request_id] = held
        finally:
            self.queued.extendleft(reversed(waiting))
