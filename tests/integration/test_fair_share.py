"""Fair share between tenants in the claims, on real PostgreSQL with the instant engine: a small
batch of one tenant is claimed within one claim of its validation behind another tenant's big
batch, weights divide the claims, urgent batches come before the share, and every line runs
exactly once."""

from __future__ import annotations

import itertools
import random
import secrets
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import func, select, update

import migrations
from api.services import keys
from offpeak.settings import ModelConfig, Settings
from storage.db import get_engine, session_scope
from storage.models import RequestLine, Tenant
from tests.integration.test_scheduler import make_batch
from tests.support.batches import line
from workers.engine.instant import InstantEngine
from workers.runner import Runner
from workers.scheduler.store import DbStore

MODEL = "fair-model"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "models": {MODEL: ModelConfig(engine="instant", max_num_seqs=16)},
            "flush_seconds": 0.05,
            "chunk_size": 32,
        }
    )


class Recording(DbStore):
    """Records the batch of every line each claim took; ``before_claim(n)`` runs before the
    claim numbered ``n`` (from 0)."""

    def __init__(self, url: str, before_claim: Callable[[int], None] = lambda _n: None) -> None:
        super().__init__(url)
        self.claims: list[list[str]] = []
        self.before_claim = before_claim

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        self.before_claim(len(self.claims))
        rows = super().claim(*args, **kwargs)
        self.claims.append([r.batch_id for r in rows])
        return rows

    def claim_shared(self, *args: Any, **kwargs: Any) -> Any:
        self.before_claim(len(self.claims))
        claimed = super().claim_shared(*args, **kwargs)
        self.claims.append([r.batch_id for r in claimed.rows])
        return claimed


def tenant_batch(settings: Settings, lines: int, *, weight: float = 1.0) -> str:
    """A new tenant of ``weight`` with a validated batch of ``lines`` lines; the batch id."""
    name = f"fair-{secrets.token_hex(4)}"
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.ensure_tenant(session, name)
        session.execute(update(Tenant).where(Tenant.id == tenant.id).values(weight=weight))
    return make_batch(settings, name, [line(f"{name}-{i}", model=MODEL) for i in range(lines)])


def ran_once(settings: Settings, *batch_ids: str) -> None:
    """Every line of the batches succeeded, each claimed exactly once."""
    with session_scope(settings.resolved_database_url) as session:
        rows = session.execute(
            select(RequestLine.status, RequestLine.attempts, func.count())
            .where(RequestLine.batch_id.in_(batch_ids))
            .group_by(RequestLine.status, RequestLine.attempts)
        ).all()
    assert [(status, attempts) for status, attempts, _ in rows] == [("succeeded", 1)], rows


def drain(settings: Settings, store: DbStore, owner: str) -> Runner:
    runner = Runner(settings, InstantEngine(MODEL), owner, store=store)
    runner.drain()
    return runner


def test_a_small_batch_is_claimed_within_one_claim_behind_a_big_one(settings: Settings) -> None:
    big = tenant_batch(settings, 300)
    small: list[str] = []

    def arrive(n: int) -> None:
        if n == 3:  # the big batch is running, most of it queued
            small.append(tenant_batch(settings, 5))

    store = Recording(settings.resolved_database_url, arrive)
    drain(settings, store, "w-small")
    assert small, "the small batch never arrived"
    # The first claim after its validation takes all of it, with the big batch's lines.
    assert store.claims[3].count(small[0]) == 5, store.claims[3]
    assert big in store.claims[3]
    ran_once(settings, big, small[0])


def test_weights_divide_the_claims(settings: Settings) -> None:
    heavy = tenant_batch(settings, 200, weight=2.0)
    light = tenant_batch(settings, 200, weight=1.0)
    store = Recording(settings.resolved_database_url)
    drain(settings, store, "w-weights")
    # While both wait (the heavy one has lines left), the heavy tenant gets two lines to one.
    taken: Counter[str] = Counter()
    for claim in store.claims:
        if taken[heavy] + claim.count(heavy) > 180:
            break
        taken.update(claim)
    assert taken[heavy] >= 100, store.claims
    assert 1.8 <= taken[heavy] / taken[light] <= 2.2, taken
    ran_once(settings, heavy, light)


def test_an_urgent_batch_comes_before_the_share(settings: Settings) -> None:
    early = tenant_batch(settings, 100)
    other = tenant_batch(settings, 100)
    urgent = tenant_batch(settings, 40)  # the latest deadline, but short of slack
    store = Recording(settings.resolved_database_url)
    runner = Runner(settings, InstantEngine(MODEL), "w-urgent", store=store)
    runner.urgency.urgent.add(urgent)
    runner.drain()
    # Its 40 lines fill the first claims whole; only then do the others share.
    left = 40
    for claim in store.claims:
        assert claim.count(urgent) == min(left, len(claim)), store.claims
        left -= claim.count(urgent)
        if not left:
            break
    ran_once(settings, early, other, urgent)


def test_claims_on_sqlite_share_and_never_repeat_a_line(settings: Settings, tmp_path: Any) -> None:
    """The same arms outside PostgreSQL, straight on the repository."""
    from storage.repositories import shared_claims
    from storage.repositories.shared_claims import Shares

    url = f"sqlite:///{tmp_path / 'fair.db'}"
    migrations.upgrade(url)
    lite = settings.model_copy(update={"database_url": url, "data_dir": tmp_path})
    big = tenant_batch(lite, 60)
    small = tenant_batch(lite, 5)
    seen: list[int] = []
    with session_scope(url) as session:
        first = shared_claims.claim_shared(
            session, model=MODEL, limit=10, owner="w", lease_until=2e9, at=1e9,
            shares=Shares(quotas=((big, 5), (small, 5))),
        )  # fmt: skip
        seen += [r.id for r in first.rows]
        assert Counter(r.batch_id for r in first.rows) == {big: 5, small: 5}
        assert {w.batch_id for w in first.waiting} == {big, small}
        while rows := shared_claims.claim_shared(
            session, model=MODEL, limit=16, owner="w", lease_until=2e9, at=1e9,
            shares=Shares(known=(big, small), fresh=4),
        ).rows:  # fmt: skip
            seen += [r.id for r in rows]
    assert len(seen) == len(set(seen)) == 65
    get_engine(url).dispose()


class RecordingIds(Recording):
    """Records ``(batch id, custom_id)`` of every line each claim took, as well."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.lines: list[list[tuple[str, str]]] = []

    def claim_shared(self, *args: Any, **kwargs: Any) -> Any:
        claimed = super().claim_shared(*args, **kwargs)
        self.lines.append([(r.batch_id, r.custom_id) for r in claimed.rows])
        return claimed


def grouped_batch(settings: Settings, documents: int, questions: int, window: str = "24h") -> str:
    """A new tenant's batch of ``documents × questions`` lines, each a document then a question
    (custom_id ``d<doc>-q<question>``), in a shuffled file order; document ``d`` is twice as
    long as document ``d - 1``."""
    name = f"fair-{secrets.token_hex(4)}"
    pairs = [(d, q) for d in range(documents) for q in range(questions)]
    random.Random(name).shuffle(pairs)
    lines = [
        line(
            f"d{d}-q{q}",
            model=MODEL,
            body_messages=[{"role": "user", "content": f"{document(name, d)}\nQuestion {q}?"}],
        )
        for d, q in pairs
    ]
    return make_batch(settings, name, lines, window)


def document(name: str, d: int) -> str:
    return f"Document {name} {d}: " + "clause " * (8 << d)


def test_grouped_work_of_two_tenants_is_shared_and_claimed_group_by_group(
    settings: Settings,
) -> None:
    """Prefix groups order lines inside each batch's share, never across it: two tenants with
    shuffled files of 6 documents × 10 questions each get equal shares while both wait, and
    each batch's lines are claimed group by group (the claims that take one document's lines
    touch those of the next at most, never interleave with them), the longest document first."""
    first = grouped_batch(settings, 6, 10)
    second = grouped_batch(settings, 6, 10)
    store = RecordingIds(settings.resolved_database_url)
    drain(settings, store, "w-grouped")
    taken: Counter[str] = Counter()
    for claim in store.claims:
        if max(taken[first] + claim.count(first), taken[second] + claim.count(second)) > 50:
            break
        taken.update(claim)
    assert taken[first] >= 20 and 0.8 <= taken[first] / taken[second] <= 1.25, store.claims
    for batch_id in (first, second):
        spans: dict[str, list[int]] = {}
        for index, claim_lines in enumerate(store.lines):
            for owner, custom_id in claim_lines:
                if owner == batch_id:
                    document = custom_id.split("-")[0]
                    spans.setdefault(document, [index, index])[1] = index
        intervals = sorted(spans.values())
        assert len(intervals) == 6
        for (_, end), (start, _) in itertools.pairwise(intervals):
            assert start >= end, f"documents interleave across claims: {intervals}"
        # Largest shared prefix first: a longer document is never claimed after a shorter one.
        starts = [spans[f"d{d}"][0] for d in reversed(range(6))]
        assert starts == sorted(starts), f"longest document first: {spans}"
    ran_once(settings, first, second)


def test_grouped_work_never_takes_a_batch_past_its_deadline(settings: Settings) -> None:
    """Largest prefix first ranks groups only inside the fair share and the deadline: a batch
    due in one hour whose documents are all shorter than a big batch's gets its share from the
    first claim on (beside the big batch's longest document), and both run to the end."""
    hourly = settings.model_copy(update={"allowed_completion_windows": ["24h", "1h"]})
    big = grouped_batch(hourly, 6, 10)
    soon = grouped_batch(hourly, 2, 5, window="1h")
    store = RecordingIds(settings.resolved_database_url)
    drain(settings, store, "w-deadline")
    # Its share from the first claim on: the whole batch in the first two of five claims.
    assert sum(claim.count(soon) for claim in store.claims[:2]) == 10, store.claims
    # The big batch's part of the first claim is its longest document's lines.
    taken = {custom_id.split("-")[0] for owner, custom_id in store.lines[0] if owner == big}
    assert taken == {"d5"}, store.lines[0]
    ran_once(settings, big, soon)
