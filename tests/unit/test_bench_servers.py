"""The ``vllm serve`` stand-in's command line and environment (``bench/servers.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.servers import VllmServe
from workers.engine.vllm_shared import UNIPROC_EXECUTOR

#: What OpenMP reads; each test starts without them, whatever the machine's environment sets.
OPENMP = ("OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY", "GOMP_CPU_AFFINITY")


@pytest.fixture(autouse=True)
def bound_to_cpu_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*OPENMP, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")


def server(one_process: bool) -> VllmServe:
    return VllmServe(Path("/m"), "m", 8000, Path("/log"), ("--seed", "1"), one_process=one_process)


def test_vllm_serve_keeps_vllms_default_executor_unless_asked() -> None:
    default = server(one_process=False)
    assert "--distributed-executor-backend" not in default.command()
    assert not set(OPENMP) & set(default.environment())
    assert default.environment()["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_one_process_serve_runs_the_model_in_the_engine_core_on_the_bound_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    command = server(one_process=True).command()
    at = command.index("--distributed-executor-backend")
    assert command[at + 1] == UNIPROC_EXECUTOR
    assert command[-2:] == ["--seed", "1"]  # the caller's arguments still come last
    env = server(one_process=True).environment()
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"]) == ("1", "{1}")
    # An OpenMP variable the caller set wins.
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert server(one_process=True).environment()["OMP_NUM_THREADS"] == "7"
