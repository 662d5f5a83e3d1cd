"""kombu's filesystem transport, made safe for several processes: the embedded default's broker.

kombu's own filesystem transport (kombu 5.x, ``kombu/transport/filesystem.py``) creates a message
file empty, then locks and writes it; a consumer listing the folder in between moves the empty
file away and fails with ``JSONDecodeError`` (celery/kombu#1551). Celery treats that as an
unrecoverable connection error, so an idle control worker died within minutes and the message was
lost. The exchange tables (which queues an exchange routes to) have the same flaw: a table is
created empty before it is written, and two processes creating one at once overwrite each other.

This transport keeps kombu's folder layout and file names, and changes how files appear:

- a message is written to a hidden temporary name the consumers' listing never matches, then
  renamed into place (``os.replace``, atomic on POSIX): a consumer sees a whole file or none;
- a consumer claims a message by renaming it into ``<data_folder_in>/.claimed/`` (one rename
  wins, so two consumers never both get it; the same file system, so it is never a copy), reads
  it, then deletes it;
- a file that still does not parse (written by a process running kombu's own transport, or
  damaged) is put back for a later poll while it is young, and moved to
  ``<data_folder_in>/.unreadable/`` with an error logged once it is older than
  ``UNREADABLE_AFTER_SECONDS``: it never kills the consumer and is never silently dropped;
- exchange tables are rewritten whole under an exclusive lock on a separate lock file and
  renamed into place, so readers need no lock and never see a partial table.

Select it with ``Celery(..., broker="filesystem://")`` and ``broker_transport =
"offpeak.broker:Transport"`` (see ``offpeak.celery_app.make_celery``). Linux and macOS (POSIX
``rename``/``flock``) only.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from queue import Empty
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem, virtual
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

log = logging.getLogger(__name__)

#: A message file that has not parsed for this long is set aside (seconds). A writer that is
#: not atomic finishes a small file in microseconds; a minute is far past any such write.
UNREADABLE_AFTER_SECONDS = 60.0
#: A claimed file this old was left by a consumer that died between claim and read (seconds):
#: a live consumer holds a claim for the time of one read.
ORPHAN_CLAIM_SECONDS = 60.0

_CLAIMED = ".claimed"
_UNREADABLE = ".unreadable"


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to a hidden sibling of ``path``, then rename it to ``path``.

    The temporary name starts with a dot, so neither a message listing (which matches
    ``<stamp>_<uuid>.<queue>.msg``) nor an exchange lookup ever sees it. No fsync: a message lost
    to a power cut is re-sent by the control worker's sweep, which re-derives every message
    from the database.
    """
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class Channel(filesystem.Channel):
    """kombu's filesystem ``Channel`` with atomic message and exchange-table files."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for sub in (_CLAIMED, _UNREADABLE):
            (Path(self.data_folder_in) / sub).mkdir(parents=True, exist_ok=True)
        self._restore_orphaned_claims()

    # -- messages ---------------------------------------------------------------------------

    # kombu's filesystem Channel names the argument ``payload``, its virtual base ``message``:
    # both cannot be matched, and kombu passes it by position.
    def _put(self, queue: str, payload: dict[str, Any], **kwargs: Any) -> None:  # type: ignore[override]
        """Put ``payload`` on ``queue``: one file, visible to consumers only once complete."""
        # kombu's file name: a millisecond stamp (CLOCK_MONOTONIC is system-wide on Linux, so
        # the order holds across processes), a uuid, and the queue after the first dot.
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        try:
            _write_atomically(Path(self.data_folder_out) / name, str_to_bytes(dumps(payload)))
        except OSError as exc:
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """The oldest message of ``queue``, removed from the folder; ``queue.Empty`` if none."""
        wanted = f"{queue}.msg"
        folder = Path(self.data_folder_in)
        for name in sorted(os.listdir(folder)):
            if name.partition(".")[2] != wanted:
                continue
            claimed = folder / _CLAIMED / name
            try:
                os.rename(folder / name, claimed)  # atomic: exactly one consumer wins
            except FileNotFoundError:
                continue  # another consumer claimed it first
            except OSError as exc:
                raise ChannelError(f"Cannot claim {name!r} from queue") from exc
            payload = self._read_claimed(claimed, folder / name)
            if payload is not None:
                return payload
        raise Empty()

    def _read_claimed(self, claimed: Path, original: Path) -> dict[str, Any] | None:
        """Parse and delete a claimed message; put an unreadable one back or aside (``None``)."""
        try:
            raw = claimed.read_bytes()
        except OSError as exc:
            raise ChannelError(f"Cannot read file {str(claimed)!r} from queue") from exc
        try:
            payload: dict[str, Any] = loads(bytes_to_str(raw))
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            self._unreadable(claimed, original, exc)
            return None
        if self.store_processed:
            shutil.move(claimed, Path(self.processed_folder) / claimed.name)
        else:
            claimed.unlink(missing_ok=True)
        return payload

    def _unreadable(self, claimed: Path, original: Path, exc: ValueError) -> None:
        age = time.time() - claimed.stat().st_mtime
        if age < UNREADABLE_AFTER_SECONDS:
            # Possibly still being written by a non-atomic writer: the writer's open descriptor
            # follows the file, so putting it back under its name loses nothing.
            os.rename(claimed, original)
            return
        aside = Path(self.data_folder_in) / _UNREADABLE / claimed.name
        os.replace(claimed, aside)
        log.error("broker message %s does not parse (%s); moved to %s", original.name, exc, aside)

    def _restore_orphaned_claims(self) -> None:
        """Put back messages a consumer claimed and never read (it died in between)."""
        folder = Path(self.data_folder_in)
        now = time.time()
        for claimed in (folder / _CLAIMED).iterdir():
            try:
                if now - claimed.stat().st_mtime > ORPHAN_CLAIM_SECONDS:
                    os.rename(claimed, folder / claimed.name)
                    log.warning("broker: restored message %s left claimed", claimed.name)
            except FileNotFoundError:
                continue  # its owner read it meanwhile

    # -- exchange tables --------------------------------------------------------------------

    @contextmanager
    def _table_lock(self, exchange: str) -> Iterator[Path]:
        """Hold the exclusive lock of an exchange table (a separate, never-replaced file)."""
        file = self._exchange_file(exchange)
        file.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(file.with_name(file.name + ".lock"), "a") as lock_file:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
                try:
                    yield file
                finally:
                    fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)
        except OSError as exc:
            raise ChannelError(f"Cannot open {file}") from exc

    def _read_table(self, file: Path) -> list[filesystem.exchange_queue_t]:
        try:
            return [filesystem.exchange_queue_t(*row) for row in loads(file.read_text())]
        except FileNotFoundError:
            return []

    def get_table(self, exchange: str) -> list[filesystem.exchange_queue_t]:
        """The queues bound to ``exchange``, read without a lock (tables are replaced whole)."""
        try:
            return self._read_table(self._exchange_file(exchange))
        except OSError as exc:
            raise ChannelError(f"Cannot open exchange table of {exchange!r}") from exc

    def _queue_bind(
        self, exchange: str, routing_key: str, pattern: str, queue: str, *args: Any
    ) -> None:
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_lock(exchange) as file:
            table = self._read_table(file)
            if binding not in table:
                _write_atomically(file, str_to_bytes(dumps([binding, *table])))

    def _delete(
        self, queue: str, exchange: str, routing_key: str, pattern: str, *args: Any, **kwargs: Any
    ) -> None:
        # kombu's virtual base removes the queue from the in-memory state; skip the parent
        # class's table rewrite, which is the non-atomic one.
        virtual.Channel._delete(self, queue, exchange, routing_key, pattern, *args, **kwargs)
        binding = filesystem.exchange_queue_t(routing_key or "", pattern or "", queue or "")
        with self._table_lock(exchange) as file:
            table = self._read_table(file)
            if binding in table:
                table.remove(binding)
                _write_atomically(file, str_to_bytes(dumps(table)))


class Transport(filesystem.Transport):
    """kombu's filesystem ``Transport`` on the atomic ``Channel`` above."""

    Channel = Channel
    # A state of its own: kombu's is shared by every filesystem transport in the process.
    global_state = virtual.BrokerState()
    driver_type = "filesystem"
    driver_name = "offpeak-filesystem"
