"""Secrets at rest, without a database: sealing and unsealing with rotated keys, and settings that
refuse to run in production without a key."""

from __future__ import annotations

import pytest
from cryptography.fernet import Fernet
from pydantic import ValidationError

from offpeak.settings import Settings
from storage import sealing


@pytest.fixture(autouse=True)
def no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no keys, and leaves the process's as they were."""
    monkeypatch.setattr(sealing, "_sealer", None)
    monkeypatch.setattr(sealing, "_from_environment", True)


def test_a_sealed_secret_reads_back_and_survives_a_rotation() -> None:
    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    sealing.configure([old])
    stored = sealing.seal("whsec_abc")
    assert stored.startswith(sealing.PREFIX) and "whsec_abc" not in stored
    assert sealing.unseal(stored) == "whsec_abc"
    sealing.configure([new, old])
    assert sealing.unseal(stored) == "whsec_abc"  # the old key still opens it
    resealed = sealing.reseal(stored)
    sealing.configure([new])
    assert sealing.unseal(resealed) == "whsec_abc"
    with pytest.raises(sealing.SealingError, match="reseal"):
        sealing.unseal(stored)  # sealed with the dropped key


def test_plain_text_from_before_any_key_reads_as_it_is() -> None:
    assert sealing.seal("whsec_plain") == "whsec_plain"  # no key: development
    sealing.configure([Fernet.generate_key().decode()])
    assert sealing.unseal("whsec_plain") == "whsec_plain"
    assert sealing.unseal(sealing.reseal("whsec_plain")) == "whsec_plain"


def test_a_sealed_secret_without_a_key_is_a_clear_error() -> None:
    sealing.configure([Fernet.generate_key().decode()])
    stored = sealing.seal("whsec_abc")
    sealing._sealer = None
    with pytest.raises(sealing.SealingError, match="OFFPEAK_SECRET_KEYS"):
        sealing.unseal(stored)


def test_production_refuses_to_start_without_a_key() -> None:
    with pytest.raises(ValidationError, match="OFFPEAK_SECRET_KEYS"):
        Settings(environment="production")
    Settings(environment="production", secret_keys=[Fernet.generate_key().decode()])
    with pytest.raises(ValidationError, match="Fernet key"):
        Settings(secret_keys=["not-a-key"])
