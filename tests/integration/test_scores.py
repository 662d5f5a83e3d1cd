"""``/v1/score`` and ``/v1/rerank`` batches: created through the official ``openai`` SDK (its
``endpoint`` is a ``Literal`` type, not checked at run time), and run through validation, the
runner, write-back and finalize on real PostgreSQL with an engine standing in for the embedding
model (``tests/integration/test_embeddings.py``'s), billed as prompt tokens only."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from openai import OpenAI

from tests.integration.test_embeddings import STAND_IN, drain, finalize, stand_in_vector
from tests.support.batches import files_of

SCORE, RERANK = "/v1/score", "/v1/rerank"


@pytest.mark.parametrize(
    ("url", "body"),
    [
        (SCORE, {"text_1": "a", "text_2": ["b", "c"]}),
        (RERANK, {"query": "a", "documents": ["b", "c"]}),
    ],
)
def test_scoring_batches_are_created_through_the_sdk(
    sdk: OpenAI, url: str, body: dict[str, Any]
) -> None:
    line = {"custom_id": "a", "method": "POST", "url": url, "body": {"model": "m", **body}}
    file = sdk.files.create(file=("in.jsonl", orjson.dumps(line) + b"\n"), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id,
        endpoint=url,  # type: ignore[arg-type]  # the SDK's Literal lists OpenAI's endpoints
        completion_window="24h",
    )
    assert batch.endpoint == url and batch.status == "validating"


@pytest.fixture()
def stand_in_settings(settings: Any) -> Any:
    from offpeak.settings import ModelConfig

    config = ModelConfig(engine="instant", max_model_len=64)
    return settings.model_copy(update={"models": {STAND_IN: config}, "flush_seconds": 0.05})


def run_batch(settings: Any, url: str, lines: list[dict[str, Any]]) -> tuple[Any, OpenAI]:
    from tests.support.batches import tenant_client, validate

    data = b"\n".join(
        orjson.dumps(
            {"custom_id": cid, "method": "POST", "url": url, "body": {"model": STAND_IN, **b}}
        )
        for cid, b in lines
    )
    tenant, sdk = tenant_client(settings)
    batch, _ = validate(settings, data + b"\n", endpoint=url, tenant_name=tenant)
    assert batch.status == "in_progress", batch.errors
    drain(settings)
    finalize(settings, batch.id)
    return sdk.batches.retrieve(batch.id), sdk


def cos(a: str, b: str) -> float:
    va, vb = (stand_in_vector(list(t.encode())).astype("float64") for t in (a, b))
    return float(va @ vb / np.linalg.norm(va) / np.linalg.norm(vb))


def test_a_score_batch_runs_through_the_runner_and_finalize(stand_in_settings: Any) -> None:
    lines = [
        ("one-to-n", {"text_1": "q", "text_2": ["aa", "bbb"]}),
        ("pairwise", {"queries": ["q", "r"], "documents": ["aa", "bbb"]}),
        ("long", {"text_1": "q", "text_2": "x" * 65}),  # the stand-in's tokens are bytes
        ("lengths", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
    ]
    batch, sdk = run_batch(stand_in_settings, SCORE, lines)
    assert batch.status == "completed"
    output, errors = files_of(sdk, batch)
    failed = {e["custom_id"]: e["response"] for e in errors}
    assert set(failed) == {"long", "lengths"}
    assert {r["status_code"] for r in failed.values()} == {400}
    assert failed["long"]["body"]["error"]["param"] == "text_2"
    bodies = {o["custom_id"]: o["response"]["body"] for o in output}
    one = bodies["one-to-n"]
    assert one["object"] == "list" and one["id"].startswith("score-")
    assert [d["score"] for d in one["data"]] == pytest.approx([cos("q", "aa"), cos("q", "bbb")])
    pair = bodies["pairwise"]
    assert [d["score"] for d in pair["data"]] == pytest.approx([cos("q", "aa"), cos("r", "bbb")])
    # Every text embedded once is a prompt token; nothing is generated.
    assert one["usage"]["prompt_tokens"] == 1 + 2 + 3
    assert batch.usage is not None and batch.usage.output_tokens == 0
    assert batch.usage.input_tokens == (1 + 2 + 3) + (1 + 1 + 2 + 3)


def test_a_rerank_batch_runs_through_the_runner_and_finalize(stand_in_settings: Any) -> None:
    docs = ["aa", "bbb", "c", "dddd"]
    lines = [
        ("all", {"query": "q", "documents": docs}),
        ("top", {"query": "q", "documents": docs, "top_n": 2, "return_documents": False}),
        ("bad", {"query": "q", "documents": docs, "top_n": -1}),
    ]
    batch, sdk = run_batch(stand_in_settings, RERANK, lines)
    assert batch.status == "completed"
    output, errors = files_of(sdk, batch)
    assert [(e["custom_id"], e["response"]["body"]["error"]["param"]) for e in errors] == [
        ("bad", "top_n")
    ]
    bodies = {o["custom_id"]: o["response"]["body"] for o in output}
    expected = sorted(range(4), key=lambda i: cos("q", docs[i]), reverse=True)
    ranked = bodies["all"]["results"]
    assert [r["index"] for r in ranked] == expected
    assert [r["document"]["text"] for r in ranked] == [docs[i] for i in expected]
    assert [r["relevance_score"] for r in ranked] == pytest.approx(
        [cos("q", docs[i]) for i in expected]
    )
    top = bodies["top"]["results"]
    assert [r["index"] for r in top] == expected[:2] and "document" not in top[0]
    assert bodies["all"]["usage"] == {"prompt_tokens": 1 + 10, "total_tokens": 1 + 10}
