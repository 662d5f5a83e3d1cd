"""``/v1/score`` and ``/v1/rerank`` batches on the real all-MiniLM-L6-v2 through the official SDK
on the live stack: a related pair scores higher than an unrelated one, a score is the cosine
similarity of the two texts' ``/v1/embeddings`` vectors, and rerank orders the documents by
those scores and honours ``top_n``."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from openai import OpenAI

from offpeak.settings import DEFAULT_EMBEDDING_MODEL
from tests.support.batches import files_of, wait_for_end

pytestmark = pytest.mark.engine

MODEL = DEFAULT_EMBEDDING_MODEL
QUERY = "How do I bake bread at home?"
DOCUMENTS = [
    "The stock market fell sharply on Tuesday.",
    "Mix flour, water, yeast and salt, let the dough rise, then bake it in a hot oven.",
    "A recipe for homemade sourdough loaves.",
    "Penguins live in the southern hemisphere.",
]


def start(sdk: OpenAI, url: str, bodies: dict[str, dict[str, Any]]) -> str:
    lines = [
        orjson.dumps(
            {"custom_id": cid, "method": "POST", "url": url, "body": {"model": MODEL, **b}}
        )
        for cid, b in bodies.items()
    ]
    file = sdk.files.create(file=("s.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id,
        endpoint=url,  # type: ignore[arg-type]  # the SDK's Literal lists OpenAI's endpoints
        completion_window="24h",
    )
    return batch.id


def finished(sdk: OpenAI, batch_id: str, live: Any) -> dict[str, dict[str, Any]]:
    batch = wait_for_end(sdk, batch_id, live)
    assert batch.status == "completed", batch.errors
    output, errors = files_of(sdk, batch)
    assert not errors, errors
    return {o["custom_id"]: o["response"]["body"] for o in output}


@pytest.mark.engine
def test_scores_and_reranks_are_cosines_of_the_embeddings(live_sdk: OpenAI, live: Any) -> None:
    texts = [QUERY, *DOCUMENTS]
    embeddings_id = start(live_sdk, "/v1/embeddings", {"all": {"input": texts}})
    score_id = start(
        live_sdk,
        "/v1/score",
        {
            "one-to-n": {"text_1": QUERY, "text_2": DOCUMENTS},
            "pairwise": {"queries": [QUERY, DOCUMENTS[0]], "documents": DOCUMENTS[2:4]},
        },
    )
    rerank_id = start(
        live_sdk,
        "/v1/rerank",
        {
            "all": {"query": QUERY, "documents": DOCUMENTS},
            "top": {"query": QUERY, "documents": DOCUMENTS, "top_n": 2},
        },
    )
    vectors = np.array(
        [d["embedding"] for d in finished(live_sdk, embeddings_id, live)["all"]["data"]],
        "float64",
    )
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    cosine = unit[1:] @ unit[0]  # each document against the query

    scores = finished(live_sdk, score_id, live)
    one = scores["one-to-n"]
    assert one["object"] == "list" and one["model"] == MODEL
    got = np.array([d["score"] for d in one["data"]])
    assert [d["index"] for d in one["data"]] == [0, 1, 2, 3]
    assert np.abs(got - cosine).max() <= 1e-4
    # Related pairs (baking bread) score higher than unrelated ones (stocks, penguins).
    assert min(got[1], got[2]) > max(got[0], got[3])
    pairwise = [d["score"] for d in scores["pairwise"]["data"]]
    assert pairwise == pytest.approx([unit[0] @ unit[3], unit[1] @ unit[4]], abs=1e-4)
    assert one["usage"]["prompt_tokens"] > 0 and one["usage"]["completion_tokens"] == 0

    ranked = finished(live_sdk, rerank_id, live)
    expected = [int(i) for i in np.argsort(-cosine, kind="stable")]
    results = ranked["all"]["results"]
    assert [r["index"] for r in results] == expected
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[i] for i in expected]
    relevance = np.array([r["relevance_score"] for r in results])
    assert np.abs(relevance - cosine[expected]).max() <= 1e-4
    assert [r["index"] for r in ranked["top"]["results"]] == expected[:2]
    # The query and each document, each embedded once: the embeddings line's own tokens.
    assert ranked["all"]["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
