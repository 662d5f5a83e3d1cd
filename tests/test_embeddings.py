"""``/v1/embeddings`` lines: the body's shapes and its 400s, the output body parsed by the
``openai`` SDK's own types, batch create's 400 for every endpoint not served, and, on the real
all-MiniLM-L6-v2 in vLLM's pooling runner, the step-wise engine and a whole batch through the
SDK, with vectors matching ``sentence-transformers``' (cosine >= 0.999)."""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import orjson
import pytest
from openai import BadRequestError, OpenAI
from openai.types import CreateEmbeddingResponse

from offpeak import endpoints
from offpeak.endpoints import embeddings as emb
from offpeak.endpoints.base import PoolingSpec
from offpeak.endpoints.records import Answer
from offpeak.settings import DEFAULT_EMBEDDING_MODEL, get_settings
from tests.conftest import wait_for_end
from tests.helpers import files_of
from workers.engine.base import EngineRequest
from workers.engine.instant import InstantEngine
from workers.engine_io import LineError, prepare

URL: Literal["/v1/embeddings"] = "/v1/embeddings"
MODEL = DEFAULT_EMBEDDING_MODEL
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A batch API runs requests when the GPU is idle.",
    "Embeddings map text to vectors; similar texts land close together.",
    "Paris is the capital of France.",
]


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


# --- The body --------------------------------------------------------------------------------


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


# --- The output body ----------------------------------------------------------------------


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


# --- Batch create: endpoints not served --------------------------------------------------


@pytest.mark.parametrize(
    "endpoint",
    ["/v1/moderations", "/v1/images/generations", "/v1/images/edits", "/v1/videos", "/v2/x"],
)
def test_every_unserved_endpoint_is_a_400_invalid_value_naming_the_served(
    sdk: OpenAI, endpoint: str
) -> None:
    file = sdk.files.create(file=("in.jsonl", b'{"custom_id":"a"}\n'), purpose="batch")
    with pytest.raises(BadRequestError) as info:
        sdk.batches.create(
            input_file_id=file.id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window="24h",
        )
    error = info.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("invalid_value", "endpoint")
    for served in endpoints.BATCH_ENDPOINTS:
        assert served in error["message"]
    assert endpoint in error["message"]


def test_embeddings_batches_are_accepted(sdk: OpenAI) -> None:
    line = {"custom_id": "a", "method": "POST", "url": URL, "body": body()}
    file = sdk.files.create(file=("in.jsonl", orjson.dumps(line) + b"\n"), purpose="batch")
    batch = sdk.batches.create(input_file_id=file.id, endpoint=URL, completion_window="24h")
    assert batch.endpoint == URL and batch.status == "validating"


# --- The runner path, with an engine standing in for vLLM ----------------------------------

STAND_IN = "pooling-stand-in"


class PoolingStandIn(InstantEngine):
    """Answers every embeddings line at once with one deterministic unit vector per input
    (from its token ids), so the runner, write-back and finalize are tested without a model."""

    embedding_size = 384  # all-MiniLM-L6-v2's: results of the real size
    matryoshka_dimensions = None

    def add(self, request: EngineRequest) -> None:
        assert request.pooling is not None
        super().add(request)

    def step(self) -> list[Any]:
        from workers.engine.base import EngineResult

        results = []
        for rid, request in self._queued.items():
            assert request.pooling is not None
            inputs = request.pooling.inputs
            vectors = [stand_in_vector(ids).tobytes() for ids in inputs]
            tokens = sum(len(ids) for ids in inputs)
            results.append(EngineResult(rid, tokens, 0, [], embeddings=vectors))
        self._queued.clear()
        return results


def stand_in_vector(ids: tuple[int, ...] | list[int]) -> np.ndarray:
    raw = np.random.default_rng(list(ids)).standard_normal(PoolingStandIn.embedding_size)
    return (raw / np.linalg.norm(raw)).astype("<f4")


@pytest.fixture()
def stand_in_settings(settings: Any) -> Any:
    from offpeak.settings import ModelConfig

    config = ModelConfig(engine="instant", max_model_len=64)
    return settings.model_copy(update={"models": {STAND_IN: config}, "flush_seconds": 0.05})


def stand_in_batch(settings: Any, lines: list[bytes]) -> tuple[str, OpenAI]:
    from tests.helpers import tenant_client, validate

    tenant, sdk = tenant_client(settings)
    batch, _ = validate(settings, b"\n".join(lines) + b"\n", endpoint=URL, tenant_name=tenant)
    assert batch.status == "in_progress", batch.errors
    return batch.id, sdk


def drain(settings: Any) -> Any:
    from workers.runner import Runner

    return Runner(settings, PoolingStandIn(STAND_IN, 64), "w1", lambda _b: None).drain()


def finalize(settings: Any, batch_id: str) -> None:
    from storage.blobs import get_blob_store
    from workers.finalize import finalize

    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id).done


def stand_in_line(custom_id: str, given: Any, **params: Any) -> bytes:
    request = {"model": STAND_IN, "input": given, **params}
    return orjson.dumps({"custom_id": custom_id, "method": "POST", "url": URL, "body": request})


def test_an_embeddings_batch_runs_through_the_runner_and_finalize(stand_in_settings: Any) -> None:
    """Validation, claims, the runner, write-back and finalize on real PostgreSQL; the output
    lines parse as the SDK's ``CreateEmbeddingResponse`` with each input's vector in order."""
    lines = [
        stand_in_line("one", "hello"),
        stand_in_line("many", ["a", "bb", "ccc"]),
        stand_in_line("b64", [[1, 2, 3]], encoding_format="base64"),
        stand_in_line("long", "x" * 65),  # the stand-in's tokens are bytes; its limit is 64
        stand_in_line("empty", [""]),
    ]
    batch_id, sdk = stand_in_batch(stand_in_settings, lines)
    drain(stand_in_settings)
    finalize(stand_in_settings, batch_id)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "completed"
    output, errors = files_of(sdk, batch)
    assert sorted(e["custom_id"] for e in errors) == ["empty", "long"]
    bodies = {o["custom_id"]: o["response"]["body"] for o in output}
    many = CreateEmbeddingResponse.model_validate(bodies["many"])
    for d, text in zip(many.data, ["a", "bb", "ccc"], strict=True):
        assert np.array_equal(np.array(d.embedding, "<f4"), stand_in_vector(list(text.encode())))
    b64 = bodies["b64"]["data"][0]["embedding"]
    assert np.array_equal(np.frombuffer(base64.b64decode(b64), "<f4"), stand_in_vector([1, 2, 3]))
    assert many.usage.prompt_tokens == 6
    assert batch.usage is not None and batch.usage.output_tokens == 0
    assert batch.usage.input_tokens == 5 + 6 + 3


def test_the_runner_holds_no_more_for_ten_times_the_inputs(stand_in_settings: Any) -> None:
    """Streaming all the way: results go back every ``flush_seconds`` and claims are chunks,
    so the runner's peak of Python memory while draining 10,000 embeddings lines stays within
    4 MiB of 1,000 lines' (measured: 6.2 and 6.1 MiB; holding every 384-dimension result until
    the end would add ~2.7 KB per line, ~24 MB). Allocations are traced (``tracemalloc``); the
    model is a stand-in: the real engine's RSS is ``offpeak bench embeddings``'."""
    import tracemalloc

    peaks = []
    for n in (1_000, 10_000):
        lines = [stand_in_line(f"e{i}", f"text number {i}") for i in range(n)]
        batch_id, _sdk = stand_in_batch(stand_in_settings, lines)
        del lines
        tracemalloc.start()
        try:
            stats = drain(stand_in_settings)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert stats.requests == n
        finalize(stand_in_settings, batch_id)  # pages of 2,000 rows (iter_finished): bounded
    print(f"traced peak while draining: 1,000 lines {peaks[0] / 2**20:.1f} MiB, "
          f"10,000 lines {peaks[1] / 2**20:.1f} MiB")  # fmt: skip
    assert peaks[1] < peaks[0] + 4 * 2**20


def test_the_runner_holds_a_bounded_number_of_unstored_results_while_writes_lag(
    stand_in_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that answers faster than the database stores: with every write-back slowed
    by 50 ms, the finished lines held (the writes in flight's included) never pass
    ``MAX_PENDING_LINES`` plus one step's answers (``slots`` + the queue fed beside them) for
    each write in flight (``MAX_IN_FLIGHT``) and the lines waiting for the next. The bound
    once let lines pile up without limit behind a lagging write, so a 1,000-line drain held
    less than a 10,000-line one (CI, 2 December)."""
    from workers.runner import Runner, loop
    from workers.runner.write_back import MAX_IN_FLIGHT, ResultWriter
    from workers.scheduler.store import DbStore

    slow_write = DbStore.write_back

    def write_back(self: DbStore, write: Any) -> Any:
        time.sleep(0.05)
        return slow_write(self, write)

    held = [0]
    add = ResultWriter.add

    def counting_add(self: ResultWriter, line: Any) -> None:
        add(self, line)
        held[0] = max(held[0], len(self.pending))

    monkeypatch.setattr(DbStore, "write_back", write_back)
    monkeypatch.setattr(ResultWriter, "add", counting_add)
    batch_id, _sdk = stand_in_batch(
        stand_in_settings, [stand_in_line(f"e{i}", f"text {i}") for i in range(5_000)]
    )
    runner = Runner(stand_in_settings, PoolingStandIn(STAND_IN, 64), "w1", lambda _b: None)
    assert runner.drain().requests == 5_000
    one_step = runner.slots + max(8, runner.slots // 4)  # Runner._top_up's feed
    bound = (MAX_IN_FLIGHT + 1) * (loop.MAX_PENDING_LINES + one_step)
    assert 0 < held[0] <= bound, (held[0], one_step)
    finalize(stand_in_settings, batch_id)


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


# --- On the real model ------------------------------------------------------------------------


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
    loaded = VllmPoolingEngine.load(MODEL, config, path)
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
