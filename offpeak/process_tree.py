"""No child outlives its parent: the process-lifetime rules every Offpeak process follows
(Linux; no-ops elsewhere).

- ``die_with_parent``: a ``Popen(preexec_fn=...)`` child gets SIGKILL when its parent dies.
- ``spawned_children_die_with_this_process``: the same for ``multiprocessing`` *spawn*
  children (vLLM's engine-core), SIGKILL of this process included.
- ``adopt_orphans``: descendants whose parent dies stay this process's descendants.
- ``kill_children``: end every descendant of a process (a worker's last act before it exits).
- ``kill_group``: SIGKILL what is left of a child's process group.
- ``exit_without_teardown``: a worker's exit once its work is handed back, without the
  interpreter's teardown.

Used by the workers (``offpeak worker``, ``workers.celery_worker``) and by the supervisor of
``offpeak up`` (``offpeak.cli.supervisor``). Standard library and psutil only.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from typing import NoReturn

#: prctl(2) option: the signal a process gets when the thread that started it ends.
_PR_SET_PDEATHSIG = 1
#: prctl(2) option: orphaned descendants are re-parented to this process, not to init.
_PR_SET_CHILD_SUBREAPER = 36


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``; a no-op elsewhere). Meant for ``Popen(preexec_fn=...)``.

    The parent is, to the kernel, the *thread* that started this process: start children from a
    thread that lives as long as the parent process (its main thread). If ``expected_parent``
    (a pid) is no longer the parent, it died before the call and this process exits at once.
    Raises ``OSError`` when prctl fails.
    """
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def adopt_orphans() -> None:
    """Make this process the parent of its descendants whose parent dies (Linux
    ``prctl(PR_SET_CHILD_SUBREAPER)``; a no-op elsewhere), so they stay its descendants: a
    child started by a process that is being ended (vLLM's engine-core starting its model
    runner) is still found and ended with the rest. Raises ``OSError`` when prctl fails."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


# Run first by a spawned child's interpreter: the same prctl, then the parent check. Inline, with
# the standard library only, since it runs before anything of the child is imported.
_SPAWN_PRELUDE = (
    "import ctypes as _c, os as _o; _c.CDLL(None).prctl({option}, {sig}, 0, 0, 0); "
    "_o.getppid() == {parent} or _o._exit(1); "
)


def spawned_children_die_with_this_process() -> None:
    """Make every ``multiprocessing`` child this process starts with the *spawn* method get
    SIGKILL when this process dies, SIGKILL of this process included (Linux; a no-op elsewhere).

    vLLM starts its engine-core with spawn (always on CPU; on GPU once CUDA is initialized) and,
    when its parent is killed, the engine-core lives on, holding the model's memory (on a GPU,
    the device's). A spawned child is a fresh ``python -c 'from multiprocessing.spawn import
    spawn_main; ...'``; this wraps ``multiprocessing.spawn.get_command_line`` so that command
    first sets the child's parent-death signal. Children must be started from the main thread
    (see ``die_with_parent``): an engine worker builds its engines there. Idempotent.
    """
    if sys.platform != "linux":
        return
    from multiprocessing import spawn

    original = spawn.get_command_line
    if getattr(original, "offpeak_dies_with_parent", False):
        return

    @functools.wraps(original)
    def get_command_line(**kwds: object) -> list[str]:
        line: list[str] = original(**kwds)
        if "-c" in line:
            at = line.index("-c") + 1
            if line[at].startswith("from multiprocessing.spawn import spawn_main"):
                prelude = _SPAWN_PRELUDE.format(
                    option=_PR_SET_PDEATHSIG, sig=int(signal.SIGKILL), parent=os.getpid()
                )
                line = [*line[:at], prelude + line[at], *line[at + 1 :]]
        return line

    get_command_line.offpeak_dies_with_parent = True  # type: ignore[attr-defined]
    spawn.get_command_line = get_command_line


def _resource_tracker_pid() -> int | None:
    """The pid of this process's ``multiprocessing`` resource tracker, if it started one (vLLM's
    spawn children do)."""
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


def kill_children(timeout: float = 5.0, pid: int | None = None) -> None:
    """End every descendant of process ``pid`` (default: this one): SIGTERM, then SIGKILL to
    those still alive after ``timeout`` seconds (``timeout`` 0: SIGKILL at once). Never raises
    for a process that is already gone. This process's ``multiprocessing`` resource tracker is
    left to end by itself, which it does as soon as this process exits."""
    import psutil

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    if pid is None:
        # multiprocessing's resource tracker ignores SIGTERM by design and ends by itself once
        # this process has (its pipe closes), after unlinking what leaked: waiting ``timeout``
        # for it to obey SIGTERM added 5 s to every engine worker's stop.
        tracker = _resource_tracker_pid()
        children = [child for child in children if child.pid != tracker]
    if timeout > 0:
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.terminate()
        _, children = psutil.wait_procs(children, timeout=timeout)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(children, timeout=5)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with ``code`` at once: flush the log handlers and the standard streams, then
    ``os._exit``. What it skips is the interpreter's teardown (``atexit`` callbacks, then every
    module's objects freed): for a process that loaded torch and vLLM, seconds more on a busy
    host, and past a worker's stop timeout, since the daemon thread that enforces that timeout
    cannot run once ``Py_FinalizeEx`` has begun freeing modules. For a process whose work is
    handed back and whose children are gone."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def kill_group(pgid: int) -> None:
    """SIGKILL what is left of a child's process group (its leader may be gone already)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
