"""Fair share between tenants in the claims, on real PostgreSQL with the instant engine: a small
batch of one tenant is claimed within one claim of its validation behind another tenant's big
batch, weights divide the claims, urgent batches come before the share, and every line runs
exactly once."""

from __future__ import annotations

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
