"""The tests' TCP proxy (``tests/support/tcp_proxy.py``) on loopback: it forwards both ways, a cut
looks like a dead server (open connections reset or closed, new ones refused), and a restart
forwards again on the same port."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from collections.abc import Iterator

import pytest

from tests.support.tcp_proxy import TcpProxy


class Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with contextlib.suppress(ConnectionResetError):  # what a cut proxy does to it
            while data := self.request.recv(4096):
                self.request.sendall(data)


@pytest.fixture
def echo() -> Iterator[int]:
    """An echo server on loopback; yields its port."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def proxy(echo: int) -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", echo) as proxy:
        yield proxy


def connect(proxy: TcpProxy) -> socket.socket:
    conn = socket.create_connection((proxy.host, proxy.port), timeout=5)
    conn.settimeout(5)
    return conn


def round_trip(conn: socket.socket, data: bytes) -> bytes:
    conn.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = conn.recv(65536)
        assert chunk, "the proxy closed the connection"
        got += chunk
    return got


def test_forwards_both_ways(proxy: TcpProxy) -> None:
    big = bytes(range(256)) * 1024  # more than one read's worth
    with connect(proxy) as a, connect(proxy) as b:
        assert round_trip(a, b"hello") == b"hello"
        assert round_trip(b, big) == big
        assert round_trip(a, b"again") == b"again"


def test_a_cut_looks_like_a_dead_server_and_a_restart_forwards_on_the_same_port(
    proxy: TcpProxy,
) -> None:
    port = proxy.port
    with connect(proxy) as conn:
        assert round_trip(conn, b"before") == b"before"
        proxy.stop()
        # The open connection is gone: a reset, or at best an end of stream.
        with pytest.raises(OSError):
            conn.sendall(b"after")
            if conn.recv(16) == b"":
                raise ConnectionResetError("end of stream")
    with pytest.raises(ConnectionRefusedError):
        connect(proxy)
    proxy.stop()  # a second cut is harmless
    proxy.start()
    assert proxy.port == port
    with connect(proxy) as conn:
        assert round_trip(conn, b"back") == b"back"


def test_a_target_that_is_away_resets_the_connection() -> None:
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        nowhere = spare.getsockname()[1]  # bound, never listening: connections are refused
        # The reset can come before the client's connect returns: that is inside the raises.
        with (
            TcpProxy("127.0.0.1", nowhere) as proxy,
            pytest.raises(OSError),
            connect(proxy) as conn,
        ):
            conn.sendall(b"anyone?")
            if conn.recv(16) == b"":
                raise ConnectionResetError("end of stream")
