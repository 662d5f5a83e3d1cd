"""Throwaway PostgreSQL and Redis servers for tests that stop, restart or break them.

The machine's shared servers (127.0.0.1:5432 and :6379) serve every test run and session on the
host, so a test that restarts its database or broker gets servers of its own: a PostgreSQL
cluster made by ``initdb`` in a temporary folder and run by ``pg_ctl`` on a free port, and a
``redis-server`` child on a free port that keeps nothing on disk. Both are stopped and their
folders removed when the ``with`` block (or the fixture) ends, whether the tests passed or not.

Root: ``initdb`` and ``postgres`` refuse to run as root. Under root the cluster's programs run as
the ``postgres`` OS user (``OFFPEAK_TEST_PG_OS_USER`` names another), through ``subprocess``'s
``user=``/``group=`` (no ``su``/``runuser`` in between, so signals and exit codes are
``pg_ctl``'s own), in a folder under the system temp directory that the user owns. Not root: they
run as the current user. Either way the cluster's superuser is ``postgres`` with ``trust``
authentication on 127.0.0.1 only, as on the shared server.

The binaries come from ``OFFPEAK_TEST_PG_BIN`` or the newest ``/usr/lib/postgresql/*/bin``
(Debian's layout), else ``PATH``; tests that need a server are skipped when there is none, and
fail in CI (``CI`` set).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from bench.servers import free_port

#: Seconds a server gets to come up or stop before the test fails with its log.
START_SECONDS = 60.0


def missing(what: str) -> None:
    """Skip the test for lack of ``what`` (fail in CI, where it must be installed)."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is needed in CI")
    pytest.skip(f"{what} is not installed")


def postgres_bin_dir() -> Path | None:
    """The folder with ``initdb``, ``pg_ctl`` and ``postgres``, or None when there is none."""
    if configured := os.environ.get("OFFPEAK_TEST_PG_BIN"):
        return Path(configured)
    candidates = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    for folder in reversed(candidates):
        if (folder / "initdb").exists() and (folder / "pg_ctl").exists():
            return folder
    found = shutil.which("pg_ctl")
    return Path(found).parent if found and shutil.which("initdb") else None


class PostgresServer:
    """A PostgreSQL cluster of its own in ``root`` (made by ``initdb``), run by ``pg_ctl`` on
    ``host``:``port``. ``os_user``: the account its programs run as (None: this process's)."""

    def __init__(
        self, bin_dir: Path, root: Path, port: int, os_user: str | None, host: str = "127.0.0.1"
    ) -> None:
        self.bin_dir, self.root, self.port, self.os_user = bin_dir, root, port, os_user
        self.host = host
        self.data = root / "data"
        self.log = root / "postgres.log"

    def url(self, database: str = "postgres", driver: str = "postgresql+psycopg") -> str:
        """A URL for ``database`` as the superuser (``driver`` ``postgresql`` for psycopg)."""
        return f"{driver}://postgres@{self.host}:{self.port}/{database}"

    def _run(self, *args: str, timeout: float = START_SECONDS) -> None:
        as_user: dict[str, Any] = {}
        if self.os_user:
            entry = pwd.getpwnam(self.os_user)
            as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
        done = subprocess.run(
            [str(self.bin_dir / args[0]), *args[1:]],
            cwd=self.root,  # the user may not be allowed into the caller's folder
            capture_output=True,
            text=True,
            timeout=timeout,
            **as_user,
        )
        if done.returncode:
            raise RuntimeError(
                f"{args[0]} exited with {done.returncode}:\n{done.stdout}{done.stderr}\n"
                f"{self.tail()}"
            )

    def tail(self, lines: int = 30) -> str:
        """The end of the server's log."""
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def init(self) -> None:
        """Make the cluster: superuser ``postgres``, trust on local connections (and on
        ``host``'s /24 when it is not the loopback: a test's own virtual network)."""
        self._run(
            "initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
            "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions",
        )  # fmt: skip
        if self.host != "127.0.0.1":
            network = self.host.rsplit(".", 1)[0] + ".0/24"
            with (self.data / "pg_hba.conf").open("a") as hba:
                hba.write(f"host all all {network} trust\n")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = " ".join(
            [
                f"-p {self.port}",
                f"-c listen_addresses={self.host}",
                f"-c unix_socket_directories={self.root}",  # never the shared server's folder
                "-c max_connections=200",
                # A throwaway cluster: losing it to a host crash costs nothing.
                "-c fsync=off",
                "-c synchronous_commit=off",
                "-c full_page_writes=off",
            ]
        )
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options,
            "-w", "-t", str(int(START_SECONDS)), "start",
        )  # fmt: skip
        self.wait_ready()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_SECONDS
        while True:
            try:
                with psycopg.connect(self.url(driver="postgresql"), connect_timeout=2):
                    return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` cuts open connections and checkpoints, ``immediate`` is a
        crash (the next start replays the WAL)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self, mode: str = "fast") -> None:
        """Stop (``mode`` as ``stop``) and start again on the same port."""
        self.stop(mode)
        self.start()

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def create_database(self, name: str) -> str:
        """Create ``name``; returns its SQLAlchemy URL."""
        with psycopg.connect(self.url(driver="postgresql"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def kill(self) -> None:
        """Last resort when ``pg_ctl stop`` failed: SIGKILL the postmaster (its children exit
        when it is gone)."""
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
            os.kill(pid, signal.SIGKILL)


def _postgres_os_user() -> str | None:
    if os.geteuid() != 0:
        return None
    name = os.environ.get("OFFPEAK_TEST_PG_OS_USER", "postgres")
    try:
        pwd.getpwnam(name)
    except KeyError:
        missing(f"an OS user {name!r} to run PostgreSQL as (it refuses root)")
    return name


@contextlib.contextmanager
def postgres_server(host: str = "127.0.0.1") -> Iterator[PostgresServer]:
    """A started throwaway PostgreSQL server on ``host``; stopped and deleted afterwards.

    Skips (fails in CI) when the binaries or, under root, the ``postgres`` OS user are missing;
    raises ``RuntimeError`` with the server's log when it does not start.
    """
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        missing("PostgreSQL's server programs (initdb, pg_ctl)")
    assert bin_dir is not None
    os_user = _postgres_os_user()
    root = Path(tempfile.mkdtemp(prefix="offpeak-pg-"))
    if os_user:
        entry = pwd.getpwnam(os_user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    server = PostgresServer(bin_dir, root, free_port(), os_user, host)
    try:
        server.init()
        server.start()
        yield server
    finally:
        try:
            if server.running():
                server.stop("immediate")  # its data is about to be deleted
        except (RuntimeError, subprocess.TimeoutExpired):
            server.kill()
        shutil.rmtree(root, ignore_errors=True)


class PortTaken(RuntimeError):
    """A server could not listen on its port: another process holds it."""


class RedisServer:
    """``redis-server`` on 127.0.0.1:``port`` as a child process, keeping nothing on disk (no
    RDB snapshots, no AOF), as the shared server runs."""

    def __init__(
        self, root: Path, port: int, host: str = "127.0.0.1", extra: tuple[str, ...] = ()
    ) -> None:
        self.root, self.port, self.host, self.extra = root, port, host, extra
        self.log = root / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://{self.host}:{self.port}/{db}"

    def start(self) -> None:
        """Start the server and wait until it answers PING with its own process id (another
        server may hold the port: ``free_port`` only found it free a moment before). Raises
        ``PortTaken`` when ``redis-server`` could not listen on the port, ``RuntimeError`` when
        it exited for another reason."""
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port", str(self.port),
                "--bind", self.host,
                "--protected-mode", "no",  # no password: reachable only on the test's network
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.root),
                "--logfile", str(self.log),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + START_SECONDS
        while True:
            if self.proc.poll() is not None:
                log = self.tail()
                if "Address already in use" in log:
                    raise PortTaken(f"port {self.port} is taken:\n{log}")
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{log}")
            if self._answers_as_itself():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer in {START_SECONDS} s")
            time.sleep(0.1)

    def _answers_as_itself(self) -> bool:
        """Whether the server on the port answers and is this object's process."""
        assert self.proc is not None
        try:
            info = redis.Redis.from_url(self.url(), socket_timeout=5).info("server")
        except redis.ConnectionError:
            return False
        return bool(info.get("process_id") == self.proc.pid)

    def tail(self, lines: int = 30) -> str:
        if not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """``SHUTDOWN NOSAVE``: every queued message and key is gone, as after a crash of a
        server that keeps nothing on disk."""
        if self.proc is None or self.proc.poll() is not None:
            return
        if self._answers_as_itself():  # never another server that took the port
            with contextlib.suppress(redis.ConnectionError):  # shutting down drops the connection
                redis.Redis.from_url(self.url()).shutdown(nosave=True)
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=START_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Stop (``stop``) and start again, empty, on the same port."""
        self.stop()
        self.start()


@contextlib.contextmanager
def redis_server(host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> Iterator[RedisServer]:
    """A started throwaway Redis server on ``host`` (``extra``: more ``redis-server``
    arguments); stopped and its folder deleted afterwards. Skips (fails in CI) when
    ``redis-server`` is missing."""
    if shutil.which("redis-server") is None:
        missing("redis-server")
    root = Path(tempfile.mkdtemp(prefix="offpeak-redis-"))
    server = RedisServer(root, free_port(), host, extra)
    try:
        for attempt in range(3):  # another process took the free port first: take another
            try:
                server.start()
                break
            except PortTaken:
                if attempt == 2:
                    raise
                server.log.unlink()  # the next server's log starts empty
                server = RedisServer(root, free_port(), host, extra)
        yield server
    finally:
        try:
            server.stop()
        finally:
            if server.proc is not None and server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of the test module's own, free to stop and restart."""
    with postgres_server() as server:
        yield server


@pytest.fixture(scope="module")
def own_redis() -> Iterator[RedisServer]:
    """A Redis server of the test module's own, free to stop and restart."""
    with redis_server() as server:
        yield server
