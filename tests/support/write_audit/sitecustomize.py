"""Records the files a test run's Python processes write under a folder
(``tests/support/tree_check.py``).

While the suite runs, this folder is first on ``PYTHONPATH``, so every Python process the tests
start (``offpeak`` workers and the API, vLLM's engine core, CLI calls) imports this module at
startup; the pytest process loads it by path. With ``OFFPEAK_WRITE_AUDIT_ROOT`` and
``OFFPEAK_WRITE_AUDIT_LOG`` set, it installs an audit hook (PEP 578) that appends one line per
write, rename, copy, truncate or delete of a path under the root: ``pid, event, path, test``
(``test`` is pytest's ``PYTEST_CURRENT_TEST`` of the process or of the one that started it).
Reads cost one flag test; nothing else changes. A ``sitecustomize`` found further along
``sys.path`` still runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import threading
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
#: Audit events that change a file, and the position of the changed path in their arguments.
_TARGET = {
    "os.rename": 1,  # os.rename and os.replace: the destination
    "os.remove": 0,
    "os.truncate": 0,
    "shutil.copyfile": 1,
    "shutil.rmtree": 0,
}
#: (root folder with a trailing separator, log file) pairs being recorded.
_targets: list[tuple[str, str]] = []
_local = threading.local()


def install(root: str, log: str) -> None:
    """Record writes under ``root`` into the file ``log`` until ``uninstall`` (the hook itself
    stays: audit hooks cannot be removed)."""
    if not _targets and not getattr(sys, "_offpeak_write_audit", False):
        sys.addaudithook(_hook)
        sys._offpeak_write_audit = True  # type: ignore[attr-defined]  # once per process
    _targets.append((os.path.realpath(root) + os.sep, log))


def uninstall(root: str, log: str) -> None:
    """Stop recording ``root`` into ``log``."""
    _targets.remove((os.path.realpath(root) + os.sep, log))


def _record(event: str, path: Any) -> None:
    if not _targets or isinstance(path, int) or path is None:  # an fd: opened earlier
        return
    try:
        full = os.path.realpath(os.fsdecode(os.fspath(path)))
    except (TypeError, ValueError):
        return
    for prefix, log in list(_targets):
        if not full.startswith(prefix) or getattr(_local, "busy", False):
            continue
        _local.busy = True  # writing the log raises an "open" event of its own
        try:
            test = os.environ.get("PYTEST_CURRENT_TEST", "")
            entry = f"{os.getpid()}\t{event}\t{full[len(prefix) :]}\t{test}\n"
            fd = os.open(log, os.O_WRONLY | os.O_APPEND)  # never re-created once removed
            try:
                os.write(fd, entry.encode())
            finally:
                os.close(fd)
        except OSError:
            pass  # the run ended and removed its log
        finally:
            _local.busy = False


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if event == "open":
        path, mode, flags = args
        if (mode is not None and any(c in mode for c in "wax+")) or flags & _WRITE_FLAGS:
            _record(event, path)
    elif event in _TARGET:
        _record(event, args[_TARGET[event]])


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one."""
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # imported at startup, not loaded by path from tree_check
    _root, _log = (
        os.environ.get("OFFPEAK_WRITE_AUDIT_ROOT"),
        os.environ.get("OFFPEAK_WRITE_AUDIT_LOG"),
    )
    if _root and _log:
        install(_root, _log)
    _chain()
