"""A throwaway S3-protocol server (moto's server mode, in this process on a free port) and a TCP
link to it that a test can cut and restore, for tests of the blob store on object storage.

The service's processes reach the server through the link, configured only by the standard AWS
variables (``s3_env``); the test itself talks to the server directly, so it can look at the
bucket while the link is down.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from bench.servers import free_port

BUCKET = "offpeak-test"
REGION = "eu-west-3"
ACCESS_KEY, SECRET_KEY = "test-access-key", "test-secret-key"


class S3Server:
    """moto's S3 server on ``host``:``port`` and a boto3 client on it."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        from moto.server import ThreadedMotoServer

        self.host, self.port = host, free_port()
        self.server = ThreadedMotoServer(ip_address=host, port=self.port, verbose=False)

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def keys(self, prefix: str = "") -> list[str]:
        """Every completed object's key under ``prefix``."""
        pages = (
            self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        )
        return [item["Key"] for page in pages for item in page.get("Contents", [])]

    def body(self, key: str) -> bytes:
        return bytes(self.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())


@contextlib.contextmanager
def s3_server(host: str = "127.0.0.1") -> Iterator[S3Server]:
    """A started S3 server on ``host`` with the bucket ``BUCKET``; stopped afterwards. Skips
    (fails in CI) when moto is not installed."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        from tests.support.servers import missing

        missing("moto (the dev extra)")
    server = S3Server(host)
    server.server.start()
    try:
        # moto keeps its buckets in the process, not the server: an earlier module's are there.
        urllib.request.urlopen(
            urllib.request.Request(f"{server.endpoint}/moto-api/reset", method="POST"), timeout=10
        ).close()
        server.client().create_bucket(
            Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION}
        )
        yield server
    finally:
        server.server.stop()


def s3_env(endpoint: str, prefix: str) -> dict[str, str]:
    """The environment of a process whose blobs live under ``s3://BUCKET/<prefix>``: the
    standard AWS variables and ``OFFPEAK_BLOB_URL``, nothing else."""
    return {
        "OFFPEAK_BLOB_URL": f"s3://{BUCKET}/{prefix}",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": REGION,
        # botocore's own tries per call (standard variable): a cut link fails within seconds.
        "AWS_MAX_ATTEMPTS": "2",
    }


class Link:
    """A TCP forwarder from 127.0.0.1:``port`` to 127.0.0.1:``target``. ``cut`` closes every
    open connection and stops listening (new connections are refused), as a store that went
    away; ``restore`` listens again on the same port. ``cut_after(n)`` cuts once ``n`` more bytes
    went towards the target."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self.sent = 0
        self._cut_at: int | None = None
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.restore()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def restore(self) -> None:
        with self._lock:
            self._cut_at = None
            listener = socket.create_server(("127.0.0.1", self.port))  # SO_REUSEADDR on POSIX
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._cut_at = None
            if self._listener is not None:
                # shutdown first: a close alone leaves a blocked accept() accepting (Linux).
                with contextlib.suppress(OSError):
                    self._listener.shutdown(socket.SHUT_RDWR)
                self._listener.close()
                self._listener = None
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            self._sockets.clear()

    def cut_after(self, more_bytes: int) -> None:
        with self._lock:
            self._cut_at = self.sent + more_bytes

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for source, sink, towards in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(
                    target=self._pump, args=(source, sink, towards), daemon=True
                ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, towards: bool) -> None:
        while True:
            try:
                data = source.recv(1 << 16)
                if not data:
                    break
                if towards:
                    with self._lock:
                        self.sent += len(data)
                        due = self._cut_at is not None and self.sent >= self._cut_at
                    if due:
                        self.cut()
                        return
                sink.sendall(data)
            except OSError:
                break
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture(scope="module")
def own_s3() -> Iterator[S3Server]:
    """An S3 server of the test module's own."""
    with s3_server() as server:
        yield server
