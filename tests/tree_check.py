"""The test suite must leave the checkout as it found it: no tracked file changed by a run.

``tests/conftest.py`` takes a snapshot of every tracked file's content when the session starts
and compares it when the session ends. Only changes made *during* the run count: files already
edited before it (work in progress in the checkout) are compared with their own content at the
start, not with the last commit. Files tracked only after the start (someone's ``git add``) are
left out; the suite never adds files to git.

A person or program editing the checkout while the suite runs is indistinguishable from a test
writing there; ``OFFPEAK_TREE_CHECK=warn`` turns the failure into a warning for such runs
(``off`` skips the check). Outside a git checkout (an unpacked sdist) there is nothing to check.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: File path (relative to the checkout) → content digest, None for a file that does not exist.
Snapshot = dict[str, str | None]


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
    return Path(done.stdout.strip()) if done.returncode == 0 else None


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


@contextmanager
def tracked_files_unchanged(start: Path) -> Iterator[None]:
    """Fail (``AssertionError``), warn or do nothing, as ``OFFPEAK_TREE_CHECK`` says (``fail``,
    ``warn``, ``off``; default ``fail``), when the block changed a tracked file of the checkout
    around ``start``."""
    mode = os.environ.get("OFFPEAK_TREE_CHECK", "fail")
    root = checkout_root(start) if mode != "off" else None
    if root is None:
        yield
        return
    before = snapshot(root)
    yield
    touched = changed(before, snapshot(root, list(before)))
    if not touched:
        return
    message = (
        f"the test run changed tracked files: {', '.join(touched)} (tests must write under a "
        "temporary folder; if someone else edited these files during the run, rerun with "
        "OFFPEAK_TREE_CHECK=warn)"
    )
    if mode == "warn":
        warnings.warn(message, stacklevel=1)
    else:
        raise AssertionError(message)
