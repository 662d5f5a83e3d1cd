"""Claims shared between tenants: the lines a claim takes from each batch, as the fair share
(``workers.scheduler.fair_share``) decided, with urgent batches first and the rest of the claim
filled earliest deadline first, so a claim is never short while lines are runnable.

A claim is one statement on PostgreSQL (``shared_claim_statement``), pipelined with the
transaction's ``BEGIN``, its planner setting and ``WAITING_BATCHES`` (what the next claim's share
is computed from): one round trip, as ``requests.claim``. Each batch's lines come from a probe of
``ix_requests_pending`` (a batch's pending lines in claim order) rather than a walk of the model's
claim index, so a small batch behind a large one costs what its own lines cost, and a large
batch's probe does not grow with the lines claimed before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from sqlalchemy import ColumnElement, select
from sqlalchemy.orm import Session

from offpeak.statuses import LineStatus
from storage.db import driver_connection, is_postgres
from storage.models import Batch, RequestLine, Tenant
from storage.repositories.requests import CLAIMABLE, ClaimedRequest, lease_statement


@dataclass(frozen=True)
class WaitingBatch:
    """An ``in_progress`` batch of the model: its tenant and weight, lines not finished yet
    (pending or running) and its deadline (unix seconds)."""

    batch_id: str
    tenant_id: str
    weight: float
    left: int
    expires_at: int


@dataclass(frozen=True)
class Shares:
    """What one claim takes, in this order: lines of the ``urgent`` batches (earliest deadline
    first), up to ``fresh`` lines of each running batch the share has not seen yet (not in
    ``known``), up to ``quotas[batch_id]`` lines of each batch of ``quotas`` (in their order),
    then, with ``fill``, lines whose lease lapsed and any runnable lines, earliest deadline
    first, up to the claim's limit. Without ``fill`` only those batches' pending lines are
    taken, each batch from its own pending lines (a claim of a few batches beside a large one
    never walks the large one's)."""

    urgent: tuple[str, ...] = ()
    quotas: tuple[tuple[str, int], ...] = ()
    known: tuple[str, ...] = ()
    fresh: int = 0
    fill: bool = True


@dataclass
class SharedClaim:
    """A claim's rows (in id order) and the model's waiting batches as the claim saw them."""

    rows: list[ClaimedRequest]
    waiting: list[WaitingBatch] = field(default_factory=list)


#: The claim's planner settings, for its transaction only, in one statement: no sort (as
#: ``requests.NO_SORTS``), and a batch's lines from a plain scan of ``ix_requests_pending`` that
#: stops at its quota. With one big batch's statistics the planner took every row for a match and
#: read the table from its start, past every line claimed before; with several, a bitmap scan
#: read every pending entry of each batch on every claim. And a plan made for each claim's values.
PLANNER_SETTINGS = (
    "SELECT set_config('enable_sort', 'off', true), set_config('enable_seqscan', 'off', true), "
    "set_config('enable_bitmapscan', 'off', true), "
    "set_config('plan_cache_mode', 'force_custom_plan', true)"
)

#: The running batches' ids (not paused), once per statement (an InitPlan).
_RUNNING = "ARRAY(SELECT id FROM batches WHERE status = 'in_progress' AND paused_at IS NULL)"

#: The model's waiting batches with their tenants' weights (``WaitingBatch``'s fields).
WAITING_BATCHES = (
    "SELECT b.id, b.tenant_id, t.weight, b.total - b.completed - b.failed, b.expires_at "
    "FROM batches AS b JOIN tenants AS t ON t.id = b.tenant_id "
    "WHERE b.status = 'in_progress' AND b.paused_at IS NULL AND b.model = %(model)s"
)


def _per_batch(source: str, quota: str) -> str:
    """Up to ``quota`` pending lines of each batch ``source`` names (its column ``batch_id``),
    batch after batch, each in claim order: one probe of ``ix_requests_pending`` each."""
    # An order that only indexes keyed or filtered on status give without a sort: unordered,
    # or by id, statistics from while every line was pending had the planner read the batch by
    # (batch, line) or the primary key, past every line claimed before.
    return (
        f"SELECT q.id FROM {source} CROSS JOIN LATERAL ("
        "SELECT id FROM requests WHERE batch_id = s.batch_id AND status = 'pending' "
        "AND model = %(model)s AND deadline > %(after)s "
        f"ORDER BY deadline, prefix_group, id LIMIT {quota} FOR UPDATE SKIP LOCKED) AS q"
    )


@cache
def shared_claim_statement(urgent: bool, quotas: bool, fill: bool = True) -> str:
    """The claim on PostgreSQL, with or without its ``urgent`` and ``quotas`` arms (an empty
    list would still walk the model's claim index) and its ``fill`` arms (lapsed leases, then
    any runnable line: walks of the model's claim index). The arms run in order under one
    ``LIMIT``, each only when the ones before left room; the last one skips the rows the others
    took (``FOR UPDATE SKIP LOCKED`` does not skip rows of its own transaction)."""
    arms = []
    if fill:
        arms.append(
            "SELECT id FROM (SELECT id FROM requests WHERE model = %(model)s "
            f"AND status = 'running' AND deadline > %(after)s AND batch_id = ANY({_RUNNING}) "
            "AND lease_expires_at < %(at)s ORDER BY deadline, prefix_group, id LIMIT %(limit)s "
            "FOR UPDATE SKIP LOCKED) AS lapsed"
        )
    if urgent:
        source = (
            "(SELECT batch_id FROM unnest(%(urgent)s::varchar[]) AS u(batch_id) "
            f"WHERE batch_id = ANY({_RUNNING})) AS s"
        )
        arms.append(_per_batch(source, "%(limit)s"))
    newcomers = (
        "(SELECT id AS batch_id FROM batches WHERE status = 'in_progress' AND paused_at IS NULL "
        "AND model = %(model)s "
        "AND NOT (id = ANY(%(known)s::varchar[])) ORDER BY id LIMIT %(limit)s) AS s"
    )
    arms.append(_per_batch(newcomers, "%(fresh)s"))
    if quotas:
        source = (
            "(SELECT batch_id, quota FROM unnest(%(batches)s::varchar[], %(quotas)s::integer[]) "
            f"AS u(batch_id, quota) WHERE batch_id = ANY({_RUNNING})) AS s"
        )
        arms.append(_per_batch(source, "s.quota"))
    picked = " UNION ALL ".join(arms)
    rest = (
        "SELECT id FROM (SELECT id FROM requests WHERE model = %(model)s AND status = 'pending' "
        f"AND deadline > %(after)s AND batch_id = ANY({_RUNNING}) "
        "AND NOT (id = ANY(ARRAY(SELECT id FROM picked))) "
        "ORDER BY deadline, prefix_group, id LIMIT %(limit)s FOR UPDATE SKIP LOCKED) AS rest"
    )
    taken = f"SELECT id FROM picked UNION ALL {rest}" if fill else "SELECT id FROM picked"
    return (
        f"WITH picked AS ({picked}) "
        "UPDATE requests SET status = 'running', lease_owner = %(owner)s, "
        "lease_expires_at = %(lease_until)s, attempts = attempts + 1 "
        f"WHERE id = ANY(ARRAY({taken} LIMIT %(limit)s)) "
        "RETURNING id, batch_id, custom_id, line_json, attempts, prefix_group"
    )


def claim_shared(
    session: Session,
    *,
    model: str,
    limit: int,
    owner: str,
    lease_until: float,
    at: float,
    shares: Shares,
) -> SharedClaim:
    """Take up to ``limit`` runnable lines of ``model`` as ``shares`` says, leased to ``owner``
    until ``lease_until``: first rows whose lease ran out before ``at`` (their worker died),
    then the arms of ``Shares``. Rows of batches not ``in_progress`` or past their window are
    left alone, rows another transaction holds are skipped. Returns the rows in id order and
    the model's waiting batches (``waiting_batches``)."""
    params: dict[str, Any] = {
        "model": model,
        "after": math.floor(at),
        "at": at,
        "limit": limit,
        "owner": owner,
        "lease_until": lease_until,
        "urgent": list(shares.urgent),
        "batches": [batch_id for batch_id, _ in shares.quotas],
        "quotas": [quota for _, quota in shares.quotas],
        "known": [*shares.known, *shares.urgent],
        "fresh": shares.fresh,
        "fill": shares.fill,
    }
    if is_postgres(session):
        raw = driver_connection(session)
        statement = shared_claim_statement(bool(shares.urgent), bool(shares.quotas), shares.fill)
        with raw.pipeline(), raw.cursor() as cursor, raw.cursor() as listing:
            # Before the planner settings: its generic plan is as good as any and is reused.
            listing.execute(WAITING_BATCHES, params, prepare=True)
            raw.execute(PLANNER_SETTINGS)
            # Prepared (parsed once per connection where the pool allows it) but planned for
            # each claim's values (force_custom_plan): a generic plan cannot see the lists.
            cursor.execute(statement, params, prepare=True)
            rows = [ClaimedRequest(*row) for row in cursor.fetchall()]
            waiting = [WaitingBatch(*row) for row in listing.fetchall()]
    else:
        rows = _claim_elsewhere(session, params)
        waiting = waiting_batches(session, model)
    rows.sort(key=lambda r: r.id)
    return SharedClaim(rows, waiting)


def waiting_batches(session: Session, model: str) -> list[WaitingBatch]:
    """Every ``in_progress`` batch of ``model`` with its tenant's weight (``WaitingBatch``)."""
    rows = session.execute(
        select(
            Batch.id,
            Batch.tenant_id,
            Tenant.weight,
            Batch.total - Batch.completed - Batch.failed,
            Batch.expires_at,
        )
        .join(Tenant, Tenant.id == Batch.tenant_id)
        .where(*CLAIMABLE, Batch.model == model)
    )
    return [WaitingBatch(*row) for row in rows]


#: Earliest deadline first, then prefix group by prefix group, each in file order.
EDF = (RequestLine.deadline, RequestLine.prefix_group, RequestLine.id)


def _claim_elsewhere(session: Session, params: dict[str, Any]) -> list[ClaimedRequest]:
    """``claim_shared`` outside PostgreSQL (one writer at a time): the same arms, one leasing
    ``UPDATE`` each, so a later arm finds the rows an earlier one took already running."""
    running = select(Batch.id).where(*CLAIMABLE)
    live = (
        RequestLine.model == params["model"],
        RequestLine.deadline > params["after"],
        RequestLine.batch_id.in_(running),
    )
    pending = RequestLine.status == LineStatus.PENDING
    lapsed = (
        RequestLine.status == LineStatus.RUNNING,
        RequestLine.lease_expires_at < params["at"],
    )
    limit = params["limit"]
    rows = _lease(session, params, limit, (*live, *lapsed), order=EDF) if params["fill"] else []
    per_batch = [(batch_id, limit) for batch_id in params["urgent"]]
    newcomers = session.scalars(
        running.where(Batch.model == params["model"], Batch.id.not_in(params["known"]))
        .order_by(Batch.id)
        .limit(limit)
    )
    per_batch += [(batch_id, params["fresh"]) for batch_id in newcomers]
    per_batch += list(zip(params["batches"], params["quotas"], strict=True))
    for batch_id, quota in per_batch:
        if len(rows) >= limit:
            break
        take = min(quota, limit - len(rows))
        where = (*live, pending, RequestLine.batch_id == batch_id)
        rows += _lease(session, params, take, where, order=EDF)
    if params["fill"] and len(rows) < limit:
        rows += _lease(session, params, limit - len(rows), (*live, pending), order=EDF)
    return rows


def _lease(
    session: Session,
    params: dict[str, Any],
    limit: int,
    where: Sequence[ColumnElement[bool]],
    *,
    order: Sequence[ColumnElement[Any]],
) -> list[ClaimedRequest]:
    """Lease up to ``limit`` rows matching ``where``, taken in ``order``, in one statement;
    returns them."""
    if limit <= 0:
        return []
    picked = select(RequestLine.id).where(*where).order_by(*order).limit(limit)
    statement = lease_statement(picked, params["owner"], params["lease_until"])
    return [ClaimedRequest(*row) for row in session.connection().execute(statement).all()]
