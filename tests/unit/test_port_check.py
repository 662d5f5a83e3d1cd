"""``offpeak up`` with its API port taken: it stops at once, names the port and its holder, and
starts nothing."""

from __future__ import annotations

import http.server
import os
import socket
import threading

import pytest
from typer.testing import CliRunner


@pytest.fixture
def taken_port():  # type: ignore[no-untyped-def]
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def test_a_taken_port_names_this_process_as_its_holder(taken_port: int) -> None:
    from offpeak.cli.port_check import PortTakenError, ensure_free

    with pytest.raises(PortTakenError) as caught:
        ensure_free("127.0.0.1", taken_port)
    message = str(caught.value)
    assert f"port {taken_port} on 127.0.0.1" in message
    assert f"pid {os.getpid()}" in message


def test_a_free_port_passes() -> None:
    from offpeak.cli.port_check import ensure_free

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    ensure_free("127.0.0.1", free)


def test_proc_net_tcp_rows_give_the_listening_inode() -> None:
    from offpeak.cli.port_check import listening_inodes

    table = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        "   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000 "
        "0 4242 1 0000000000000000 100 0 0 10 0\n"
        "   1: 0100007F:1F40 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000  1000 "
        "0 4343 1 0000000000000000 100 0 0 10 0\n"
    )
    assert listening_inodes(table, 8000) == {"4242"}
    assert listening_inodes(table, 8001) == set()


def test_offpeak_up_on_a_taken_port_starts_nothing(taken_port: int, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from offpeak import cli
    from offpeak.cli import supervisor

    started: list[object] = []
    monkeypatch.setattr(supervisor, "up_children", lambda *a, **k: started.append(a) or [])
    monkeypatch.setattr("subprocess.run", lambda *a, **k: started.append(a))
    result = CliRunner().invoke(cli.app, ["up", "--host", "127.0.0.1", "--port", str(taken_port)])
    assert result.exit_code == 1
    assert f"port {taken_port}" in result.output and f"pid {os.getpid()}" in result.output
    assert "Offpeak up:" not in result.output
    assert started == []


def test_up_shows_the_address_only_once_the_api_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    from offpeak import cli

    shown: list[str] = []
    monkeypatch.setattr(cli.console, "print", lambda text, **_: shown.append(str(text)))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    cli._say_when_listening(f"http://127.0.0.1:{closed}", patience=1.0)
    assert shown == [f"Offpeak up: no answer at http://127.0.0.1:{closed} yet; see the API's log"]

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        shown.clear()
        base = f"http://127.0.0.1:{server.server_port}"
        cli._say_when_listening(base, patience=10.0)
        assert shown == [f"Offpeak up: API on {base}/v1"]
    finally:
        server.shutdown()
