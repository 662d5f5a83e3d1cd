"""Embeddings lines without a database or an engine: every input shape, bad bodies, the length
limit, dimensions, which model takes which line, and the SDK's types on the body."""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
import orjson
import pytest
from openai.types import CreateEmbeddingResponse

from offpeak.endpoints import embeddings as emb
from offpeak.endpoints.base import PoolingSpec
from offpeak.endpoints.records import Answer
from offpeak.settings import DEFAULT_EMBEDDING_MODEL
from workers.engine.instant import InstantEngine
from workers.engine_io import LineError, prepare

URL: Literal["/v1/embeddings"] = "/v1/embeddings"


MODEL = DEFAULT_EMBEDDING_MODEL


class FakePooler:
    """The ``Tokenizer`` face of an embedding engine, without one: ids are word counts."""

    model_name = MODEL
    max_model_len = 8
    embedding_size = 4
    matryoshka_dimensions: tuple[int, ...] | None = None

    def encode_text(self, text: str) -> list[int]:
        return [101, *(7 for _ in text.split()), 102]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        raise ValueError("no chat template")


POOLER = FakePooler()


def body(**changes: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hello world", **changes}


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("a b", ((101, 7, 7, 102),)),
        (["a", "b c"], ((101, 7, 102), (101, 7, 7, 102))),
        ([5, 6], ((5, 6),)),
        ([[5], [6, 7]], ((5,), (6, 7))),
        (["a"] * emb.MAX_INPUTS, ((101, 7, 102),) * emb.MAX_INPUTS),
    ],
)
def test_every_input_shape_becomes_one_sequence_per_input(given: Any, inputs: Any) -> None:
    engine_input = emb.Embeddings().prepare(body(input=given), POOLER)
    assert engine_input.pooling == PoolingSpec(inputs, None)
    assert emb.Embeddings().engine_needs(engine_input) == tuple((len(i), 0) for i in inputs)
    assert engine_input.echo == {"encoding_format": "float"}


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        ({"input": ""}, "input", "invalid_value"),
        ({"input": []}, "input", "invalid_value"),
        ({"input": ["a", ""]}, "input[1]", "invalid_value"),
        ({"input": [[1], []]}, "input[1]", "invalid_value"),
        ({"input": [True]}, "input[0]", "invalid_value"),
        ({"input": [-1]}, "input[0]", "invalid_value"),
        ({"input": 3}, "input", "invalid_type"),
        ({"input": {"text": "a"}}, "input", "invalid_type"),
        ({"input": ["a"] * (emb.MAX_INPUTS + 1)}, "input", "invalid_value"),
        ({"input": "w " * 7}, "input", "context_length_exceeded"),
        ({"input": ["a", "w " * 7]}, "input[1]", "context_length_exceeded"),
        ({"encoding_format": "int8"}, "encoding_format", "invalid_value"),
        ({"dimensions": 2}, "dimensions", "unsupported_value"),
        ({"dimensions": 0}, "dimensions", "invalid_value"),
        ({"dimensions": "2"}, "dimensions", "invalid_type"),
        ({"user": 5}, "user", "invalid_type"),
    ],
)
def test_a_bad_body_fails_its_line_naming_the_parameter(
    change: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(LineError) as info:
        emb.Embeddings().prepare(body(**change), POOLER)
    assert (info.value.param, info.value.code, info.value.status_code) == (param, code, 400)


def test_the_length_limit_is_named_in_the_error() -> None:
    with pytest.raises(LineError) as info:
        emb.Embeddings().prepare(body(input="w " * 7), POOLER)
    assert "maximum context length is 8 tokens" in info.value.message
    assert "requested 9 tokens" in info.value.message


def test_dimensions_pass_only_where_the_model_was_trained_for_them() -> None:
    class Matryoshka(FakePooler):
        matryoshka_dimensions = (2, 4)

    spec = emb.Embeddings().prepare(body(dimensions=2), Matryoshka()).pooling
    assert spec is not None and spec.dimensions == 2
    with pytest.raises(LineError):
        emb.Embeddings().prepare(body(dimensions=3), Matryoshka())


def test_a_text_model_refuses_embeddings_lines_and_the_pooler_text_lines() -> None:
    with pytest.raises(LineError) as info:
        prepare("1", URL, body(), InstantEngine("m", max_model_len=64))
    assert (info.value.param, info.value.code) == ("model", "invalid_value")
    with pytest.raises(LineError) as info:
        prepare("1", "/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}]}, POOLER)  # type: ignore[arg-type]  # fmt: skip
    assert "could not be rendered" in info.value.message


def answer(vectors: list[list[float]], encoding_format: str) -> Answer:
    return Answer(
        endpoint=URL,
        model=MODEL,
        created=0,
        line_id="batch_req_1",
        request_id="req_1",
        response_id="emb-1",
        prompt_tokens=11,
        cached_tokens=0,
        completions=[],
        echo={"encoding_format": encoding_format},
        embeddings=[emb.encode_vector(np.asarray(v, "<f4").tobytes()) for v in vectors],
    )


def test_the_body_parses_with_the_sdk_types_in_both_encodings() -> None:
    vectors = [[0.1, -0.25, 3.0e-8, 1.0], [0.5, 0.5, -0.5, 0.5]]
    floats = emb.Embeddings().render(answer(vectors, "float"))
    parsed = CreateEmbeddingResponse.model_validate(orjson.loads(orjson.dumps(floats)))
    assert parsed.object == "list" and parsed.model == MODEL
    assert [d.index for d in parsed.data] == [0, 1]
    assert all(d.object == "embedding" for d in parsed.data)
    assert parsed.usage.prompt_tokens == parsed.usage.total_tokens == 11
    assert np.allclose([d.embedding for d in parsed.data], vectors, atol=1e-7)
    # base64: the float32 bytes, decoded as the openai SDK decodes them (numpy, float32).
    encoded = emb.Embeddings().render(answer(vectors, "base64"))
    for d, row in zip(encoded["data"], parsed.data, strict=True):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="float32")
        assert decoded.tolist() == row.embedding  # the same float32 values exactly
