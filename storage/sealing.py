"""Secrets at rest: values the server must read back in plain text (a webhook's signing secret:
it computes HMACs with it, so it cannot be hashed) are stored encrypted with the server's keys.

``cryptography``'s Fernet (AES-128-CBC with HMAC-SHA256), through ``MultiFernet`` so a key can be
rotated: the first key encrypts, every key decrypts, ``reseal`` re-encrypts with the first. A
stored value is ``fernet:<token>``; a value stored before any key was set stays plain text and is
read as it is. Without keys (development) values are stored in plain text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy import String
from sqlalchemy.types import TypeDecorator

PREFIX = "fernet:"

_sealer: MultiFernet | None = None
_from_environment = False


class SealingError(RuntimeError):
    """A sealed value cannot be read: no key, or none of the keys opens it."""


def configure(keys: Sequence[str]) -> None:
    """Use ``keys`` (Fernet keys, url-safe base64 of 32 bytes; the first encrypts) in this
    process. An empty sequence changes nothing, so one app's settings without keys cannot make
    values another configured unreadable. Raises ``ValueError`` for a malformed key."""
    global _sealer
    if keys:
        _sealer = MultiFernet([Fernet(key.encode()) for key in keys])


def _current() -> MultiFernet | None:
    """The process's keys: those ``configure`` was given, else the environment's settings (a
    worker or a command that never called it), read once."""
    global _from_environment
    if _sealer is None and not _from_environment:
        _from_environment = True
        from offpeak.settings import get_settings

        configure(get_settings().secret_keys)
    return _sealer


def seal(text: str) -> str:
    """``text`` as it is stored: encrypted when keys are configured."""
    sealer = _current()
    if sealer is None or text.startswith(PREFIX):
        return text
    return PREFIX + sealer.encrypt(text.encode()).decode()


def unseal(stored: str) -> str:
    """The plain text of a stored value. Raises ``SealingError``."""
    if not stored.startswith(PREFIX):
        return stored
    sealer = _current()
    if sealer is None:
        raise SealingError(
            "a webhook secret is stored encrypted and no key is set: set OFFPEAK_SECRET_KEYS "
            "to the key it was sealed with"
        )
    try:
        return sealer.decrypt(stored[len(PREFIX) :].encode()).decode()
    except InvalidToken:
        raise SealingError(
            "no key in OFFPEAK_SECRET_KEYS opens a stored webhook secret: keep the old key "
            "after the new one until `offpeak keys reseal` has run"
        ) from None


def reseal(stored: str) -> str:
    """``stored`` encrypted with the first key (a plain-text value is sealed). Raises
    ``SealingError``."""
    sealer = _current()
    if sealer is None:
        raise SealingError("no key is set (OFFPEAK_SECRET_KEYS)")
    if not stored.startswith(PREFIX):
        return seal(stored)
    return PREFIX + sealer.rotate(stored[len(PREFIX) :].encode()).decode()


class SealedString(TypeDecorator[str]):
    """A string column stored sealed (``seal``) and read in plain text (``unseal``)."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return None if value is None else seal(value)

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        return None if value is None else unseal(value)
