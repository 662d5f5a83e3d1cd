"""The claim's order on SQLite (the same arms as PostgreSQL's one statement): earliest deadline
first, then prefix group by prefix group, file order within a group; the deadline and the fair
share's arms come before any group."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

import migrations
from offpeak.statuses import BatchStatus
from storage.db import get_engine, session_scope
from storage.models import RequestLine
from storage.repositories import requests as requests_repo
from storage.repositories import shared_claims
from storage.repositories.shared_claims import Shares
from tests.support.database import request_row

NOW = int(time.time())


def _batch(session: Any, batch_id: str, expires_at: int) -> None:
    session.execute(
        text(
            "INSERT INTO batches (id, tenant_id, endpoint, input_file_id, completion_window, "
            "window_seconds, status, created_at, expires_at, total, completed, failed, "
            "input_tokens, cached_tokens, output_tokens) VALUES (:id, 't', "
            "'/v1/chat/completions', 'f', '24h', 86400, :status, 0, :expires, 0, 0, 0, 0, 0, 0)"
        ),
        {"id": batch_id, "status": BatchStatus.IN_PROGRESS, "expires": expires_at},
    )


def _rows(batch_id: str, groups: list[int], deadline: int) -> list[dict[str, Any]]:
    """Pending rows of model ``m``, line ``i`` in prefix group ``groups[i]``."""
    return [
        request_row(batch_id, i + 1, deadline, custom_id=f"{batch_id}-{i}", prefix_group=group)
        for i, group in enumerate(groups)
    ]


@pytest.fixture()
def url(tmp_path: Path) -> Iterator[str]:
    url = f"sqlite:///{tmp_path / 'claims.db'}"
    migrations.upgrade(url)
    with session_scope(url) as session:
        session.execute(text("PRAGMA foreign_keys = OFF"))
        # A shuffled file: documents 3, 1, 2 interleaved; the later batch's window ends first.
        _batch(session, "late", NOW + 86_400)
        _batch(session, "soon", NOW + 3_600)
        session.execute(
            RequestLine.__table__.insert(), _rows("late", [3, 1, 2, 1, 3, 2, 1, 3], NOW + 86_400)
        )
        session.execute(RequestLine.__table__.insert(), _rows("soon", [9, 9, 5], NOW + 3_600))
    yield url
    get_engine(url).dispose()


def _claim(url: str, limit: int) -> list[tuple[str, int]]:
    with session_scope(url) as session:
        rows = requests_repo.claim(
            session, model="m", limit=limit, owner="w", lease_until=NOW + 120, at=NOW
        )
        groups = dict(session.execute(text("SELECT custom_id, prefix_group FROM requests")).all())
    return sorted((r.custom_id, groups[r.custom_id]) for r in rows)


def test_claims_take_the_earliest_deadline_then_whole_prefix_groups(url: str) -> None:
    # The batch due first goes first, whatever its groups; then group 1 of the other, whole.
    assert _claim(url, 6) == [
        ("late-1", 1), ("late-3", 1), ("late-6", 1), ("soon-0", 9), ("soon-1", 9), ("soon-2", 5)
    ]  # fmt: skip
    assert _claim(url, 3) == [("late-0", 3), ("late-2", 2), ("late-5", 2)]
    assert _claim(url, 9) == [("late-4", 3), ("late-7", 3)]


def test_a_share_takes_its_batch_group_by_group(url: str) -> None:
    """The fair share decides how many lines of each batch; the groups decide which."""
    with session_scope(url) as session:
        claimed = shared_claims.claim_shared(
            session, model="m", limit=4, owner="w", lease_until=NOW + 120, at=NOW,
            shares=Shares(quotas=(("late", 3), ("soon", 1)), known=("late", "soon")),
        )  # fmt: skip
    assert sorted(r.custom_id for r in claimed.rows) == ["late-1", "late-3", "late-6", "soon-2"]
