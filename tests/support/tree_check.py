"""The test suite must leave the checkout as it found it: no tracked file changed by a run.

``tests/conftest.py`` wraps the session in ``tracked_files_unchanged``:

- **What changed**: a digest of every tracked file's content when the session starts, compared
  when it ends. Only changes made *during* the run count: files already edited before it (work
  in progress in the checkout) are compared with their own content at the start, not with the
  last commit. Files tracked only after the start (someone's ``git add``) are left out.
- **Who changed it**: the pytest process and every Python process it starts record the files
  they write under the checkout (``tests/support/write_audit/sitecustomize.py``, an audit hook). A
  changed file one of them wrote fails the run, naming the test. A changed file none of them
  wrote was most likely edited by someone working in the same checkout meanwhile (or by a
  non-Python child such as Chromium): a warning, and a failure in CI (``CI`` set), where
  nobody else edits.

``OFFPEAK_TREE_CHECK``: ``fail`` (the default, as above), ``strict`` (every change fails),
``warn`` (every change warns), ``off``. Outside a git checkout there is nothing to check.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

#: File path (relative to the checkout) → content digest, None for a file that does not exist.
Snapshot = dict[str, str | None]
AUDIT_SITE = Path(__file__).resolve().parent / "write_audit"


def checkout_root(start: Path) -> Path | None:
    """The git work tree containing ``start``, or None (no git, or not a checkout)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(start), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(done.stdout.strip()).resolve() if done.returncode == 0 else None


def tracked_files(root: Path) -> list[str]:
    """Paths of the files git tracks under ``root`` (the index), relative to it."""
    done = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    return [p.decode() for p in done.stdout.split(b"\0") if p]


def digest(path: Path) -> str | None:
    """BLAKE2b of the file's bytes (of the link's target name for a symlink); None if absent."""
    try:
        if path.is_symlink():
            return "link:" + os.readlink(path)
        return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()
    except FileNotFoundError:
        return None
    except IsADirectoryError:  # a submodule's folder
        return "dir"


def snapshot(root: Path, paths: list[str] | None = None) -> Snapshot:
    """The digest of every tracked file (or of ``paths``) in the work tree at ``root``."""
    return {p: digest(root / p) for p in (tracked_files(root) if paths is None else paths)}


def changed(before: Snapshot, after: Snapshot) -> list[str]:
    """Files of ``before`` whose content differs in ``after`` (deleted ones included)."""
    return sorted(p for p, d in before.items() if after.get(p) != d)


def read_audit(log: Path) -> dict[str, str]:
    """Written path (relative to the root; a folder for a tree removed) → the test that wrote
    it, from the audit hook's log."""
    if not log.exists():
        return {}
    writes: dict[str, str] = {}
    for entry in log.read_text(errors="replace").splitlines():
        _pid, event, path, test = (entry.split("\t") + ["", "", "", ""])[:4]
        writes.setdefault(path, f"{test or 'outside any test'} ({event})")
    return writes


def writer_of(path: str, writes: dict[str, str]) -> str | None:
    """The test that wrote ``path`` or removed a folder holding it, if a test process did."""
    for written, test in writes.items():
        if path == written or path.startswith(written.rstrip("/") + "/"):
            return test
    return None


def _audit_module() -> ModuleType:
    """``tests/support/write_audit/sitecustomize.py``, loaded once into this process by its path."""
    name = "offpeak_write_audit"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, AUDIT_SITE / "sitecustomize.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


@contextmanager
def _audited(root: Path) -> Iterator[Path]:
    """Record writes under ``root`` by this process and by the Python processes it starts."""
    fd, name = tempfile.mkstemp(prefix="offpeak-writes-", suffix=".log")
    os.close(fd)
    log = Path(name)
    audit = _audit_module()
    audit.install(str(root), str(log))
    saved = {
        k: os.environ.get(k)
        for k in ("PYTHONPATH", "OFFPEAK_WRITE_AUDIT_ROOT", "OFFPEAK_WRITE_AUDIT_LOG")
    }
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(AUDIT_SITE), saved["PYTHONPATH"]) if p
    )
    os.environ["OFFPEAK_WRITE_AUDIT_ROOT"] = str(root)
    os.environ["OFFPEAK_WRITE_AUDIT_LOG"] = str(log)
    try:
        yield log
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        audit.uninstall(str(root), str(log))
        log.unlink(missing_ok=True)


@contextmanager
def tracked_files_unchanged(start: Path) -> Iterator[None]:
    """Check the block left the tracked files of the checkout around ``start`` as they were:
    raise ``AssertionError`` or warn (``UserWarning``) as the module docstring says."""
    mode = os.environ.get("OFFPEAK_TREE_CHECK", "fail")
    root = checkout_root(start) if mode != "off" else None
    if root is None:
        yield
        return
    before = snapshot(root)
    with _audited(root) as log:
        yield
        touched = changed(before, snapshot(root, list(before)))
        writes = read_audit(log)
    if not touched:
        return
    ours = {p: t for p in touched if (t := writer_of(p, writes)) is not None}
    others = [p for p in touched if p not in ours]
    failures = [f"{p}, written by {t}" for p, t in ours.items()]
    notes = []
    if others:
        strict = mode == "strict" or (mode == "fail" and os.environ.get("CI"))
        (failures if strict else notes).append(
            f"{', '.join(others)} (no test process wrote them: edited by someone else during "
            "the run, or by a non-Python child process)"
        )
    if mode == "warn":
        notes, failures = notes + failures, []
    message = "the test run changed tracked files (tests write under temporary folders): "
    if notes:
        warnings.warn(message + "; ".join(notes), stacklevel=1)
    if failures:
        raise AssertionError(message + "; ".join(failures))
