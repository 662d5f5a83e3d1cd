"""Whether a TCP port can be bound before ``offpeak up`` starts anything, and what holds it.

A port that is taken made ``offpeak up`` restart the API forever while its workers took batches;
it now stops at once and names the holder: the process (pid and program) from psutil's
connection table when this user may read it, else the inode's owner found through
``/proc/net/tcp`` and ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PortHolder:
    """A process that listens on a port: ``pid`` and ``program`` (its command line, shortened)
    when they can be found, else None (another user's process, or another network namespace)."""

    pid: int | None
    program: str | None

    def describe(self) -> str:
        if self.pid is None:
            return "another process (not visible to this user)"
        return f"pid {self.pid} ({self.program or 'unknown program'})"


class PortTakenError(Exception):
    """The port cannot be bound: ``str()`` says which and what holds it."""

    def __init__(self, host: str, port: int, holder: PortHolder) -> None:
        super().__init__(
            f"port {port} on {host} is already in use by {holder.describe()}: stop it, or "
            f"choose another port (offpeak up --port N, or OFFPEAK_API_PORT)"
        )
        self.port, self.holder = port, holder


def ensure_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and let it go. Raises ``PortTakenError`` when it is in use;
    other bind errors (an address not on this machine) propagate as ``OSError``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As uvicorn binds: a port in TIME_WAIT from the previous run counts as free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PortTakenError(host, port, find_holder(port)) from None


def find_holder(port: int) -> PortHolder:
    """The process listening on ``port`` (any address), as far as this user can see it."""
    holder = _holder_from_psutil(port)
    if holder is None:
        holder = _holder_from_proc(port, Path("/proc"))
    return holder or PortHolder(None, None)


def _holder_from_psutil(port: int) -> PortHolder | None:
    import psutil

    try:
        connections = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for conn in connections:
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            if conn.pid is None:
                return None  # another user's: try /proc, which may say no more
            return PortHolder(conn.pid, _program(conn.pid))
    return None


def _program(pid: int) -> str | None:
    import psutil

    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    shown = " ".join(cmdline)
    return shown if len(shown) <= 80 else shown[:79] + "…"


def listening_inodes(table: str, port: int) -> set[str]:
    """Socket inodes listening on ``port`` in a ``/proc/net/tcp``-format table (state ``0A``)."""
    inodes = set()
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, state, inode = fields[1], fields[3], fields[9]
        if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
            inodes.add(inode)
    return inodes


def _holder_from_proc(port: int, proc: Path) -> PortHolder | None:
    inodes: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            inodes |= listening_inodes((proc / "net" / name).read_text(), port)
        except OSError:
            continue
    if not inodes:
        return None
    wanted = {f"socket:[{inode}]" for inode in inodes}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
        except OSError:
            continue
        if links & wanted:
            return PortHolder(int(entry.name), _program(int(entry.name)))
    return None
