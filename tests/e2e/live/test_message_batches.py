"""Anthropic's Message Batches API through the official ``anthropic`` SDK against the live API
and workers on the real SmolLM2 model: answers as Messages, a matched stop sequence, errored
requests for what a batch cannot do, a cancel mid-run, and the bill of the succeeded requests."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import pytest
from anthropic.types.messages import MessageBatch

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from storage.db import session_scope
from storage.models import LedgerEntry
from tests.support.database import new_key

pytestmark = pytest.mark.engine
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture()
def live_claude(live: ServiceProcesses, live_settings: Settings) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=live.base_url, api_key=new_key(live_settings), max_retries=2
    )


def _request(custom_id: str, content: str, **params: Any) -> Any:
    body = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": content}]}
    return {"custom_id": custom_id, "params": {**body, **params}}


def _wait(client: anthropic.Anthropic, batch_id: str, stack: ServiceProcesses) -> MessageBatch:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        stack.check_alive()
        time.sleep(0.25)
    raise AssertionError(f"{batch_id} did not end: {batch.processing_status}")


def _billed(settings: Settings, batch_id: str) -> LedgerEntry:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with session_scope(settings.resolved_database_url) as session:
            bill = session.query(LedgerEntry).filter_by(batch_id=batch_id).one_or_none()
            if bill is not None:
                session.expunge(bill)
                return bill
        time.sleep(0.25)
    raise AssertionError(f"{batch_id} was not billed")


def test_a_message_batch_runs_on_the_real_model(
    live_claude: anthropic.Anthropic, live: ServiceProcesses, live_settings: Settings
) -> None:
    requests = [
        _request("plain", "Name a colour.", temperature=0),
        _request("long", "Tell me a story about a cat.", temperature=0, max_tokens=3),
        # "e" comes up in any English answer: the completion stops at its first one.
        _request("stop", "Describe the weather.", temperature=0, stop_sequences=["e"]),
        _request("prefill", "What is 2+2?", temperature=0, top_k=1, system="Answer briefly."),
        _request("stream", "Hi", stream=True),
        _request("tools", "Hi", tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        _request("other-model", "Hi", model="claude-opus-9"),
    ]
    requests[3]["params"]["messages"].append({"role": "assistant", "content": "The answer is"})
    batch = live_claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    ended = _wait(live_claude, batch.id, live)
    counts = ended.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled, counts.expired) == (4, 3, 0, 0)
    results = {r.custom_id: r.result for r in live_claude.messages.batches.results(batch.id)}
    assert set(results) == {r["custom_id"] for r in requests}
    for custom_id in ("plain", "long", "stop", "prefill"):
        result = results[custom_id]
        assert result.type == "succeeded", (custom_id, result)
        message = result.message
        assert message.id.startswith("msg_") and message.model == MODEL
        assert message.role == "assistant" and message.content[0].type == "text"
        assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    assert results["long"].message.stop_reason == "max_tokens"  # type: ignore[union-attr]
    assert results["long"].message.usage.output_tokens == 3  # type: ignore[union-attr]
    stopped = results["stop"].message  # type: ignore[union-attr]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "e")
    assert "e" not in stopped.content[0].text  # type: ignore[union-attr]
    assert results["plain"].message.stop_reason in ("end_turn", "max_tokens")  # type: ignore[union-attr,operator]
    for custom_id, kind, start in (
        ("stream", "invalid_request_error", "stream: "),
        ("tools", "invalid_request_error", "tools.0.type: "),
        ("other-model", "not_found_error", "model: claude-opus-9"),
    ):
        result = results[custom_id]
        assert result.type == "errored" and result.error.error.type == kind
        assert result.error.error.message.startswith(start)
    bill = _billed(live_settings, batch.id)
    succeeded = [results[c].message.usage for c in ("plain", "long", "stop", "prefill")]  # type: ignore[union-attr]
    assert bill.requests == 4  # errored requests are not billed
    assert bill.input_tokens == sum(
        u.input_tokens + (u.cache_read_input_tokens or 0) for u in succeeded
    )
    assert bill.output_tokens == sum(u.output_tokens for u in succeeded)


def test_a_message_batch_cancelled_mid_run(
    live_claude: anthropic.Anthropic, live: ServiceProcesses, live_settings: Settings
) -> None:
    requests = [_request(f"r{i}", f"Count to {i + 50}.", max_tokens=200) for i in range(40)]
    batch = live_claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    deadline = time.monotonic() + 120
    while live_claude.messages.batches.retrieve(batch.id).processing_status == "in_progress":
        with session_scope(live_settings.resolved_database_url) as session:
            from storage.models import RequestLine

            if session.query(RequestLine).filter_by(batch_id=batch.id, status="running").count():
                break
        assert time.monotonic() < deadline, "the batch never started running"
        time.sleep(0.1)
    canceling = live_claude.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended")
    ended = _wait(live_claude, batch.id, live)
    counts = ended.request_counts
    assert counts.canceled > 0 and counts.processing == 0
    assert counts.succeeded + counts.errored + counts.canceled + counts.expired == 40
    assert ended.cancel_initiated_at is not None and ended.ended_at is not None
    kinds = [r.result.type for r in live_claude.messages.batches.results(batch.id)]
    assert len(kinds) == 40 and kinds.count("canceled") == counts.canceled
    bill = _billed(live_settings, batch.id)
    assert bill.requests == counts.succeeded  # canceled requests are not billed
    assert live_claude.messages.batches.delete(batch.id).type == "message_batch_deleted"
