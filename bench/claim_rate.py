"""The claim's own rate on PostgreSQL: lines/s leased by the fair share's claim
(``storage.repositories.shared_claims``, with ``workers.scheduler.fair_share`` deciding) against
earliest deadline first's (``requests.claim``, the claim before it), on the same rows: tenants'
batches of 256-byte lines, claimed in chunks of the control-plane benchmark's mean claim (488
lines) until none is left, each claim its own transaction. The legs alternate, each first in
as many rounds as it is second (the second leg of a round runs slower), each from the same
pending rows after a ``VACUUM ANALYZE``; the median of the rounds counts. Between claims (not
timed) the claimed lines are marked succeeded and counted on their batch, as the write-back
does, so the rows running stay few, as in a worker. Each batch's lines fall in 64 prefix groups
spread through its file, so the claims take them group by group, as they do a shuffled file."""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

from bench import harness
from storage.db import session_scope
from storage.models import Batch, Tenant
from storage.repositories import intake as intake_repo
from storage.repositories import requests as requests_repo
from storage.repositories import shared_claims
from workers.scheduler.fair_share import FairShare

MODEL = "bench-model"
#: Lines per claim: the mean of ``offpeak bench control``'s claims.
CHUNK = 488
#: Prefix groups per batch (``requests.prefix_group``).
GROUPS = 64
LINE = '{"custom_id": "c", "body": {"messages": "' + "x" * 200 + '"}}'


def _fill(url: str, tenants: int, lines: int) -> None:
    """``tenants`` tenants, each with one running batch of ``lines // tenants`` lines, their
    deadlines a second apart."""
    now = int(time.time())
    per = lines // tenants
    with session_scope(url) as session:
        for n in range(tenants):
            session.add(Tenant(id=f"t{n}", name=f"t{n}", created_at=now))
            session.flush()
            session.add(
                Batch(id=f"b{n}", tenant_id=f"t{n}", endpoint="/v1/chat/completions",
                      model=MODEL, input_file_id="f", completion_window="24h",
                      window_seconds=86_400, status="in_progress", created_at=now,
                      expires_at=now + 86_400 + n, total=per)
            )  # fmt: skip
            session.flush()
            rows = (
                (f"b{n}", i, f"c{i}", MODEL, now + 86_400 + n, LINE, _group(i)) for i in range(per)
            )
            intake_repo.bulk_insert(session, rows)


def _group(line: int) -> int:
    """Line ``line``'s prefix group: 64 groups a batch, spread through the file as a shuffled
    file's documents are (so claims walk the groups, not the file's order)."""
    return (line * 7919) % GROUPS << 32


def _finish(url: str, ids: list[int]) -> None:
    """What the write-back does to claimed lines (not timed): succeeded, counted on the batch."""
    conninfo = url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo) as conn:
        conn.execute(
            "WITH done AS (UPDATE requests SET status = 'succeeded', lease_owner = NULL, "
            "lease_expires_at = NULL WHERE id = ANY(%s) RETURNING batch_id) "
            "UPDATE batches AS b SET completed = b.completed + n.count FROM "
            "(SELECT batch_id, count(*) FROM done GROUP BY batch_id) AS n WHERE b.id = n.batch_id",
            (ids,),
        )


def _edf(url: str, at: float) -> float:
    """Seconds of ``requests.claim`` calls until no line is left."""
    spent = 0.0
    while True:
        started = time.perf_counter()
        with session_scope(url) as session:
            rows = requests_repo.claim(
                session, model=MODEL, limit=CHUNK, owner="w", lease_until=at + 600, at=at
            )
        spent += time.perf_counter() - started
        if not rows:
            return spent
        _finish(url, [r.id for r in rows])


def _fair(url: str, at: float) -> float:
    """Seconds of the fair share's claims (its arithmetic included) until no line is left."""
    fair, spent = FairShare(), 0.0
    with session_scope(url) as session:
        fair.settle(shared_claims.SharedClaim([], shared_claims.waiting_batches(session, MODEL)))
    while True:
        started = time.perf_counter()
        shares = fair.shares(CHUNK, ())
        with session_scope(url) as session:
            claimed = shared_claims.claim_shared(
                session, model=MODEL, limit=CHUNK, owner="w", lease_until=at + 600, at=at,
                shares=shares,
            )  # fmt: skip
        fair.settle(claimed)
        spent += time.perf_counter() - started
        if not claimed.rows:
            return spent
        _finish(url, [r.id for r in claimed.rows])


def measure(lines: int = 30_000, tenants: int = 3, rounds: int = 8) -> dict[str, Any]:
    """Lines/s of each claim over ``rounds`` alternating rounds (an even number) on a scratch
    database; the medians and fair / EDF."""
    import migrations

    rates: dict[str, list[float]] = {"fair": [], "edf": []}
    legs: dict[str, Callable[[str, float], float]] = {"edf": _edf, "fair": _fair}
    with harness.scratch_database(f"bench{secrets.token_hex(4)}") as url:
        migrations.upgrade(url)
        _fill(url, tenants, lines)
        conninfo = url.replace("postgresql+psycopg://", "postgresql://")
        for n in range(rounds):
            # Each leg first in every other round: with ``rounds`` even, as often as second.
            for name in sorted(legs, reverse=bool(n % 2)):
                leg = legs[name]
                with psycopg.connect(conninfo, autocommit=True) as conn:
                    conn.execute(
                        "UPDATE requests SET status = 'pending', lease_owner = NULL, "
                        "lease_expires_at = NULL, attempts = 0"
                    )
                    conn.execute("UPDATE batches SET completed = 0")
                    conn.execute("VACUUM ANALYZE requests")
                rates[name].append(lines // tenants * tenants / leg(url, time.time()))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "lines": lines,
        "tenants": tenants,
        "chunk": CHUNK,
        "rounds": rates,
        "fair_lines_per_s": medians["fair"],
        "edf_lines_per_s": medians["edf"],
        "ratio": medians["fair"] / medians["edf"],
    }
