"""``/v1/embeddings`` lines: the body's shapes and its 400s, the output body parsed by the
``openai`` SDK's own types, batch create's 400 for every endpoint not served, and, on the real
all-MiniLM-L6-v2 in vLLM's pooling runner, the step-wise engine and a whole batch through the
SDK, with vectors matching ``sentence-transformers``' (cosine >= 0.999)."""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import numpy as np
import orjson
import pytest
from openai import BadRequestError, OpenAI
from openai.types import CreateEmbeddingResponse

from offpeak import endpoints
from offpeak.settings import DEFAULT_EMBEDDING_MODEL
from tests.support.batches import files_of
from workers.engine.base import EngineRequest
from workers.engine.instant import InstantEngine

URL: Literal["/v1/embeddings"] = "/v1/embeddings"
MODEL = DEFAULT_EMBEDDING_MODEL


def body(**changes: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hello world", **changes}


# --- The body --------------------------------------------------------------------------------


# --- The output body ----------------------------------------------------------------------


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
    from tests.support.batches import tenant_client, validate

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
    8 MiB of 1,000 lines' (holding every 384-dimension result until the end would add ~2.7 KB
    per line, ~24 MB). The margin is what the runner may hold whatever the batch's size, when
    write-backs lag on a loaded host: ``MAX_PENDING_LINES`` finished lines and the writes in
    flight, a few MB. Allocations are traced (``tracemalloc``); the model is a stand-in: the
    real engine's RSS is ``offpeak bench embeddings``'."""
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
    assert peaks[1] < peaks[0] + 8 * 2**20


def test_the_runner_holds_a_bounded_number_of_unstored_results_while_writes_lag(
    stand_in_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that answers faster than the database stores: with every write-back slowed
    by 50 ms, the finished lines held (the writes in flight's included) never pass
    ``MAX_PENDING_LINES`` plus one step's answers (``slots`` + the queue fed beside them) for
    each write in flight (``MAX_IN_FLIGHT``) and the lines waiting for the next: without the
    bound, lines pile up behind a lagging write, more the longer the drain."""
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


# --- On the real model ------------------------------------------------------------------------
