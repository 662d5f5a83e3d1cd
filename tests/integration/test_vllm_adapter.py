"""The vLLM adapter's arguments, with vLLM imported but no engine started: structured output as
vLLM's sampling parameters, a schema vLLM refuses, the pooling engine's process environment and
its block size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from offpeak.endpoints import SamplingSpec
from offpeak.endpoints.base import StructuredOutput
from offpeak.settings import (
    DEFAULT_EMBEDDING_MODEL,
    ModelConfig,
    get_settings,
)
from workers.engine.base import EngineRequest

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_output_maps_to_vllm_sampling_params() -> None:
    pytest.importorskip("vllm")
    from workers.engine.vllm_engine import to_sampling_params

    schema = orjson.dumps(PERSON).decode()
    params = to_sampling_params(SamplingSpec(8, structured_output=StructuredOutput(schema)))
    assert params.structured_outputs is not None and params.structured_outputs.json == schema
    plain = to_sampling_params(SamplingSpec(8, structured_output=StructuredOutput()))
    assert plain.structured_outputs is not None and plain.structured_outputs.json_object is True
    assert to_sampling_params(SamplingSpec(8)).structured_outputs is None


def test_logit_bias_maps_to_vllm_sampling_params() -> None:
    pytest.importorskip("vllm")
    from workers.engine.vllm_engine import to_sampling_params

    params = to_sampling_params(SamplingSpec(8, logit_bias=((3, -100.0), (17, 2.5))))
    assert params.logit_bias == {3: -100.0, 17: 2.5}
    assert to_sampling_params(SamplingSpec(8)).logit_bias is None


def test_vllms_refusal_of_a_schema_names_the_lines_schema_param() -> None:
    """vLLM compiles a schema when a request is added; its refusal (``VLLMValidationError``,
    raised from ``SamplingParams._validate_structured_outputs``) becomes a ``RequestRefused``
    naming the line's schema field, and any other refusal keeps vLLM's message alone."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config import StructuredOutputsConfig

    from workers.engine.vllm_engine import _refusal, to_sampling_params

    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    spec = SamplingSpec(8, structured_output=StructuredOutput(orjson.dumps(bad).decode(), "p.q"))
    request = EngineRequest("1", [1], spec)
    params = to_sampling_params(spec)
    config = StructuredOutputsConfig(backend="xgrammar")
    with pytest.raises(Exception) as info:  # noqa: PT011 (vLLM's own error type)
        params._validate_structured_outputs(SimpleNamespace(is_diffusion=False), config, object())  # type: ignore[arg-type]
    refusal = _refusal(request, info.value)
    assert (refusal.param, refusal.code) == ("p.q", "invalid_json_schema")
    assert isinstance(refusal, ValueError) and "$defs" in str(refusal)
    other = _refusal(request, ValueError("prompt too long"))
    assert (other.param, other.code, str(other)) == (None, None, "prompt too long")


MODEL = DEFAULT_EMBEDDING_MODEL


class _Started(Exception):
    """Raised by the stand-in ``LLM``: the environment it saw is all the test needs."""


@pytest.mark.parametrize("operator_value", [None, "64"])
def test_the_pooling_engine_starts_its_processes_without_onednn_s_global_cache(
    monkeypatch: pytest.MonkeyPatch, operator_value: str | None
) -> None:
    """vLLM's EngineCore and model-runner processes inherit ``os.environ`` as ``LLM`` starts
    them: they see ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` (the cache grew per step shape:
    ``ENGINE_PROCESS_ENV``), an operator's own value wins, and the worker's environment is as
    it was afterwards (the chat engine's processes keep oneDNN's default)."""
    import vllm

    from workers.engine import vllm_pooling
    from workers.model_store import find_minilm_folder

    key = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    assert vllm_pooling.ENGINE_PROCESS_ENV[key] == "0"
    if operator_value is None:
        monkeypatch.delenv(key, raising=False)
    else:
        monkeypatch.setenv(key, operator_value)
    seen: dict[str, str | None] = {}

    def started(**_kwargs: Any) -> None:
        seen[key] = os.environ.get(key)
        raise _Started

    monkeypatch.setattr(vllm, "LLM", started)
    config = get_settings().models[MODEL]
    with pytest.raises(_Started):
        vllm_pooling.VllmPoolingEngine.load(MODEL, config, find_minilm_folder())
    assert seen[key] == (operator_value or "0")
    assert os.environ.get(key) == operator_value


FOLDER = Path("/models/m")


def test_the_embedding_engine_keeps_vllms_block_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU block size serves prefix caching, which an encoder-only model has none of."""
    import vllm

    from workers.engine.vllm_pooling import VllmPoolingEngine

    seen: list[dict[str, object]] = []

    class Loaded(Exception):
        pass

    def fake_llm(**kwargs: object) -> None:
        seen.append(kwargs)
        raise Loaded

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    for config in (ModelConfig(path=str(FOLDER)), ModelConfig(path=str(FOLDER), block_size=64)):
        with pytest.raises(Loaded):
            VllmPoolingEngine.load("e", config, FOLDER)
    assert "block_size" not in seen[0] and seen[1]["block_size"] == 64
