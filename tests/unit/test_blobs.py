"""The blob store's handling of a store that goes away (``storage.blobs``), on a local folder
whose file system is made to fail as a network store's does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from storage import blobs
from storage.blobs import BlobStore, StoreUnavailable, is_transient


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobs, "FIRST_BACKOFF_SECONDS", 0.0)
    monkeypatch.setattr(blobs.time, "sleep", lambda _seconds: None)


def test_a_store_that_is_away_is_transient_a_verdict_on_the_key_is_not() -> None:
    from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

    assert is_transient(ConnectionRefusedError())
    assert is_transient(EndpointConnectionError(endpoint_url="http://store"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://store"))
    assert is_transient(OSError(5, "Internal Error"))  # s3fs's 5xx after its own retries
    for verdict in (FileNotFoundError(), PermissionError(), ValueError(), KeyError()):
        assert not is_transient(verdict)


class _DropsOnce:
    """A reader whose first ``read`` after ``after`` bytes fails as a dropped connection."""

    dropped = False

    def __init__(self, inner: Any, after: int) -> None:
        self.inner, self.after = inner, after

    def read(self, size: int = -1) -> bytes:
        if not _DropsOnce.dropped and self.inner.tell() >= self.after:
            _DropsOnce.dropped = True
            raise ConnectionResetError("connection reset by peer")
        return bytes(self.inner.read(size))

    def seek(self, offset: int) -> None:
        self.inner.seek(offset)

    def close(self) -> None:
        self.inner.close()


def test_a_read_cut_mid_file_resumes_where_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BlobStore(str(tmp_path))
    data = bytes(range(256)) * (3 * blobs.CHUNK_BYTES // 256 + 7)
    with store.writer("files/f") as out:
        out.write(data)
    opened = []
    real_open = store.fs.open

    def flaky_open(path: str, mode: str = "rb", **kwargs: Any) -> Any:
        opened.append(path)
        return _DropsOnce(real_open(path, mode, **kwargs), after=blobs.CHUNK_BYTES)

    monkeypatch.setattr(store.fs, "open", flaky_open)
    assert b"".join(store.iter_chunks("files/f")) == data
    assert _DropsOnce.dropped and len(opened) == 2
    _DropsOnce.dropped = False
    assert b"".join(store.open("files/f")) == data  # by lines, as a results file is read


def test_a_store_away_past_the_budget_is_unavailable_never_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BlobStore(str(tmp_path), retry_seconds=0.0)
    calls = []

    def refused(_path: str) -> bool:
        calls.append(1)
        raise ConnectionRefusedError("refused")

    monkeypatch.setattr(store.fs, "exists", refused)
    with pytest.raises(StoreUnavailable):
        store.exists("files/f")
    assert calls == [1]  # no budget left for a second try
    with pytest.raises(FileNotFoundError):
        BlobStore(str(tmp_path)).size("files/missing")


def test_a_store_back_within_the_budget_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = BlobStore(str(tmp_path))
    answers = iter([ConnectionRefusedError("refused"), TimeoutError("timed out"), True])

    def flaky(_path: str) -> bool:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return bool(answer)

    monkeypatch.setattr(store.fs, "exists", flaky)
    assert store.exists("files/f") is True


def test_a_local_write_that_raises_leaves_nothing(tmp_path: Path) -> None:
    store = BlobStore(str(tmp_path))
    with pytest.raises(RuntimeError), store.writer("files/f") as out:
        out.write(b"half")
        raise RuntimeError("the upload was refused")
    assert not store.exists("files/f")
    assert list((tmp_path / "files").iterdir()) == []
