"""File bytes, in a local folder or any fsspec URL (``s3://…`` when several machines share it).

Bytes are streamed in and out; nothing here reads a whole file into memory.
"""

from __future__ import annotations

import posixpath
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import IO

import fsspec

#: Read and write in pieces of this many bytes.
CHUNK_BYTES = 1 << 20


class BlobStore:
    """Keys are relative paths (``files/file-abc.jsonl``) under the store's root URL."""

    def __init__(self, url: str) -> None:
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.fs.makedirs(self.root, exist_ok=True)

    def _path(self, key: str) -> str:
        return posixpath.join(self.root, key)

    @contextmanager
    def writer(self, key: str) -> Iterator[IO[bytes]]:
        """Write ``key`` so readers never see a partial file: bytes go to a temporary name that
        is renamed into place when the block succeeds, and removed when it raises."""
        final = self._path(key)
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
        """A binary reader; raises ``FileNotFoundError`` for a missing key."""
        return self.fs.open(self._path(key), "rb")

    def iter_chunks(self, key: str, size: int = CHUNK_BYTES) -> Iterator[bytes]:
        with self.open(key) as handle:
            while chunk := handle.read(size):
                yield chunk

    def delete(self, key: str) -> None:
        path = self._path(key)
        if self.fs.exists(path):
            self.fs.rm(path)

    def exists(self, key: str) -> bool:
        return bool(self.fs.exists(self._path(key)))

    def size(self, key: str) -> int:
        """The stored bytes of ``key``; raises ``FileNotFoundError`` for a missing key."""
        return int(self.fs.size(self._path(key)))


@lru_cache(maxsize=4)
def get_blob_store(url: str) -> BlobStore:
    return BlobStore(url)
