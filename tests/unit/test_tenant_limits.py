"""The tenant limits' defaults: on out of the box, the enqueued-token one derived from the
engine's measured output, ``unlimited`` turning any off from the environment, and a tenant's
override winning over the default."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import typer

from offpeak.cli.tenants import _limit
from offpeak.settings import Settings
from offpeak.tenant_limits import (
    UNLIMITED,
    LimitSettings,
    enqueued_tokens_default,
    measured_tokens_per_second,
    resolve,
)

DAY = 86_400


def no_overrides(**own: int | None) -> SimpleNamespace:
    """A tenant with the overrides ``own`` and the default for every other limit."""
    names = ("max_enqueued_tokens", "max_batches_in_progress", "max_file_bytes",
             "requests_per_minute", "batch_creates_per_minute")  # fmt: skip
    return SimpleNamespace(**{name: own.get(name) for name in names})


def test_every_limit_but_stored_bytes_is_on_by_default() -> None:
    limits = resolve(no_overrides(), LimitSettings())
    assert limits.requests_per_minute == 600
    assert limits.batch_creates_per_minute == 10
    assert limits.max_batches_in_progress == 50
    assert limits.max_enqueued_tokens == 1000 * DAY  # nothing measured yet: the expected rate
    assert limits.max_file_bytes is None


def test_the_enqueued_token_default_is_a_day_of_the_measured_output() -> None:
    defaults = LimitSettings()
    assert enqueued_tokens_default(defaults, 37.5) == 37.5 * DAY
    assert resolve(no_overrides(), defaults, 37.5).max_enqueued_tokens == 3_240_000
    assert enqueued_tokens_default(defaults, None) == 1000 * DAY
    shorter = LimitSettings(enqueued_engine_seconds=3600, expected_tokens_per_second=20)
    assert enqueued_tokens_default(shorter, None) == 72_000
    assert enqueued_tokens_default(shorter, 2.5) == 9000


def test_a_rate_is_measured_only_over_enough_tokens() -> None:
    assert measured_tokens_per_second(1999, 10.0) is None
    assert measured_tokens_per_second(5000, 0.0) is None
    assert measured_tokens_per_second(5000, 10.0) == 500.0


def test_overrides_win_and_unlimited_turns_a_limit_off() -> None:
    defaults = LimitSettings()
    own = no_overrides(
        max_enqueued_tokens=1234,
        max_batches_in_progress=UNLIMITED,
        requests_per_minute=0,
        batch_creates_per_minute=3,
    )
    limits = resolve(own, defaults, 500.0)
    assert limits.max_enqueued_tokens == 1234  # a figure of its own: not derived
    assert limits.max_batches_in_progress is None
    assert limits.requests_per_minute == 0  # 0 is a limit: it refuses everything
    assert limits.batch_creates_per_minute == 3
    off = resolve(no_overrides(max_enqueued_tokens=UNLIMITED), defaults, 500.0)
    assert off.max_enqueued_tokens is None
    fixed = LimitSettings(max_enqueued_tokens=5000)
    assert resolve(no_overrides(), fixed, 500.0).max_enqueued_tokens == 5000


def test_the_environment_turns_limits_off_with_unlimited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OFFPEAK_LIMITS__REQUESTS_PER_MINUTE", "unlimited")
    monkeypatch.setenv("OFFPEAK_LIMITS__MAX_ENQUEUED_TOKENS", "unlimited")
    monkeypatch.setenv("OFFPEAK_LIMITS__BATCH_CREATES_PER_MINUTE", "30")
    monkeypatch.setenv("OFFPEAK_LIMITS__EXPECTED_TOKENS_PER_SECOND", "50")
    settings = Settings()
    assert settings.limits.requests_per_minute == UNLIMITED
    limits = resolve(no_overrides(), settings.limits, None)
    assert limits.requests_per_minute is None and limits.max_enqueued_tokens is None
    assert limits.batch_creates_per_minute == 30
    assert limits.max_batches_in_progress == 50
    assert settings.limits.expected_tokens_per_second == 50


def test_a_limit_below_unlimited_or_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError):
        LimitSettings(requests_per_minute=-2)
    with pytest.raises(ValueError):
        LimitSettings.model_validate({"batch_creates_per_minute": "lots"})


def test_tenants_set_reads_unlimited_default_and_numbers() -> None:
    assert _limit("unlimited") == (True, UNLIMITED)
    assert _limit("default") == (True, None)
    assert _limit("25") == (True, 25)
    assert _limit(None) == (False, None)
    with pytest.raises(typer.BadParameter):
        _limit("-1")
