"""The import layers of ``pyproject.toml`` (``[tool.importlinter]``): ``lint-imports`` keeps them
on this tree, and each contract breaks when a module of its source imports what it forbids (on a
copy of the tree, so the checkout is never touched)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("offpeak", "api", "workers", "storage", "bench", "migrations")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path, *contracts: str) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the tree at ``cwd`` (its own packages first on the path), no cache."""
    args = [str(LINT_IMPORTS), "--no-cache", "--no-logo"]
    for contract in contracts:
        args += ["--contract", contract]
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_layers_hold() -> None:
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's packages and ``pyproject.toml``, copied (sources only)."""
    root = tmp_path_factory.mktemp("tree")
    ignore = shutil.ignore_patterns("__pycache__", "static", "results", "*.json")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


@pytest.mark.parametrize(
    ("contract", "importer", "forbidden"),
    [
        ("core", "offpeak", "storage.db"),
        ("core", "offpeak.endpoints", "api.schemas"),
        ("core", "offpeak", "workers.tasks"),
        ("core", "offpeak", "offpeak.cli.supervisor"),
        ("core", "offpeak", "bench.harness"),
        ("storage", "storage.repositories", "api.schemas"),
        ("storage", "storage", "workers.tasks"),
        ("storage", "storage", "offpeak.cli"),
        ("api", "api.services", "workers.celery_worker"),
        ("api", "api", "vllm"),
        ("api", "api", "torch"),
        ("workers", "workers", "api.schemas"),
        ("workers", "workers.scheduler", "offpeak.cli.client"),
        ("sim", "workers.scheduler", "workers.sim.day"),
        ("sim", "api.services", "workers.sim.store"),
    ],
)
def test_each_contract_breaks_on_a_forbidden_import(
    tree_copy: Path, contract: str, importer: str, forbidden: str
) -> None:
    probe = tree_copy.joinpath(*importer.split(".")) / "_layer_probe.py"
    probe.write_text(f"import {forbidden}\n")
    try:
        result = lint_imports(tree_copy, contract)
    finally:
        probe.unlink()
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout and f"{importer}._layer_probe -> {forbidden}" in result.stdout


@pytest.mark.parametrize(
    ("contract", "importer", "imported"),
    [
        # The two cycles the EngineWorker ended: each import back, put in again, breaks it.
        ("engine-worker", "workers.tasks", "workers.celery_worker"),
        ("engine-worker", "workers.shutdown", "workers.engine.registry"),
        ("engine-worker", "workers.engine_worker", "workers.tasks"),
        ("vllm-shared", "workers.engine.vllm_pooling", "workers.engine.vllm_engine"),
        # The lane's package: the scheduler's metrics once imported its controller.
        ("lane", "workers.scheduler.scheduler_metrics", "workers.lane.controller"),
        ("lane", "workers.lane.steering", "workers.runner.loop"),
    ],
)
def test_an_import_back_breaks_its_contract(
    tree_copy: Path, contract: str, importer: str, imported: str
) -> None:
    module = tree_copy.joinpath(*importer.split(".")).with_suffix(".py")
    source = module.read_text()
    module.write_text(f"{source}\nimport {imported}  # noqa: E402\n")
    try:
        result = lint_imports(tree_copy, contract)
    finally:
        module.write_text(source)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout and f"{importer} -> {imported}" in result.stdout
