"""Weighted fair sharing of a model's claims between tenants, inside the deadline guard.

Each claim is split between the tenants with work waiting in proportion to their weights
(``tenants.weight``), then between a tenant's batches evenly, then taken line by line. What a
tenant has been served is its *virtual time*: lines claimed for it divided by its weight. A claim
fills the tenants with the least virtual time first, up to a common level (water filling), so
over claims each backlogged tenant gets lines in proportion to its weight: start-time fair
queueing (Goyal, Vin and Cheng, SIGCOMM 1996) with a line as the unit of work. A tenant that
starts waiting joins at the least virtual time of the tenants already waiting: it gets its share
from its first claim, not a burst for the time it was away.

Urgent batches (``workers.runner.urgency``) come before the share; lines the share cannot place
(its counts include lines already running) go earliest deadline first, so no claim is short while
lines are runnable (``storage.repositories.shared_claims``).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from storage.repositories.shared_claims import SharedClaim, Shares, WaitingBatch

#: Bisections of the water level: far below one line of any tenant's share.
_BISECTIONS = 50
#: The least weight a tenant counts with (a weight of 0 would take it out of the share: a
#: tenant with work waiting is always served, however slowly).
MIN_WEIGHT = 0.01


@dataclass(frozen=True)
class Claimant:
    """One party to a share: its virtual time (``level``), ``weight`` and most lines (``cap``)."""

    key: str
    level: float
    weight: float
    cap: int


def water_fill(total: int, claimants: Sequence[Claimant]) -> dict[str, int]:
    """Split ``total`` lines so that ``level + lines / weight`` is as equal as the caps allow,
    the least-served first; whole lines, at most ``cap`` each, ``total`` in all unless the
    caps hold less. Weights must be positive."""
    if sum(c.cap for c in claimants) <= total:
        return {c.key: c.cap for c in claimants}
    if len(claimants) == 1:  # one tenant, or a tenant's one batch: every claim of a lone batch
        return {claimants[0].key: total}

    def poured(water: float) -> float:
        return sum(min(c.cap, max(0.0, (water - c.level) * c.weight)) for c in claimants)

    low = min(c.level for c in claimants)
    high = max(c.level + c.cap / c.weight for c in claimants)
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if poured(middle) < total:
            low = middle
        else:
            high = middle
    lines = {c.key: min(c.cap, int(max(0.0, (low - c.level) * c.weight))) for c in claimants}
    for _ in range(total - sum(lines.values())):
        c = min(
            (c for c in claimants if lines[c.key] < c.cap),
            key=lambda c: (c.level + (lines[c.key] + 1) / c.weight, c.key),
        )
        lines[c.key] += 1
    return lines


class FairShare:
    """One model's fair share across its claims (thread-safe: claims run on claim threads).

    ``shares`` says what the next claim takes; ``settle`` takes in what a claim took and the
    waiting batches it saw. A share is computed from the batches the last claim saw: a batch
    that started since then gets ``Shares.fresh`` lines, so it starts in the claim after its
    validation whatever else is queued.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: Virtual time of each tenant with work waiting.
        self._served: dict[str, float] = {}
        self._waiting: list[WaitingBatch] = []
        self._tenant_of: dict[str, WaitingBatch] = {}
        #: Whether a claim (or a look at the waiting batches) has been settled.
        self.seen = False

    def shares(self, limit: int, urgent: Collection[str]) -> Shares:
        """What a claim of ``limit`` lines takes: ``urgent`` batches first (earliest deadline
        first), then each tenant's share, split evenly between its batches."""
        with self._lock:
            waiting, served = list(self._waiting), dict(self._served)
        by_tenant: dict[str, list[WaitingBatch]] = defaultdict(list)
        for batch in sorted(waiting, key=lambda b: (b.expires_at, b.batch_id)):
            if batch.batch_id not in urgent and batch.left > 0:
                by_tenant[batch.tenant_id].append(batch)
        deadlines = {b.batch_id: b.expires_at for b in waiting}
        ordered_urgent = sorted(urgent, key=lambda b: (deadlines.get(b, float("inf")), b))
        tenants = water_fill(
            limit,
            [
                Claimant(tenant, served.get(tenant, 0.0), _weight(batches[0]), _left(batches))
                for tenant, batches in by_tenant.items()
            ],
        )
        quotas: list[tuple[str, int]] = []
        # The least-served tenants' lines first: if the claim is cut short, theirs are in it.
        for tenant in sorted(tenants, key=lambda t: (served.get(t, 0.0), t)):
            batches = by_tenant[tenant]
            split = water_fill(
                tenants[tenant], [Claimant(b.batch_id, 0.0, 1.0, b.left) for b in batches]
            )
            quotas += [(b.batch_id, split[b.batch_id]) for b in batches if split[b.batch_id]]
        return Shares(
            urgent=tuple(ordered_urgent),
            quotas=tuple(quotas),
            known=tuple(b.batch_id for b in waiting),
            fresh=max(1, limit // (len(by_tenant) + 1)),
        )

    @staticmethod
    def fresh(limit: int, waiting: Sequence[WaitingBatch]) -> int:
        """Lines of a claim of ``limit`` for each batch that just started: a share as if its
        tenant were one more among those with lines left in ``waiting``."""
        tenants = {b.tenant_id for b in waiting if b.left > 0}
        return max(1, limit // (len(tenants) + 1))

    @staticmethod
    def newcomers(waiting: Sequence[WaitingBatch], held: Collection[str]) -> list[str]:
        """Batches of ``waiting`` with lines left none of whose lines are ``held``, by id: those
        that started since the last claim, and those a claim saw but took nothing of (their
        lines were still locked by the transaction that wrote them, so ``SKIP LOCKED`` passed
        them by). Seen or not, such a batch waits for the next claim, which a full queue may
        not make for minutes."""
        return sorted(b.batch_id for b in waiting if b.left > 0 and b.batch_id not in held)

    def settle(self, claim: SharedClaim) -> None:
        """Charge each line ``claim`` took to its tenant and keep the waiting batches it saw. A
        tenant that starts waiting joins at the least virtual time of those still waiting; one
        that stopped waiting is forgotten."""
        with self._lock:
            self.seen = True
            tenants = {b.tenant_id for b in claim.waiting}
            staying = [self._served[t] for t in tenants if t in self._served]
            joins_at = min(staying, default=0.0)
            self._served = {t: self._served.get(t, joins_at) for t in tenants}
            self._waiting = list(claim.waiting)
            self._tenant_of = {b.batch_id: b for b in claim.waiting}
            for batch_id, lines in Counter(row.batch_id for row in claim.rows).items():
                batch = self._tenant_of.get(batch_id)
                if batch is not None:
                    self._served[batch.tenant_id] += lines / _weight(batch)

    def served(self) -> dict[str, float]:
        """Each waiting tenant's virtual time (lines claimed over its weight)."""
        with self._lock:
            return dict(self._served)


def _left(batches: Sequence[WaitingBatch]) -> int:
    return sum(b.left for b in batches)


def _weight(batch: WaitingBatch) -> float:
    return max(MIN_WEIGHT, batch.weight)
