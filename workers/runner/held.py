"""The request lines a runner holds in memory, and how they join the engine.

A held line was claimed (its lease is this worker's) and prepared; it is either *queued* here,
waiting for room in the engine, or *running* inside it. ``HeldLines`` is the one place that
knows which, so yields, cancels, lease losses and hand-backs all take lines from it.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from storage.repositories.requests import ClaimedRequest
from workers.engine.base import Engine, EngineFault
from workers.engine_io import LineError, Prepared
from workers.scheduler.chunking import shared_prefix_tokens

#: A line claimed this many times is a suspect: it was inside an engine (or a worker) that died
#: at least once. Suspects run one at a time beside clean lines, so a line that kills the engine
#: again is the only line charged with it (``Settings.max_line_attempts``).
SUSPECT_ATTEMPTS = 2
#: Prompt tokens an engine step is taken to prefill: vLLM's smallest default token budget per
#: step with chunked prefill (``max_num_batched_tokens`` 2048, its OpenAI server's on most GPUs;
#: the offline ``LLM``'s is larger), so a line has prefilled once it has been in the engine for
#: ``ceil(prompt / PREFILL_TOKENS_PER_STEP)`` steps.
PREFILL_TOKENS_PER_STEP = 2048
#: The most engine steps a line waits for its group's first line, however long that prompt.
MAX_PREFILL_STEPS = 8


@dataclass
class HeldLine:
    """A claimed request line and the engine request prepared from it."""

    row: ClaimedRequest
    prepared: Prepared
    #: The first line of its prefix group in its chunk, when it shares a long prefix with it
    #: (``admission.mark_leaders``): it joins the engine once that line has prefilled.
    leader: HeldLine | None = field(default=None, repr=False, compare=False)
    #: The engine step it joined the engine at (``HeldLines.steps``); -1: not yet.
    joined: int = field(default=-1, repr=False, compare=False)

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
        #: Engine steps run (``stepped``): the clock of a first line's prefill.
        self.steps = 0

    def stepped(self) -> None:
        """Note that the engine ran a step."""
        self.steps += 1

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
        """Queue ``lines`` (a claimed chunk, in its order). Urgent lines (priority below the
        default 0) join behind the queued urgent ones, at the front. The others join batch by
        batch, each batch's lines together and in their order, ahead of the queued lines of
        every batch holding more lines than theirs (queued or running), else at the back.

        So a batch that just started (none held) goes ahead of what other batches have queued,
        and so does a small batch's next claim while its first lines run: it waits for the
        engine's room, not for a big batch's queue to drain. Batches holding alike keep their
        claim order; the claims' fair share (``workers.scheduler.fair_share``) decides how many
        lines each holds."""
        lines = list(lines)
        if not self.queued:
            self.queued.extend(lines)
            return
        queued = list(self.queued)
        holding = Counter(h.row.batch_id for h in queued)
        holding.update(h.row.batch_id for h in self.running.values())
        urgent = 0
        while urgent < len(queued) and queued[urgent].prepared.request.priority < 0:
            urgent += 1
        by_batch: dict[str, list[HeldLine]] = {}
        new_urgent: list[HeldLine] = []
        for h in lines:
            if h.prepared.request.priority < 0:
                new_urgent.append(h)
            else:
                by_batch.setdefault(h.row.batch_id, []).append(h)
        for batch_id, group in by_batch.items():
            mine = holding[batch_id]
            at = next(
                (i for i in range(urgent, len(queued)) if holding[queued[i].row.batch_id] > mine),
                len(queued),
            )
            queued[at:at] = group
            holding[batch_id] += len(group)
        queued[urgent:urgent] = new_urgent
        self.queued = deque(queued)

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

    def engine_needs(self, shared_block: int | None = None) -> list[tuple[int, int]]:
        """``(prompt tokens, max new tokens)`` per sequence held, for sizing: what each line's
        endpoint says it needs (``Endpoint.engine_needs``; ``n`` sequences for text).

        With ``shared_block`` (an engine with prefix caching, its KV block in tokens), a prompt
        prefix that held lines share takes its blocks once: each line's prompt counts without
        the whole blocks it shares with the line before it in prompt order
        (``chunking.shared_prefix_tokens``)."""
        held = self.all()
        if not shared_block:
            return [need for h in held for need in h.prepared.needs]
        shared = shared_prefix_tokens(
            [h.prepared.request.prompt_token_ids for h in held], shared_block
        )
        return [
            (max(1, prompt - saved), reply)
            for h, saved in zip(held, shared, strict=True)
            for prompt, reply in h.prepared.needs
        ]

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

        A line with a ``leader`` (its prefix group's first line, with which it shares a long
        prompt prefix) waits while that line prefills alone (``prefilling``), so it reuses the
        prefix from the KV cache instead of computing it beside it. It keeps its place and counts
        against ``feed`` meanwhile, so the lines in the engine are those that would have been;
        lines of other groups behind it still join.

        Raises ``EngineFault`` when ``add`` fails with anything else: the engine is broken, and
        the line being added counts as running (a line that breaks ``add`` every time is caught
        by the attempts cap instead of looping forever).
        """
        # Looked up only when a suspect is next in line: suspects are rare, admissions are not.
        suspect_running: bool | None = None
        waiting: list[HeldLine] = []
        siblings = 0
        try:
            while self.queued and len(self.running) + siblings < feed:
                if not admissible(self.queued[0].row.batch_id):
                    break
                held = self.queued.popleft()
                if held.leader is not None and self.prefilling(held.leader):
                    waiting.append(held)
                    siblings += 1
                    continue
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
                    status = getattr(exc, "status_code", 400)
                    refused(held, LineError(str(exc), param, code, status))
                    continue
                except Exception as exc:
                    self.running[held.request_id] = held
                    raise EngineFault(
                        f"engine refused a request: {exc!r}", list(self.running)
                    ) from exc
                self.running[held.request_id] = held
                held.joined = self.steps
        finally:
            self.queued.extendleft(reversed(waiting))

    def prefilling(self, line: HeldLine) -> bool:
        """Whether ``line`` is running and has been in the engine fewer steps than its prefill
        takes (``PREFILL_TOKENS_PER_STEP``, at most ``MAX_PREFILL_STEPS``: the bound on a
        sibling's wait). Steps advance while it runs, and a line that ended, was refused or was
        taken out is not prefilling, so a wait for it always ends."""
        if line.joined < 0 or self.running.get(line.request_id) is not line:
            return False
        prompt = len(line.prepared.request.prompt_token_ids)
        steps = min(MAX_PREFILL_STEPS, max(1, math.ceil(prompt / PREFILL_TOKENS_PER_STEP)))
        return self.steps - line.joined < steps
