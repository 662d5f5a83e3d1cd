"""A throwaway PgBouncer in transaction pooling mode in front of a PostgreSQL database, on a free
port, for tests of the service behind a pooler. Skips (fails in CI) without Debian's ``pgbouncer``.
Under root it runs as the ``postgres`` OS user (PgBouncer refuses root), like the throwaway
PostgreSQL servers of ``tests/support/servers.py``."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from bench.servers import free_port
from tests.support.servers import START_SECONDS, missing

CONFIG = """\
[databases]
{database} = host={host} port={port} dbname={database} user=postgres

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = trust
auth_file = {root}/users.txt
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 1000
logfile = {root}/pgbouncer.log
pidfile = {root}/pgbouncer.pid
ignore_startup_parameters = extra_float_digits
"""


class PgBouncer:
    """PgBouncer on 127.0.0.1:``port``, ``pool_size`` server connections per database/user."""

    def __init__(self, root: Path, port: int, pool_size: int) -> None:
        self.root, self.port, self.pool_size = root, port, pool_size
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str, driver: str = "postgresql+psycopg") -> str:
        return f"{driver}://postgres@127.0.0.1:{self.port}/{database}"

    def tail(self, lines: int = 30) -> str:
        log = self.root / "pgbouncer.log"
        if not log.exists():
            return ""
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


@contextlib.contextmanager
def pgbouncer(
    database: str, host: str = "127.0.0.1", port: int = 5432, pool_size: int = 8
) -> Iterator[PgBouncer]:
    """A started PgBouncer (transaction mode) for ``database`` on ``host:port``; stopped and its
    folder removed afterwards."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    if not Path(binary).exists():
        missing("pgbouncer (Debian's package)")
    root = Path(tempfile.mkdtemp(prefix="offpeak-pgbouncer-"))
    as_user: dict[str, Any] = {}
    if os.geteuid() == 0:
        entry = pwd.getpwnam("postgres")
        os.chown(root, entry.pw_uid, entry.pw_gid)
        as_user = {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    bouncer = PgBouncer(root, free_port(), pool_size)
    (root / "users.txt").write_text('"postgres" ""\n')
    (root / "pgbouncer.ini").write_text(
        CONFIG.format(
            database=database,
            host=host,
            port=port,
            listen_port=bouncer.port,
            root=root,
            pool_size=pool_size,
        )  # fmt: skip
    )
    bouncer.proc = subprocess.Popen(
        [binary, str(root / "pgbouncer.ini")],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **as_user,
    )
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if bouncer.proc.poll() is not None:
                raise RuntimeError(
                    f"pgbouncer exited with {bouncer.proc.returncode}\n{bouncer.tail()}"
                )
            try:
                with psycopg.connect(bouncer.url(database, "postgresql"), connect_timeout=2):
                    break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield bouncer
    finally:
        bouncer.proc.terminate()
        try:
            bouncer.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            bouncer.proc.kill()
            bouncer.proc.wait()
        shutil.rmtree(root, ignore_errors=True)
