"""The tenant limits on by default: forty creates of one file by one tenant sent at once through
the official SDK to a real API process meet 429 with ``Retry-After`` past the batch creates per
minute, the accepted ones all run and a refused one leaves nothing behind; a tenant's override
(``unlimited``) wins; the enqueued-token default is a day of the engine's measured output."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from sqlalchemy import select

from api.app import create_app
from api.services import keys
from api.services import tenants as tenants_service
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import ModelConfig, Settings
from offpeak.tenant_limits import UNLIMITED, LimitSettings
from storage.db import session_scope
from storage.models import Batch, EngineChunk, RequestLine
from tests.support.batches import chat_line, line, validate, wait_for_end
from tests.support.database import LIMITS_OFF, fresh_database, new_key, settings_from
from tests.support.processes import instant_stack_env, running
from tests.support.servers import free_port

CREATES = 40
DEFAULTS = LimitSettings()


@pytest.fixture(scope="module")
def default_stack(
    base_env: dict[str, str], run_id: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServiceProcesses, Settings]]:
    """API, control and engine worker on the instant engine with the limits as shipped (the
    suite's ``LIMITS_OFF`` taken out of the environment)."""
    env = {k: v for k, v in base_env.items() if k not in LIMITS_OFF}
    with fresh_database(f"offpeak_{run_id}_limits") as url:
        env = instant_stack_env(env, url, f"{run_id}-limits")
        logs = tmp_path_factory.mktemp("limits-logs")
        with running(ServiceProcesses(env, free_port(), logs)) as stack:
            yield stack, settings_from(env)


def test_forty_creates_at_once_meet_429s_and_the_accepted_all_run(
    default_stack: tuple[ServiceProcesses, Settings],
) -> None:
    stack, settings = default_stack
    assert settings.limits.batch_creates_per_minute == DEFAULTS.batch_creates_per_minute
    key = new_key(settings)
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0, timeout=60)
    lines = [chat_line(f"r{i}", f"line {i}") for i in range(3)]
    file = client.files.create(file=("in.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")

    def create(_: int) -> object:
        try:
            return client.batches.create(
                input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        except openai.APIStatusError as refused:
            return refused

    with ThreadPoolExecutor(CREATES) as pool:
        answers = list(pool.map(create, range(CREATES)))
    accepted = [a.id for a in answers if not isinstance(a, openai.APIStatusError)]
    refused = [a for a in answers if isinstance(a, openai.APIStatusError)]
    assert len(accepted) + len(refused) == CREATES
    assert refused, "forty creates at once were all accepted"
    assert 1 <= len(accepted) <= DEFAULTS.batch_creates_per_minute
    for error in refused:
        assert error.status_code == 429, error
        assert int(error.response.headers["retry-after"]) >= 1
        body = error.body
        assert isinstance(body, dict) and body["code"] == "rate_limit_exceeded"
        assert "batch creates per minute" in body["message"]

    # Nothing of a refused create is left: the tenant's batches and copied lines are the
    # accepted ones' only.
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.tenant_for_key(session, key)
        assert tenant is not None
        rows = set(session.scalars(select(Batch.id).where(Batch.tenant_id == tenant.id)))
        assert rows == set(accepted)
    for batch_id in accepted:
        ended = wait_for_end(client, batch_id, stack, timeout=180)
        assert ended.status == "completed", ended
        assert ended.request_counts is not None and ended.request_counts.completed == 3
    with session_scope(settings.resolved_database_url) as session:
        copied = session.scalars(
            select(RequestLine.batch_id)
            .join(Batch, Batch.id == RequestLine.batch_id)
            .where(Batch.tenant_id == tenant.id)
            .distinct()
        )
        assert set(copied) == set(accepted)

    # The wait the refusal named is enough: a create after it is accepted.
    wait = max(int(e.response.headers["retry-after"]) for e in refused[:1])
    time.sleep(wait)
    again = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert wait_for_end(client, again.id, stack, timeout=180).status == "completed"


def _tenant_with(settings: Settings, **overrides: int | None) -> str:
    key = new_key(settings)
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.tenant_for_key(session, key)
        assert tenant is not None
        if overrides:
            tenants_service.set_overrides(session, settings, tenant.id, overrides)
    return key


def test_a_tenant_set_to_unlimited_creates_past_the_default(settings: Settings) -> None:
    shipped = settings.model_copy(update={"limits": LimitSettings()})
    limited, free = _tenant_with(shipped), _tenant_with(shipped, batch_creates_per_minute=UNLIMITED)
    with TestClient(create_app(shipped)) as http:
        for key, creates in ((limited, DEFAULTS.batch_creates_per_minute), (free, 25)):
            sdk = OpenAI(
                base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
            )
            file = sdk.files.create(file=("in.jsonl", line() + b"\n"), purpose="batch")
            for _ in range(creates):
                sdk.batches.create(
                    input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
            if key == limited:
                with pytest.raises(openai.RateLimitError) as info:
                    sdk.batches.create(
                        input_file_id=file.id,
                        endpoint="/v1/chat/completions",
                        completion_window="24h",
                    )
                # One create every 6 s at 10 a minute: the next is due within 6 s.
                assert 1 <= int(info.value.response.headers["retry-after"]) <= 6
        limits = OpenAI(
            base_url="http://testserver/v1", api_key=free, http_client=http, max_retries=0
        ).get("/limits", cast_to=object)
    assert isinstance(limits, dict)
    assert limits["batch_creates_per_minute"] == {"limit": None}
    assert limits["requests_per_minute"] == {"limit": DEFAULTS.requests_per_minute}
    assert limits["batches_in_progress"]["limit"] == DEFAULTS.max_batches_in_progress


def _validated(settings: Settings, key: str, model: str, asked: int) -> list[dict] | None:
    """Validate a batch of one line of ``model`` asking ``asked`` output tokens (in-process,
    as ``test_quotas`` does) for ``key``'s tenant; its errors (``None``: it passed)."""
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.tenant_for_key(session, key)
        assert tenant is not None
        name = tenant.name
    data = line("r", model=model, body_max_tokens=asked) + b"\n"
    batch, _ = validate(settings, data, tenant_name=name)
    return batch.errors


def test_the_enqueued_token_default_is_a_day_of_the_engines_measured_output(
    settings: Settings, tmp_path: Path
) -> None:
    measured, unmeasured = f"lim-{secrets.token_hex(3)}", f"lim-{secrets.token_hex(3)}"
    shipped = settings.model_copy(
        update={
            "limits": LimitSettings(),
            "models": {m: ModelConfig(engine="instant") for m in (measured, unmeasured)},
        }
    )
    now = time.time()
    with session_scope(shipped.resolved_database_url) as session:
        # 200 completion tokens per busy second: a day of it is 17,280,000 tokens.
        session.add(
            EngineChunk(worker_id="w", model=measured, device="cpu", started_at=now - 100,
                        ended_at=now - 1, busy_seconds=100.0, requests=50, prompt_tokens=0,
                        cached_tokens=0, completion_tokens=20_000)
        )  # fmt: skip
    day = 200 * 86_400
    prompt = 100  # the line's bytes / 4, rounded up: well under this
    over = _validated(shipped, _tenant_with(shipped), measured, day)
    assert over is not None and over[0]["code"] == "token_limit_exceeded"
    assert f"Limit: {day:,} enqueued tokens" in over[0]["message"]
    assert _validated(shipped, _tenant_with(shipped), measured, day - prompt) is None
    # Nothing measured: the expected rate, 1000 tokens/s.
    expected = 1000 * 86_400
    assert _validated(shipped, _tenant_with(shipped), unmeasured, expected - prompt) is None
    assert _validated(shipped, _tenant_with(shipped), unmeasured, expected) is not None
    # An override wins: unlimited.
    free = _tenant_with(shipped, max_enqueued_tokens=UNLIMITED)
    assert _validated(shipped, free, measured, 10 * day) is None
    with session_scope(shipped.resolved_database_url) as session:
        shown = tenants_service.show(session, shipped, _tenant_name(shipped, free))
    assert shown["enqueued_tokens"]["limit_by_model"] == {measured: None, unmeasured: None}


def _tenant_name(settings: Settings, key: str) -> str:
    with session_scope(settings.resolved_database_url) as session:
        tenant = keys.tenant_for_key(session, key)
        assert tenant is not None
        return tenant.name
