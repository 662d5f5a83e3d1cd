"""``offpeak demo`` finds its example wherever the package is installed: the file is package
data of ``offpeak``, not a path two folders above it (absent in a wheel or the Docker image)."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import offpeak
from offpeak.cli.demo import QUICKSTART

ROOT = Path(__file__).resolve().parents[2]


def test_the_quickstart_file_is_package_data_of_offpeak() -> None:
    package = Path(offpeak.__file__).resolve().parent
    relative = QUICKSTART.resolve().relative_to(package)
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["offpeak"]
    assert any(fnmatch.fnmatch(str(relative), pattern) for pattern in globs)
    assert QUICKSTART.read_bytes().count(b"\n") >= 20


def test_the_checkouts_examples_folder_shows_the_same_file() -> None:
    assert (ROOT / "examples" / "quickstart.jsonl").resolve() == QUICKSTART.resolve()
