"""Waiting on processes: a process tree as it is now, those of it still running, when each of
them ended, the processes of a session (each service process leads one, and its children stay
in it), a stack of service processes on the instant engine, running for a block, and the one
vLLM engine-core process of a CPU engine, on its bound CPUs."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from workers.engine.cpu_binding import BIND_VARIABLE, format_cpus, parse_cpu_list, thread_cpus

if TYPE_CHECKING:
    from offpeak.cli.supervisor import ServiceProcesses


def wait_until(check: Callable[[], object], timeout: float, what: str, logs: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"not {what} after {timeout} s\n{logs}")


def tree(pid: int) -> list[psutil.Process]:
    """``pid`` and every descendant of it, right now."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie whose parent has not reaped it yet counts as gone)."""
    living = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                living.append(proc)
        except psutil.NoSuchProcess:
            pass
    return living


def wait_gone(procs: list[psutil.Process], timeout: float = 20) -> list[psutil.Process]:
    """Wait for ``procs`` to end; those still running after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(procs)


def describe(proc: psutil.Process) -> str:
    """One line for a report: pid, name, state and the start of the command line."""
    try:
        return f"{proc.pid} {proc.name()} [{proc.status()}] {' '.join(proc.cmdline())[:80]!r}"
    except psutil.NoSuchProcess:
        return f"{proc.pid} (gone)"


def watch_until_gone(procs: list[psutil.Process], timeout: float) -> dict[int, float]:
    """Seconds from now until each of ``procs`` ended (a zombie counts as ended); those still
    running after ``timeout`` are absent."""
    started, ended = time.monotonic(), {}
    while time.monotonic() - started < timeout:
        for proc in procs:
            if proc.pid not in ended and not alive([proc]):
                ended[proc.pid] = time.monotonic() - started
        if len(ended) == len(procs):
            break
        time.sleep(0.1)
    return ended


def sessions(procs: list[psutil.Process]) -> set[int]:
    """The session ids of ``procs``. Each service process leads a session of its own, and its
    children stay in it even when orphaned (an orphaned beat did), so a session finds them when
    their parent is gone. (Not the environment: Celery's process titles overwrite it.)"""
    found = set()
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            found.add(os.getsid(proc.pid))
    return found


def in_sessions(sids: set[int]) -> list[psutil.Process]:
    """Every running process of the machine in one of the sessions ``sids``."""
    found = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) in sids:
                found.append(psutil.Process(pid))
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return alive(found)


@contextlib.contextmanager
def running(stack: ServiceProcesses) -> Iterator[ServiceProcesses]:
    """``stack`` started and its API answering for the block, stopped after it (its processes'
    trees included), whatever the block raised."""
    stack.start()
    try:
        stack.wait_http()
        yield stack
    finally:
        stack.stop()


def instant_stack_env(
    base_env: dict[str, str], database_url: str, prefix: str, **more: str
) -> dict[str, str]:
    """A stack's environment on ``base_env``: its own database and queue prefix, the default
    model's name served by the instant engine, and the ``OFFPEAK_…`` settings in ``more``."""
    from offpeak.settings import DEFAULT_MODEL

    return {
        **base_env,
        "OFFPEAK_DATABASE_URL": database_url,
        "OFFPEAK_QUEUE_PREFIX": prefix,
        "OFFPEAK_MODELS": json.dumps({DEFAULT_MODEL: {"engine": "instant"}}),
        **more,
    }


def start_instant_engine_worker(stack: ServiceProcesses, name: str, model: str) -> None:
    """Start engine worker ``name`` of ``stack`` on the instant engine, answering for ``model``
    under its name: for a test whose subject is lines coming back, not the engine answering."""
    models = stack.env["OFFPEAK_MODELS"]
    stack.env["OFFPEAK_MODELS"] = json.dumps({model: {"engine": "instant"}})
    try:
        stack.start_worker("engine", name)
    finally:
        stack.env["OFFPEAK_MODELS"] = models


def bound_cpus() -> set[int]:
    """The CPUs of ``VLLM_CPU_OMP_THREADS_BIND`` (``tests/conftest.py`` gives each xdist worker
    one); without it, every CPU of this process."""
    return parse_cpu_list(
        os.environ.get(BIND_VARIABLE) or format_cpus(sorted(os.sched_getaffinity(0)))
    )


def one_engine_core_on_bound_cpus(candidates: Iterable[psutil.Process]) -> psutil.Process:
    """The one ``VLLM::`` process among ``candidates``, checked to be ``VLLM::EngineCore`` with
    no ``VLLM::`` process under it (no model-runner process of its own) and every thread of it
    allowed only ``bound_cpus()``; an ``AssertionError`` says what differs."""
    engines = [proc for proc in candidates if proc.name().startswith("VLLM::")]
    assert [proc.name() for proc in engines] == ["VLLM::EngineCore"], engines
    (core,) = engines
    under = [c.name() for c in core.children(recursive=True) if c.name().startswith("VLLM::")]
    assert not under, under
    bound = bound_cpus()
    allowed = {
        thread.id: thread_cpus(Path(f"/proc/{core.pid}/task/{thread.id}"))
        for thread in core.threads()
    }
    assert allowed and all(cpus <= bound for cpus in allowed.values()), (bound, allowed)
    return core
