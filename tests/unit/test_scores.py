"""``/v1/score`` and ``/v1/rerank`` lines without a database or an engine: vLLM's input shapes,
bad bodies failing their line alone, which model takes them, and the bodies rendered from a
record's vectors (cosine similarities, ranked, ``top_n``)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from offpeak import endpoints
from offpeak.endpoints import rerank, score, scoring
from offpeak.endpoints.base import PoolingSpec
from offpeak.endpoints.embeddings import encode_vector
from offpeak.endpoints.records import Answer
from offpeak.settings import DEFAULT_EMBEDDING_MODEL
from workers.engine.instant import InstantEngine
from workers.engine_io import LineError, prepare

MODEL = DEFAULT_EMBEDDING_MODEL


class FakePooler:
    """The ``Tokenizer`` face of an embedding engine: one id per word, ``[CLS]`` … ``[SEP]``."""

    model_name = MODEL
    max_model_len = 8
    embedding_size = 4
    vocab_size = 1000
    matryoshka_dimensions: tuple[int, ...] | None = None

    def encode_text(self, text: str) -> list[int]:
        return [101, *(len(word) for word in text.split()), 102]

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        raise ValueError("no chat template")


POOLER = FakePooler()


def ids(text: str) -> tuple[int, ...]:
    return tuple(POOLER.encode_text(text))


def score_body(**changes: Any) -> dict[str, Any]:
    return {"model": MODEL, **changes}


def rerank_body(**changes: Any) -> dict[str, Any]:
    return {"model": MODEL, "query": "a cat", "documents": ["dogs", "cats here"], **changes}


def test_both_endpoints_are_batch_endpoints() -> None:
    assert {"/v1/score", "/v1/rerank"} <= set(endpoints.BATCH_ENDPOINTS)


@pytest.mark.parametrize(
    ("first", "second"), [("text_1", "text_2"), ("queries", "documents"), ("queries", "items"),
                          ("data_1", "data_2")],
)  # fmt: skip
def test_every_pair_name_vllm_takes_is_taken(first: str, second: str) -> None:
    engine_input = score.Score().prepare(score_body(**{first: "a b", second: ["c", "dd"]}), POOLER)
    assert engine_input.pooling == PoolingSpec((ids("a b"), ids("c"), ids("dd")))
    assert engine_input.echo == {"queries": 1}
    assert score.Score().engine_needs(engine_input) == ((4, 0), (3, 0), (3, 0))


def test_n_queries_against_n_documents_embeds_each_once() -> None:
    engine_input = score.Score().prepare(score_body(text_1=["a", "b"], text_2=["c", "d"]), POOLER)
    assert engine_input.pooling is not None and len(engine_input.pooling.inputs) == 4
    assert engine_input.echo == {"queries": 2}


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        ({}, "text_1", "missing_required_parameter"),
        ({"text_1": "a"}, "text_2", "missing_required_parameter"),
        ({"queries": "a", "text_2": "b"}, "documents", "missing_required_parameter"),
        ({"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "invalid_value"),
        ({"text_1": [], "text_2": "b"}, "text_1", "invalid_value"),
        ({"text_1": "a", "text_2": [1]}, "text_2[0]", "invalid_type"),
        ({"text_1": 5, "text_2": "b"}, "text_1", "invalid_type"),
        ({"text_1": {"content": [{"type": "image_url"}]}, "text_2": "b"}, "text_1",
         "unsupported_value"),
        ({"text_1": "a", "text_2": ["b", "w " * 7]}, "text_2[1]", "context_length_exceeded"),
        ({"text_1": "w " * 7, "text_2": "b"}, "text_1", "context_length_exceeded"),
        ({"text_1": "a", "text_2": ["b"] * scoring.MAX_TEXTS}, None, "invalid_value"),
        ({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens",
         "unsupported_parameter"),
        ({"text_1": "a", "text_2": "b", "instruction": "x"}, "instruction",
         "unsupported_parameter"),
    ],
)  # fmt: skip
def test_a_bad_score_body_fails_its_line_naming_the_parameter(
    change: dict[str, Any], param: str | None, code: str
) -> None:
    with pytest.raises(LineError) as info:
        score.Score().prepare(score_body(**change), POOLER)
    assert (info.value.param, info.value.code, info.value.status_code) == (param, code, 400)


def test_vllms_wording_for_mismatched_lengths() -> None:
    with pytest.raises(LineError) as info:
        score.Score().prepare(score_body(text_1=["a", "b"], text_2=["c", "d", "e"]), POOLER)
    assert info.value.message.startswith("Input lengths must be either 1:1, 1:N or N:N")


@pytest.mark.parametrize(
    ("change", "param", "code"),
    [
        ({"query": None}, "query", "invalid_type"),
        ({"query": 5}, "query", "invalid_type"),
        ({"query": {"content": []}}, "query", "unsupported_value"),
        ({"documents": []}, "documents", "invalid_value"),
        ({"documents": ["a", 2]}, "documents[1]", "invalid_type"),
        ({"documents": ["a", "w " * 7]}, "documents[1]", "context_length_exceeded"),
        ({"query": "w " * 7}, "query", "context_length_exceeded"),
        ({"top_n": -1}, "top_n", "invalid_value"),
        ({"top_n": "2"}, "top_n", "invalid_type"),
        ({"return_documents": "yes"}, "return_documents", "invalid_type"),
        ({"max_tokens_per_doc": 3}, "max_tokens_per_doc", "unsupported_parameter"),
    ],
)
def test_a_bad_rerank_body_fails_its_line_naming_the_parameter(
    change: dict[str, Any], param: str, code: str
) -> None:
    with pytest.raises(LineError) as info:
        rerank.Rerank().prepare(rerank_body(**change), POOLER)
    assert (info.value.param, info.value.code, info.value.status_code) == (param, code, 400)


def test_a_missing_query_is_named() -> None:
    body = rerank_body()
    del body["query"]
    with pytest.raises(LineError) as info:
        rerank.Rerank().prepare(body, POOLER)
    assert (info.value.param, info.value.code) == ("query", "missing_required_parameter")
    assert rerank.Rerank.required_fields == ("query", "documents")


def test_rerank_embeds_the_query_then_each_document() -> None:
    engine_input = rerank.Rerank().prepare(rerank_body(documents="one doc", top_n=1), POOLER)
    assert engine_input.pooling == PoolingSpec((ids("a cat"), ids("one doc")))
    assert engine_input.echo == {"top_n": 1, "documents": ["one doc"]}
    hidden = rerank.Rerank().prepare(rerank_body(return_documents=False), POOLER)
    assert hidden.echo == {"top_n": 0}


@pytest.mark.parametrize("url", ["/v1/score", "/v1/rerank"])
def test_a_text_model_refuses_scoring_lines(url: str) -> None:
    body = score_body(text_1="a", text_2="b") if url == "/v1/score" else rerank_body()
    with pytest.raises(LineError) as info:
        prepare("1", url, body, InstantEngine("m", max_model_len=64))
    assert (info.value.param, info.value.code) == ("model", "invalid_value")
    assert url in info.value.message


def vec(*values: float) -> str:
    return encode_vector(np.asarray(values, "<f4").tobytes())


def answer(url: str, vectors: list[str], echo: dict[str, Any]) -> Answer:
    return Answer(
        endpoint=url,
        model=MODEL,
        created=1,
        line_id="batch_req_1",
        request_id="req_1",
        response_id="score-1",
        prompt_tokens=12,
        cached_tokens=0,
        completions=[],
        echo=echo,
        embeddings=vectors,
    )


def test_the_score_body_is_vllms_with_cosine_similarities() -> None:
    vectors = [vec(1, 0), vec(1, 0), vec(0, 2), vec(3, 3)]
    body = score.Score().render(answer("/v1/score", vectors, {"queries": 1}))
    assert body["object"] == "list" and body["model"] == MODEL and body["id"] == "score-1"
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert {d["object"] for d in body["data"]} == {"score"}
    got = [d["score"] for d in body["data"]]
    assert got == pytest.approx([1.0, 0.0, math.sqrt(0.5)])
    assert body["usage"] == {
        "prompt_tokens": 12,
        "total_tokens": 12,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    pairwise = score.Score().render(answer("/v1/score", vectors, {"queries": 2}))
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([0.0, math.sqrt(0.5)])


def test_the_rerank_body_ranks_documents_and_honours_top_n() -> None:
    vectors = [vec(1, 0), vec(0, 1), vec(1, 0.1), vec(1, 1)]
    docs = ["far", "near", "between"]
    body = rerank.Rerank().render(answer("/v1/rerank", vectors, {"top_n": 0, "documents": docs}))
    assert set(body) == {"id", "model", "usage", "results"}
    assert [r["index"] for r in body["results"]] == [1, 2, 0]
    assert [r["document"]["text"] for r in body["results"]] == ["near", "between", "far"]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True) and scores[-1] == pytest.approx(0.0)
    assert body["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    top = rerank.Rerank().render(answer("/v1/rerank", vectors, {"top_n": 2}))
    assert [r["index"] for r in top["results"]] == [1, 2]
    assert all("document" not in r for r in top["results"])


def test_rendering_through_the_registry_gives_the_output_line() -> None:
    import orjson

    from offpeak.endpoints import records

    stored = records.dump(answer("/v1/score", [vec(1, 0), vec(1, 0)], {"queries": 1}))
    line = orjson.loads(endpoints.openai_line("c1", stored))
    assert line["response"]["status_code"] == 200
    assert line["response"]["body"]["data"][0]["score"] == pytest.approx(1.0)


@pytest.mark.parametrize("url", ["/v1/score", "/v1/rerank"])
def test_a_scoring_line_enqueues_its_prompt_and_no_output(url: str) -> None:
    from offpeak.enqueued import line_tokens

    assert line_tokens(url, {"model": MODEL}, line_bytes=400, max_model_len=256) == 100
