"""Secrets at rest: values the server must read back in plain text (a webhook's signing secret:
it computes HMACs with it, so it cannot be hashed) are stored encrypted with the server's keys.

``cryptography``'s Fernet (AES-128-CBC with HMAC-SHA256), through ``MultiFernet`` so a key can be
rotated: the first key encrypts, every key decrypts, ``reseal`` re-encrypts with the first. A
stored value is ``fernet:<token>``; a value stored before any key was set stays plain text and is
read as it is until ``offpeak migrate`` seals it.

Where the keys come from (``keys_for``): ``OFFPEAK_SECRET_KEYS``; else, in the embedded default
(SQLite), a key generated on first use in ``<data_dir>/secret.key`` (mode 0600, like an SSH
private key); a server database without ``OFFPEAK_SECRET_KEYS`` is refused, since each of its
hosts would make a key of its own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy import String
from sqlalchemy.types import TypeDecorator

if TYPE_CHECKING:
    from offpeak.settings import Settings

PREFIX = "fernet:"
#: The embedded default's generated key, in the data folder.
KEY_FILE = "secret.key"

_sealer: MultiFernet | None = None
_from_environment = False


class SealingError(RuntimeError):
    """A sealed value cannot be read: no key, or none of the keys opens it."""


class MissingKeyError(SealingError):
    """A server database is configured without ``OFFPEAK_SECRET_KEYS``."""


def key_file(settings: Settings) -> Path:
    """The embedded default's key file, ``<data_dir>/secret.key``."""
    return settings.data_dir / KEY_FILE


def keys_for(settings: Settings) -> list[str]:
    """The Fernet keys this deployment seals with, the first encrypting: ``secret_keys``; with
    the embedded SQLite database, also its key file (made on first use, mode 0600), so what it
    sealed still opens after an operator sets keys. Raises ``MissingKeyError`` for a server
    database without ``secret_keys``."""
    keys = list(settings.secret_keys)
    if not settings.resolved_database_url.startswith("sqlite"):
        if not keys:
            raise MissingKeyError(
                "OFFPEAK_SECRET_KEYS is not set: with a server database (OFFPEAK_DATABASE_URL) "
                "Offpeak needs it to store webhook signing secrets encrypted. Make a key with "
                "`offpeak keys new-secret-key`, set OFFPEAK_SECRET_KEYS='[\"<key>\"]' for every "
                "API and worker process, then run `offpeak migrate`"
            )
        return keys
    path = key_file(settings)
    if keys and not path.exists():
        return keys
    generated = _read_or_make(path)
    return keys + [generated] if generated not in keys else keys


def _read_or_make(path: Path) -> str:
    """The key in ``path``, written first when there is none: to a file of its own with mode
    0600 and then linked into place, so concurrent first starts agree on one whole key."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "w") as out:
                out.write(Fernet.generate_key().decode() + "\n")
            with contextlib.suppress(FileExistsError):  # another process made it first
                os.link(scratch, path)
        finally:
            scratch.unlink(missing_ok=True)
    key = path.read_text().strip()
    try:
        Fernet(key.encode())
    except ValueError:
        raise SealingError(f"{path} does not hold a Fernet key") from None
    return key


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

        configure(keys_for(get_settings()))
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
