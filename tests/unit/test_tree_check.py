"""The guard that keeps the suite from changing tracked files (``tests/support/tree_check.py``), on
a git checkout of its own: a tracked file written during the run by the test process or by a
Python process it started fails it, naming the test; a change no test process made (someone
editing the checkout meanwhile) warns, and fails in CI; work in progress from before the run,
untracked files and a folder outside git pass."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tree_check import tracked_files_unchanged

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


@pytest.fixture()
def checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("OFFPEAK_TREE_CHECK", raising=False)
    monkeypatch.delenv("CI", raising=False)
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "picture.png").write_bytes(b"\x89PNG old")
    (root / "README.md").write_text("committed\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "init")
    (root / "README.md").write_text("edited before the run\n")  # work in progress
    return root


def test_a_tracked_file_the_test_writes_fails_the_run(checkout: Path) -> None:
    with (
        pytest.raises(AssertionError, match=r"docs/picture\.png, written by tests/unit/test_tree_"),
        tracked_files_unchanged(checkout / "docs"),
    ):
        (checkout / "docs" / "picture.png").write_bytes(b"\x89PNG new")


def test_a_python_child_process_that_writes_or_deletes_is_caught(checkout: Path) -> None:
    script = "import os; open('docs/picture.png', 'ab').write(b'x'); os.remove('README.md')"
    with (
        pytest.raises(AssertionError, match=r"README\.md, written by .*picture\.png, written by"),
        tracked_files_unchanged(checkout),
    ):
        subprocess.run([sys.executable, "-c", script], cwd=checkout, check=True)


def test_a_change_no_test_process_made_warns_and_fails_in_ci(
    checkout: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def someone_edits() -> None:  # a person's editor, not a Python child of the suite
        subprocess.run(["sh", "-c", "echo edited > docs/picture.png"], cwd=checkout, check=True)

    with (
        pytest.warns(UserWarning, match=r"docs/picture\.png \(no test process wrote them"),
        tracked_files_unchanged(checkout),
    ):
        someone_edits()
    monkeypatch.setenv("CI", "1")
    with (
        pytest.raises(AssertionError, match="no test process wrote them"),
        tracked_files_unchanged(checkout),
    ):
        subprocess.run(["sh", "-c", "echo again > docs/picture.png"], cwd=checkout, check=True)


def test_earlier_edits_untracked_files_and_equal_rewrites_pass(checkout: Path) -> None:
    with tracked_files_unchanged(checkout):
        (checkout / "scratch.log").write_text("untracked\n")
        (checkout / "docs" / "picture.png").write_bytes(b"\x89PNG old")  # the same bytes
    assert (checkout / "README.md").read_text() == "edited before the run\n"


def test_warn_and_off_modes_and_a_folder_outside_git(
    checkout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OFFPEAK_TREE_CHECK", "warn")
    with pytest.warns(UserWarning, match="written by"), tracked_files_unchanged(checkout):
        (checkout / "docs" / "picture.png").write_bytes(b"changed")
    monkeypatch.setenv("OFFPEAK_TREE_CHECK", "off")
    with tracked_files_unchanged(checkout):
        (checkout / "docs" / "picture.png").write_bytes(b"changed again")
    monkeypatch.delenv("OFFPEAK_TREE_CHECK")
    plain = tmp_path / "not-a-checkout"
    plain.mkdir()
    with tracked_files_unchanged(plain):
        (plain / "anything").write_text("x")
