"""Fair share on the real SmolLM2: one tenant's 5-line batch, submitted while another tenant's
1,200-line batch runs, finishes before that batch has run 40% of its lines; both answer every
``custom_id`` once (the big one is cancelled then: what it ran and what it did not, each once)."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import Batch, RequestLine
from tests.support.batches import chat_line, check_ran_batch, submit, wait_for_end
from tests.support.database import new_key

pytestmark = pytest.mark.engine

BIG = 1200
SMALL = 5


def running_lines(url: str, batch_id: str) -> int:
    """Lines of the batch an engine worker holds or has finished."""
    with session_scope(url) as session:
        return int(
            session.scalar(
                select(func.count()).where(
                    RequestLine.batch_id == batch_id, RequestLine.status != "pending"
                )
            )
            or 0
        )


def test_a_small_batch_finishes_early_behind_a_big_one(
    live: ServiceProcesses, live_settings: Settings, live_sdk: OpenAI
) -> None:
    other = OpenAI(base_url=f"{live.base_url}/v1", api_key=new_key(live_settings), max_retries=2)
    big_ids = [f"big-{i}" for i in range(BIG)]
    small_ids = [f"small-{i}" for i in range(SMALL)]
    # A drain whose last step finished every line it ran: the next drain's queue is then sized
    # for an engine that empties every step (a chunk deep), so the small batch arrives while a
    # big claim is in flight and finds the queue full.
    warm = submit(live_sdk, [chat_line(f"warm-{i}", "Hi", max_tokens=1) for i in range(4)])
    wait_for_end(live_sdk, warm.id, live)
    # Long enough (8 tokens a line) that the big batch is still running when the small one,
    # submitted once the big one's first lines run, has been validated and claimed.
    big = submit(live_sdk, [chat_line(c, f"Say {i}.", max_tokens=8) for i, c in enumerate(big_ids)])
    url = live_settings.resolved_database_url
    deadline = time.monotonic() + 300
    while not running_lines(url, big.id):
        assert time.monotonic() < deadline, live.tail("engine")
        live.check_alive()
        time.sleep(0.1)
    small = submit(other, [chat_line(c, "Hi", max_tokens=2) for c in small_ids])
    small_done = wait_for_end(other, small.id, live)
    # The rest of the big batch shows nothing more; its cancel ends it sooner.
    live_sdk.batches.cancel(big.id)
    big_done = wait_for_end(live_sdk, big.id, live)
    assert small_done.status == "completed" and big_done.status == "cancelled"
    check_ran_batch(other, small_done, small_ids)
    check_ran_batch(live_sdk, big_done, big_ids)
    with session_scope(url) as session:
        small_end = session.scalar(
            select(func.max(RequestLine.finished_at)).where(RequestLine.batch_id == small.id)
        )
        big_before = session.scalar(
            select(func.count()).where(
                RequestLine.batch_id == big.id, RequestLine.finished_at <= small_end
            )
        )
        timeline = when_the_small_batch_waited(session, big.id, small.id)
    fraction = big_before / BIG
    print(f"the big batch had run {fraction:.1%} of its lines when the small one finished")
    print(timeline)
    # The timeline last: a long failure message is cut in the middle.
    assert fraction < 0.4, f"{live.tail('engine', 40)}\n{live.tail('control', 20)}\n{timeline}"


def when_the_small_batch_waited(session: Session, big_id: str, small_id: str) -> str:
    """Where the small batch's time went, for a failure's message: its create, its start (the
    end of validation) and its lines' ends, each with the big batch's lines finished by then."""

    def big_done_by(at: float) -> int:
        return int(
            session.scalar(
                select(func.count()).where(
                    RequestLine.batch_id == big_id, RequestLine.finished_at <= at
                )
            )
            or 0
        )

    small = session.get(Batch, small_id)
    big = session.get(Batch, big_id)
    assert small is not None and big is not None
    ends = session.scalars(
        select(RequestLine.finished_at)
        .where(RequestLine.batch_id == small_id)
        .order_by(RequestLine.finished_at)
    ).all()
    first = big.in_progress_at or big.created_at
    moments = [("created", small.created_at), ("in progress", small.in_progress_at)]
    moments += [(f"line {i + 1} finished", end) for i, end in enumerate(ends)]
    return "\n".join(
        f"small batch {name} at +{at - first:.1f} s, big batch lines finished by then: "
        f"{big_done_by(at)}"
        for name, at in moments
        if at is not None
    )
