"""File bytes, in a local folder or any fsspec URL: ``s3://bucket/prefix`` (through ``s3fs``) when
several machines share them, configured by the standard AWS variables alone (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``), which serve MinIO, Ceph, R2 and
GCS's S3 endpoint too.

Bytes are streamed in and out; nothing here reads a whole file into memory (an object store's
writes and reads buffer one part of ``PART_BYTES``). A reader never sees a partial file: a local
write goes to a temporary name renamed into place; an object store's write is a multipart upload,
invisible until it is completed, written under its final key (a rename there would be a copy of
every byte). A store that does not answer is retried with backoff for ``retry_seconds``, then
``StoreUnavailable`` is raised: a caller tries again later, nothing was half-written.
"""

from __future__ import annotations

import logging
import posixpath
import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from functools import lru_cache
from typing import IO, Any, TypeVar, cast

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Read and write in pieces of this many bytes.
CHUNK_BYTES = 1 << 20
#: An object store's upload part and read-ahead block: S3's smallest part but the last is 5 MiB.
PART_BYTES = 8 << 20
#: Seconds an operation is retried while the store does not answer (each try itself retried by
#: botocore, ``AWS_MAX_ATTEMPTS``), waiting 0.5 s, then twice as long each time, at most 8 s.
RETRY_SECONDS = 60.0
FIRST_BACKOFF_SECONDS, MAX_BACKOFF_SECONDS = 0.5, 8.0

#: OSErrors that are a verdict on the key or the credentials, not a store that is away.
_PERMANENT = (
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)


class StoreUnavailable(RuntimeError):
    """The blob store did not answer (refused, timed out, a 5xx) within ``retry_seconds``.
    Nothing was written; the operation may be tried again later."""


def _unavailable(what: str) -> StoreUnavailable:
    return StoreUnavailable(f"the file store did not answer ({what})")


@lru_cache(maxsize=1)
def _network_errors() -> tuple[type[BaseException], ...]:
    """The client libraries' own connection errors, which are not ``OSError`` (imported late:
    a local store never loads them)."""
    found: list[type[BaseException]] = []
    with suppress(ImportError):
        from botocore import exceptions as boto

        found += [boto.ConnectionError, boto.HTTPClientError]
    with suppress(ImportError):
        import aiohttp

        found.append(aiohttp.ClientError)
    from fsspec.exceptions import FSTimeoutError

    found.append(FSTimeoutError)
    return tuple(found)


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` from a store call means "the store is away, try again": a connection
    refused, reset or timed out, or an I/O error (``s3fs`` turns a 5xx it gave up on into
    ``OSError(EIO)``); not a missing key, nor ``PermissionError`` (wrong credentials)."""
    if isinstance(error, _PERMANENT):
        return False
    return isinstance(error, (OSError, *_network_errors()))


class BlobStore:
    """Keys are relative paths (``files/file-abc.jsonl``) under the store's root URL."""

    def __init__(self, url: str, retry_seconds: float = RETRY_SECONDS) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.retry_seconds = retry_seconds
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            # An object store has no folders: its bucket is made by whoever grants access to it.
            self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return posixpath.join(self.root, key)

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, again after a transient error until ``retry_seconds`` have passed; then
        ``StoreUnavailable``. Other errors are raised as they are."""
        deadline = time.monotonic() + self.retry_seconds
        wait = FIRST_BACKOFF_SECONDS
        while True:
            try:
                return call()
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if time.monotonic() + wait > deadline:
                    raise _unavailable(what) from exc
                log.warning("file store: %s failed (%s); again in %.1f s", what, exc, wait)
            time.sleep(wait)
            wait = min(wait * 2, MAX_BACKOFF_SECONDS)

    @contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        """Write ``key`` so readers never see a partial file: it appears whole when the block
        succeeds, and not at all when it raises. Raises ``StoreUnavailable`` when the store
        stops answering mid-way (a write cannot be replayed here: the caller has the bytes)."""
        final = self._path(key)
        if self.local:
            with self._local_writer(final) as handle:
                yield handle
            return
        handle = self.fs.open(final, "wb", block_size=PART_BYTES, autocommit=False)
        try:
            yield cast(IO[bytes], _StoreWrites(handle, key))
            handle.close()  # the last part
            self._retrying(f"completing {key}", handle.commit)
        except BaseException as exc:
            # The multipart upload is aborted (if the store answers: else a lifecycle rule on
            # the bucket removes it; it was never visible).
            with suppress(Exception):
                handle.discard()
            if isinstance(exc, Exception) and is_transient(exc):
                raise _unavailable(f"writing {key}") from exc
            raise

    @contextmanager
    def _local_writer(self, final: str) -> Iterator[IO[bytes]]:
        self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        temporary = f"{final}.part-{secrets.token_hex(4)}"
        try:
            with self.fs.open(temporary, "wb") as handle:
                yield handle
            self.fs.mv(temporary, final)
        except BaseException:
            if self.fs.exists(temporary):
                self.fs.rm(temporary)
            raise

    def open(self, key: str) -> IO[bytes]:
        """A binary reader that resumes where it was after a transient error; raises
        ``FileNotFoundError`` for a missing key, ``StoreUnavailable`` when the store is away."""
        return cast(IO[bytes], _ResumingReader(self, key))

    def _open_at(self, key: str, offset: int) -> Any:
        def call() -> Any:
            handle = self.fs.open(self._path(key), "rb", block_size=PART_BYTES)
            if offset:
                handle.seek(offset)
            return handle

        return self._retrying(f"opening {key}", call)

    def iter_chunks(self, key: str, size: int = CHUNK_BYTES) -> Iterator[bytes]:
        with self.open(key) as handle:
            while chunk := handle.read(size):
                yield chunk

    def delete(self, key: str) -> None:
        path = self._path(key)
        if self.exists(key):
            self._retrying(f"deleting {key}", lambda: self.fs.rm(path))

    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (``StoreUnavailable``, not False, if the store is away)."""
        path = self._path(key)
        return bool(self._retrying(f"looking up {key}", lambda: self.fs.exists(path)))

    def size(self, key: str) -> int:
        """The stored bytes of ``key``; raises ``FileNotFoundError`` for a missing key."""
        path = self._path(key)
        return int(self._retrying(f"sizing {key}", lambda: self.fs.size(path)))


class _StoreWrites:
    """An upload's ``write``: a part the store refused after its retries is ``StoreUnavailable``
    (the caller's own errors in the same block stay what they are)."""

    def __init__(self, handle: Any, key: str) -> None:
        self.handle, self.key = handle, key

    def write(self, data: bytes) -> int:
        try:
            return int(self.handle.write(data))
        except Exception as exc:
            if is_transient(exc):
                raise _unavailable(f"writing {self.key}") from exc
            raise


class _ResumingReader:
    """``read(n)`` over a stored file that, when the store drops the connection mid-way, opens
    the file again at the offset it had reached (``BlobStore._retrying``'s backoff and bound)."""

    def __init__(self, store: BlobStore, key: str) -> None:
        self.store, self.key = store, key
        self.offset = 0
        self.handle = store._open_at(key, 0)

    def read(self, size: int = -1) -> bytes:
        deadline = time.monotonic() + self.store.retry_seconds
        while True:
            try:
                data = bytes(self.handle.read(size))
                self.offset += len(data)
                return data
            except Exception as exc:
                if not is_transient(exc):
                    raise
                if time.monotonic() > deadline:
                    raise _unavailable(f"reading {self.key}") from exc
                log.warning("file store: reading %s failed (%s); resuming", self.key, exc)
                time.sleep(FIRST_BACKOFF_SECONDS)
                with suppress(Exception):
                    self.handle.close()
                self.handle = self.store._open_at(self.key, self.offset)

    def __iter__(self) -> Iterator[bytes]:
        """The file's lines, each with its ``\\n`` (the last one's if the file ends with one)."""
        rest = b""
        while chunk := self.read(CHUNK_BYTES):
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for line in lines:
                yield line + b"\n"
        if rest:
            yield rest

    def close(self) -> None:
        with suppress(Exception):
            self.handle.close()

    def __enter__(self) -> _ResumingReader:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


@lru_cache(maxsize=4)
def get_blob_store(url: str) -> BlobStore:
    return BlobStore(url)
