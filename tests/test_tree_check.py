"""The guard that keeps the suite from changing tracked files (``tests/tree_check.py``), on a git
checkout of its own: a tracked file written during the run fails it; work in progress from
before the run, untracked files and a checkout that is not git do not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.tree_check import tracked_files_unchanged

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture()
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "picture.png").write_bytes(b"\x89PNG old")
    (root / "README.md").write_text("committed\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "init")
    (root / "README.md").write_text("edited before the run\n")  # work in progress
    return root


def test_a_tracked_file_written_during_the_run_fails_it(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OFFPEAK_TREE_CHECK", raising=False)
    with (
        pytest.raises(AssertionError, match=r"changed tracked files: docs/picture\.png"),
        tracked_files_unchanged(checkout / "docs"),
    ):
        (checkout / "docs" / "picture.png").write_bytes(b"\x89PNG new")


def test_a_tracked_file_deleted_during_the_run_fails_it(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OFFPEAK_TREE_CHECK", raising=False)
    with pytest.raises(AssertionError, match="README.md"), tracked_files_unchanged(checkout):
        (checkout / "README.md").unlink()


def test_earlier_edits_and_untracked_files_pass(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OFFPEAK_TREE_CHECK", raising=False)
    with tracked_files_unchanged(checkout):
        (checkout / "scratch.log").write_text("untracked\n")
        # Rewritten with the same bytes: nothing changed.
        (checkout / "docs" / "picture.png").write_bytes(b"\x89PNG old")
    assert (checkout / "README.md").read_text() == "edited before the run\n"


def test_warn_mode_and_a_folder_outside_git(
    checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFPEAK_TREE_CHECK", "warn")
    with (
        pytest.warns(UserWarning, match="picture.png"),
        tracked_files_unchanged(checkout),
    ):
        (checkout / "docs" / "picture.png").write_bytes(b"changed")
    monkeypatch.delenv("OFFPEAK_TREE_CHECK")
    plain = tmp_path / "not-a-checkout"
    plain.mkdir()
    with tracked_files_unchanged(plain):
        (plain / "anything").write_text("x")
