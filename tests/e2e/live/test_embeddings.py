"""Embeddings on the real all-MiniLM-L6-v2: the pooling engine steps lines of many inputs, and a
batch end to end through the SDK on the live stack, with vectors matching sentence-transformers'
(cosine >= 0.999)."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import orjson
import pytest
from openai import OpenAI
from openai.types import CreateEmbeddingResponse

from offpeak.endpoints import embeddings as emb
from offpeak.endpoints.base import PoolingSpec
from offpeak.settings import DEFAULT_EMBEDDING_MODEL, get_settings
from tests.support.batches import files_of, wait_for_end
from workers.engine.base import EngineRequest

pytestmark = pytest.mark.engine

URL: Literal["/v1/embeddings"] = "/v1/embeddings"


MODEL = DEFAULT_EMBEDDING_MODEL


TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A batch API runs requests when the GPU is idle.",
    "Embeddings map text to vectors; similar texts land close together.",
    "Paris is the capital of France.",
]


def body(**changes: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hello world", **changes}


@pytest.fixture(scope="module")
def reference() -> Any:
    """sentence-transformers on the same folder (mean pooling, then normalization)."""
    from sentence_transformers import SentenceTransformer

    from workers.model_store import find_minilm_folder

    return SentenceTransformer(str(find_minilm_folder()), device="cpu")


def cosines(a: Any, b: Any) -> np.ndarray:
    a, b = np.asarray(a, "float64"), np.asarray(b, "float64")
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    from workers.engine.vllm_pooling import VllmPoolingEngine
    from workers.model_store import ensure_model

    config = get_settings().models[MODEL]
    path = ensure_model(MODEL, config, get_settings().model_cache_dir)
    started = time.monotonic()
    # vLLM's engine core in this process rather than one of its own: a vLLM process start
    # fewer, and this module's few short inputs need no compute threads of their own.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        loaded = VllmPoolingEngine.load(MODEL, config, path)
    from vllm import envs

    envs.disable_envs_cache()  # the engine core froze this process's settings: thaw them
    print(f"embedding engine loaded in {time.monotonic() - started:.1f} s")
    yield loaded
    loaded.close()
    loaded.close()  # a second close is harmless


def run(engine: Any, requests: list[EngineRequest], abort: list[str] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    for r in requests:
        engine.add(r)
    engine.abort(list(abort))
    done = {}
    deadline = time.monotonic() + 300
    while engine.num_unfinished() and time.monotonic() < deadline:
        for result in engine.step():
            done[result.request_id] = result
    assert engine.num_unfinished() == 0
    return done


@pytest.mark.engine
def test_the_pooling_engine_steps_lines_of_many_inputs(engine: Any, reference: Any) -> None:
    """A line of more inputs than vLLM holds at once (``max_in_flight``) finishes whole, in
    order; an aborted line returns nothing and leaves nothing inside vLLM."""
    many = [f"sentence number {i} about {TEXTS[i % 4]}" for i in range(engine.max_in_flight + 40)]
    ids = lambda texts: tuple(tuple(engine.encode_text(t)) for t in texts)  # noqa: E731
    requests = [
        EngineRequest("one", [], emb.NO_SAMPLING, pooling=PoolingSpec(ids(TEXTS[:1]))),
        EngineRequest("many", [], emb.NO_SAMPLING, pooling=PoolingSpec(ids(many))),
        EngineRequest("gone", [], emb.NO_SAMPLING, pooling=PoolingSpec(ids(TEXTS))),
    ]
    done = run(engine, requests, abort=["gone"])
    assert set(done) == {"one", "many"}
    vectors = np.stack([np.frombuffer(v, "<f4") for v in done["many"].embeddings])
    assert engine.embedding_size == 384 and vectors.shape == (len(many), 384)
    assert done["many"].prompt_tokens == sum(len(i) for i in ids(many))
    assert cosines(vectors, reference.encode(many)).min() >= 0.999
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)  # normalized
    assert not engine._inside and not engine._engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="embedding model"):
        engine.add(EngineRequest("text", [101, 102], emb.NO_SAMPLING))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add(EngineRequest("oov", [], emb.NO_SAMPLING, pooling=PoolingSpec(((10**6,),))))


def embeddings_line(custom_id: str, given: Any, **params: Any) -> bytes:
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": URL,
        "body": body(input=given, **params),
    }
    return orjson.dumps(line)


@pytest.mark.engine
def test_an_embeddings_batch_end_to_end_through_the_sdk(
    live_sdk: OpenAI, live: Any, reference: Any
) -> None:
    lines = [
        embeddings_line("one", TEXTS[0]),
        embeddings_line("all", TEXTS),
        embeddings_line("b64", TEXTS[1:3], encoding_format="base64"),
        embeddings_line("ids", [[101, 7592, 2088, 102]]),
        embeddings_line("too-long", "word " * 300),
        embeddings_line("dims", TEXTS[0], dimensions=128),
        embeddings_line("empty", ["a", ""]),
    ]
    file = live_sdk.files.create(file=("e.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    batch = live_sdk.batches.create(input_file_id=file.id, endpoint=URL, completion_window="24h")
    batch = wait_for_end(live_sdk, batch.id, live)
    assert batch.status == "completed", batch.errors
    output, errors = files_of(live_sdk, batch)
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 3)
    failed = {e["custom_id"]: e["response"]["body"]["error"] for e in errors}
    assert failed["too-long"]["code"] == "context_length_exceeded"
    assert "256 tokens" in failed["too-long"]["message"]
    assert failed["dims"]["param"] == "dimensions"
    assert failed["empty"]["param"] == "input[1]"
    bodies = {o["custom_id"]: o["response"]["body"] for o in output}
    parsed = {k: CreateEmbeddingResponse.model_validate(v) for k, v in bodies.items() if k != "b64"}
    for response in parsed.values():
        assert response.model == MODEL and response.object == "list"
        assert response.usage.total_tokens == response.usage.prompt_tokens > 0
    got = np.array([d.embedding for d in parsed["all"].data])
    assert [d.index for d in parsed["all"].data] == [0, 1, 2, 3]
    assert cosines(got, reference.encode(TEXTS)).min() >= 0.999
    assert cosines([parsed["one"].data[0].embedding], got[:1])[0] >= 0.99999
    b64 = [
        np.frombuffer(base64.b64decode(d["embedding"]), "float32") for d in bodies["b64"]["data"]
    ]
    assert cosines(np.stack(b64), got[1:3]).min() >= 0.99999
    # "[CLS] hello world [SEP]" in the model's own ids is the string "hello world".
    assert cosines([parsed["ids"].data[0].embedding], reference.encode(["hello world"]))[0] >= 0.999
    usage = batch.usage
    assert usage is not None and usage.output_tokens == 0
    assert (
        usage.input_tokens
        == sum(r.usage.prompt_tokens for r in parsed.values())
        + bodies["b64"]["usage"]["prompt_tokens"]
    )
