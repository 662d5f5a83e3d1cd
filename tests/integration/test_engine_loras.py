"""An adapter in the in-process engine (``workers.engine.lora.EngineLoras``), with vLLM imported
but no engine started: vLLM's ``LLMEngine`` is a stand-in whose ``add_lora`` fails as vLLM's
does for an adapter folder it cannot read."""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine.base import LoraSpec, RequestRefused
from workers.engine.lora import EngineLoras

MODEL = "base"


class StandInLLMEngine:
    """What ``EngineLoras`` calls on vLLM's ``LLMEngine``: ``add_lora``, and the engine core's
    liveness."""

    def __init__(self, fail: set[str], dead: bool = False) -> None:
        self.fail, self.loaded = fail, []
        self.engine_core: Any = type(
            "Core", (), {"resources": type("R", (), {"engine_dead": dead})}
        )

    def add_lora(self, lora: Any) -> bool:
        if lora.lora_name in self.fail:
            raise RuntimeError("Call to add_lora method failed: header too large")
        self.loaded.append((lora.lora_name, lora.lora_int_id))
        return True


def test_an_adapter_that_does_not_load_fails_its_requests_and_is_not_tried_again() -> None:
    engine = StandInLLMEngine(fail={"broken"})
    loras = EngineLoras(MODEL, enabled=True)
    good = loras.request_for(engine, LoraSpec("good", "/a/good"))
    assert (good.lora_name, good.lora_int_id, good.lora_path) == ("good", 1, "/a/good")
    for _ in range(2):
        with pytest.raises(RequestRefused) as refused:
            loras.request_for(engine, LoraSpec("broken", "/a/broken"))
        assert refused.value.status_code == 500 and refused.value.code == "adapter_load_failed"
        assert "'broken' cannot be loaded" in str(refused.value)
        assert "header too large" in str(refused.value)
    # Loaded once; the same id every time; a name re-pointed elsewhere is a new adapter.
    assert loras.request_for(engine, LoraSpec("good", "/a/good")).lora_int_id == 1
    assert loras.request_for(engine, LoraSpec("good", "/a/v2")).lora_int_id == 3
    assert engine.loaded == [("good", 1), ("good", 3)]
    assert loras.request_for(engine, None) is None


def test_the_base_model_runs_with_the_zero_adapter_where_one_is_given() -> None:
    engine = StandInLLMEngine(fail=set())
    loras = EngineLoras(MODEL, enabled=True, base=LoraSpec("zero", "/z"))
    assert loras.request_for(engine, None).lora_name == "zero"
    assert loras.request_for(engine, LoraSpec("a", "/a")).lora_name == "a"


def test_a_dead_engine_core_is_an_engine_fault_not_the_adapters() -> None:
    engine = StandInLLMEngine(fail={"a"}, dead=True)
    with pytest.raises(RuntimeError) as raised:
        EngineLoras(MODEL, enabled=True).request_for(engine, LoraSpec("a", "/a"))
    assert not isinstance(raised.value, RequestRefused)


def test_lora_off_refuses_adapter_requests_with_the_reason() -> None:
    with pytest.raises(RequestRefused, match="max_loras is 0"):
        EngineLoras(MODEL, enabled=False).request_for(StandInLLMEngine(set()), LoraSpec("a", "/a"))
