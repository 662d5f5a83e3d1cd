"""The throwaway servers of ``tests/support/servers.py`` never mistake another server for their own:
two pytest-xdist workers each start Redis servers on ports ``free_port`` found free a moment
before, and a test that restarts its broker must not shut down the other worker's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.servers import PortTaken, RedisServer, redis_server


def test_a_redis_server_on_a_taken_port_says_so_and_leaves_the_other_alone(
    tmp_path: Path,
) -> None:
    with redis_server() as other:
        ours = RedisServer(tmp_path, other.port)
        with pytest.raises(PortTaken):
            ours.start()  # the other answers PING on the port, but it is not ours
        ours.stop()
        assert other._answers_as_itself(), "stopping ours shut the other server down"


def test_restart_comes_back_on_the_same_port_as_the_same_object() -> None:
    with redis_server() as server:
        first, port = server.proc, server.port
        server.restart()
        assert server.proc is not first and server.port == port and server._answers_as_itself()
    assert server.proc is not None and server.proc.poll() is not None


def test_redis_server_takes_another_port_when_its_free_port_was_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race itself: ``free_port`` hands out a port another server takes before ours
    starts; ``redis_server`` starts on the next one and the other keeps running."""
    import tests.support.servers as services

    with redis_server() as other:
        ports = iter([other.port, services.free_port()])
        monkeypatch.setattr(services, "free_port", lambda: next(ports))
        with redis_server() as ours:
            assert ours.port != other.port and ours._answers_as_itself()
        assert other._answers_as_itself(), "ours shut the other server down"
