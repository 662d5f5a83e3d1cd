"""Processes of the service: their lifetimes and how they stop.

- ``Supervisor`` is ``offpeak up``: it starts the API, a control worker and the engine workers as
  child processes, restarts one that exits with exponential backoff, and on SIGINT/SIGTERM stops
  them all, their own children (vLLM's engine-core) included.
- ``OffpeakUp`` runs ``offpeak up`` as one child process, as a user would (``offpeak demo``).
- ``ServiceProcesses`` starts the same processes one by one, without restarts, for tests and
  benchmarks that kill or add single workers.
- No child outlives its parent, even when the parent is SIGKILLed (``offpeak.process_tree``).

Every child is the leader of its own process group (``start_new_session``): a Ctrl-C in the
terminal reaches the supervisor only, which then stops each child in order, and a group can be
killed whole once its leader is gone, grandchildren included.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from offpeak.process_tree import die_with_parent, kill_group

# A child's "these settings cannot start me": an engine worker whose model fails at boot.
from workers.engine.load_failure import EXIT_ENGINE_NOT_STARTED as CONFIGURATION_EXIT

log = logging.getLogger("offpeak.up")

#: Seconds a child gets to stop after SIGTERM before its group is SIGKILLed. An engine worker
#: hands its lines back and closes its engine within 30 s (``offpeak worker --stop-timeout``).
STOP_SECONDS = 40.0


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"ended by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _tail(path: Path, lines: int) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# -- offpeak up ----------------------------------------------------------------------------------


@dataclass
class Child:
    """One supervised process: ``python -m offpeak <args>``, logging to ``<log_dir>/<name>.log``."""

    name: str
    args: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    #: Exits in a row that came sooner than ``Supervisor.stable_seconds`` after a start.
    quick_exits: int = 0
    #: Monotonic time of the next start; None while it runs.
    restart_at: float | None = 0.0


class Supervisor:
    """Runs ``children`` until SIGINT or SIGTERM; ``run`` returns the exit code.

    A child that exits (whatever its code: a service runs until told to stop) is restarted after
    ``first_backoff × 2^(n-1)`` seconds, n its quick exits in a row, at most ``max_backoff``; an
    exit after ``stable_seconds`` or more of running counts as the first again. Except an exit
    with ``CONFIGURATION_EXIT`` (an engine worker whose model cannot start with its settings):
    a restart would fail the same way, so everything stops and ``run`` returns that code. On
    the first signal each child gets SIGTERM and ``stop_seconds`` to exit, then its process group is
    SIGKILLed (grandchildren too); a second signal SIGKILLs every group at once.
    """

    def __init__(
        self,
        children: list[Child],
        env: dict[str, str],
        log_dir: Path,
        *,
        first_backoff: float = 1.0,
        max_backoff: float = 60.0,
        stable_seconds: float = 60.0,
        stop_seconds: float = STOP_SECONDS,
    ) -> None:
        self.children = children
        self.env = {**os.environ, **env}
        self.log_dir = log_dir
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.stable_seconds = stable_seconds
        self.stop_seconds = stop_seconds
        self._stop = threading.Event()
        self._signals = 0
        #: A child's ``CONFIGURATION_EXIT``, once one stopped the whole supervisor.
        self._exit_code = 0

    def run(self) -> int:
        """Supervise until a signal; 0 after a clean stop, 1 if a child had to be SIGKILLed,
        ``CONFIGURATION_EXIT`` when a child exited with it (every other child is stopped)."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            while not self._stop.is_set():
                self._tick(time.monotonic())
                self._stop.wait(0.2)  # a signal sets the event and ends the wait at once
            stopped = self._stop_all()
            return self._exit_code or stopped
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s: stopping every process (again to kill them at once)", _name(signum))
        self._stop.set()

    def _tick(self, now: float) -> None:
        for child in self.children:
            if child.proc is None:
                if child.restart_at is not None and now >= child.restart_at:
                    self._start(child, now)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            kill_group(child.proc.pid)  # what it left behind (an engine-core, a beat)
            ran = now - child.started_at
            if code == CONFIGURATION_EXIT:
                log.error(
                    "%s (pid %d) %s after %.1f s: its settings cannot start it, so it is not "
                    "restarted; stopping everything (its log says which setting)\n%s",
                    child.name,
                    child.proc.pid,
                    _describe_exit(code),
                    ran,
                    _tail(self.log_dir / f"{child.name}.log", 8),
                )
                child.proc, child.restart_at = None, None
                self._exit_code = code
                self._stop.set()
                return
            child.quick_exits = 1 if ran >= self.stable_seconds else child.quick_exits + 1
            delay = min(self.first_backoff * 2 ** (child.quick_exits - 1), self.max_backoff)
            log.warning(
                "%s (pid %d) %s after %.1f s; restarting in %.0f s (quick exits in a row: %d)\n%s",
                child.name,
                child.proc.pid,
                _describe_exit(code),
                ran,
                delay,
                child.quick_exits,
                _tail(self.log_dir / f"{child.name}.log", 8),
            )
            child.proc, child.restart_at = None, now + delay

    def _start(self, child: Child, now: float) -> None:
        with (self.log_dir / f"{child.name}.log").open("ab") as log_file:
            child.proc = subprocess.Popen(
                [sys.executable, "-m", "offpeak", *child.args],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # The supervisor is single-threaded, so a preexec_fn is safe here; SIGKILL of
                # the supervisor then ends its children too.
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
        child.started_at, child.restart_at = now, None
        log.info(
            "started %s (pid %d): offpeak %s", child.name, child.proc.pid, " ".join(child.args)
        )

    def _stop_all(self) -> int:
        running = [c for c in self.children if c.proc is not None and c.proc.poll() is None]
        for child in running:
            assert child.proc is not None
            child.proc.terminate()  # the leader only: a worker stops its own children in order
        forced = _wait_then_kill(
            [c.proc for c in running if c.proc is not None],
            self.stop_seconds,
            hurry=lambda: self._signals > 1,
        )
        for child in self.children:
            if child.proc is not None:
                kill_group(child.proc.pid)
                log.info(
                    "%s (pid %d) %s", child.name, child.proc.pid, _describe_exit(child.proc.wait())
                )
        return 1 if forced else 0


def _wait_then_kill(
    procs: list[subprocess.Popen[bytes]], seconds: float, hurry: Callable[[], bool] = lambda: False
) -> bool:
    """Wait up to ``seconds`` for ``procs`` to exit; SIGKILL the groups of those that did not
    (or of all, once ``hurry()`` is true). True if any had to be killed."""
    deadline = time.monotonic() + seconds
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= deadline or hurry():
            for proc in procs:
                if proc.poll() is None:
                    log.warning("pid %d did not stop; killing its process group", proc.pid)
                    kill_group(proc.pid)
            for proc in procs:
                proc.wait()
            return True
        time.sleep(0.1)
    return False


def _name(signum: int) -> str:
    return signal.Signals(signum).name


def up_children(
    engines: int = 1, models: str | None = None, port: int | None = None, host: str | None = None
) -> list[Child]:
    """The processes of ``offpeak up``: the API, one control worker, ``engines`` engine workers
    (each serving ``models``, a comma-separated list; default every configured model)."""
    serve = ["serve"]
    if host:
        serve += ["--host", host]
    if port:
        serve += ["--port", str(port)]
    engine = ["worker", "--role", "engine", *(["--models", models] if models else [])]
    children = [Child("api", serve), Child("control", ["worker", "--role", "control"])]
    names = ["engine"] if engines == 1 else [f"engine-{n}" for n in range(1, engines + 1)]
    children += [Child(name, list(engine)) for name in names]
    return children


def host_engines(engines: int, models: str | None) -> dict[str, str]:
    """The environment telling ``offpeak up``'s engine workers how many vllm engines this host
    will run (``OFFPEAK_HOST_ENGINES``: ``engines`` workers × their in-process vllm models), so
    the first to start leaves CPUs for the others; nothing when the operator set it."""
    if "OFFPEAK_HOST_ENGINES" in os.environ:
        return {}
    from offpeak.settings import get_settings

    settings = get_settings()
    names = [m.strip() for m in models.split(",")] if models else list(settings.models)
    local = [m for m in names if m in settings.models and settings.models[m].engine == "vllm"]
    return {"OFFPEAK_HOST_ENGINES": str(engines * len(local))}


# -- handles for tests, benchmarks and the demo ---------------------------------------------


def wait_http(base_url: str, check_alive: Callable[[], None], tail: str, timeout: float) -> None:
    """Wait until ``base_url`` answers ``/healthz``; raises ``TimeoutError`` with ``tail``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        check_alive()
        try:
            if httpx.get(f"{base_url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"API not up after {timeout} s:\n{tail}")


class OffpeakUp:
    """``offpeak up`` as one child process (its own log in ``<log_dir>/up.log``, its children's
    next to it), stopped as a user stops it: SIGINT, as Ctrl-C sends."""

    def __init__(
        self, env: dict[str, str], port: int, log_dir: Path, extra_args: tuple[str, ...] = ()
    ) -> None:
        self.env = {**os.environ, **env}
        self.port = port
        self.log_dir = log_dir
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        args = ["up", "--port", str(self.port), "--log-dir", str(self.log_dir), *self.extra_args]
        with (self.log_dir / "up.log").open("ab") as log_file:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "offpeak", *args],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_http(self, timeout: float = 120) -> None:
        wait_http(self.base_url, self.check_alive, self.tail("up") + self.tail("api"), timeout)

    def check_alive(self) -> None:
        """Raises ``RuntimeError`` with its log if ``offpeak up`` itself has exited."""
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise RuntimeError(f"offpeak up exited with {code}:\n{self.tail('up')}")

    @property
    def procs(self) -> dict[str, int]:
        """The running children's pids by role: ``api``, ``control``, ``engine`` (one of them,
        if several engine workers run)."""
        import psutil

        assert self.proc is not None
        found: dict[str, int] = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                # Joined: Celery rewrites a worker's title to "[celeryd: ...] (worker --role x)".
                cmd = " ".join(child.cmdline())
            except psutil.NoSuchProcess:
                continue
            if role := re.search(r"--role (\w+)", cmd):
                found[role.group(1)] = child.pid
            elif " serve" in cmd:
                found["api"] = child.pid
        return found

    def tail(self, name: str, lines: int = 40) -> str:
        return _tail(self.log_dir / f"{name}.log", lines)

    def stop(self, sig: int = signal.SIGINT) -> int:
        """Send ``sig`` and wait for ``offpeak up`` to stop everything; its exit code."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            _wait_then_kill([self.proc], STOP_SECONDS + 20)
        return self.proc.wait()


class ServiceProcesses:
    """The API, a control worker and an engine worker, sharing one environment, started one by
    one (no supervisor: a test kills or adds single workers)."""

    def __init__(
        self,
        env: dict[str, str],
        port: int,
        log_dir: Path,
        roles: tuple[str, ...] = ("control", "engine"),
    ) -> None:
        self.env = {**os.environ, **env}
        self.port = port
        self.log_dir = log_dir
        self.roles = roles
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _spawn(self, name: str, args: list[str]) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{name}.log").open("ab") as log_file:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "offpeak", *args],
                env=self.env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def start(self) -> None:
        subprocess.run(
            [sys.executable, "-m", "offpeak", "migrate"],
            env=self.env,
            check=True,
            capture_output=True,
        )
        self._spawn("api", ["serve", "--port", str(self.port)])
        for role in self.roles:
            self.start_worker(role)

    def start_worker(self, role: str, name: str | None = None, models: str | None = None) -> None:
        """Start ``offpeak worker --role ROLE`` as process ``name``, serving ``models``
        (comma-separated) or every served model."""
        self._spawn(
            name or role, ["worker", "--role", role, *(["--models", models] if models else [])]
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_http(self, timeout: float = 60) -> None:
        """Wait until the API answers ``/healthz``; raises ``TimeoutError`` with its log."""
        wait_http(self.base_url, self.check_alive, self.tail("api"), timeout)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                # A long tail: what made a worker stop comes before its shutdown's own lines.
                tail = self.tail(name, 150)
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def tail(self, name: str, lines: int = 40) -> str:
        return _tail(self.log_dir / f"{name}.log", lines)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.pid, sig)
        proc.wait(timeout=60)

    def stop(self) -> None:
        """SIGTERM each process (a worker stops its engine itself), then SIGKILL what is left of
        each process group, grandchildren included."""
        procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        _wait_then_kill(procs, STOP_SECONDS)
        for proc in procs:
            kill_group(proc.pid)
        self.procs.clear()
