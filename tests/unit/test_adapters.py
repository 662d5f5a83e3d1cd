"""LoRA adapters without an engine: how a model's adapter settings become vLLM's arguments and
how a claimed chunk is grouped by adapter (an adapter that does not load:
``tests/integration/test_engine_loras.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from offpeak.model_config import DEFAULT_MAX_LORAS, ModelConfig
from storage.repositories.requests import ClaimedRequest
from workers.engine.base import LoraSpec
from workers.engine.instant import InstantEngine
from workers.engine.vllm_shared import engine_kwargs
from workers.engine_io import LineError
from workers.runner.admission import prepare_chunk

FOLDER = Path("/models/m")
MODEL = "base"


def test_lora_is_off_unless_the_model_has_adapters_or_slots() -> None:
    assert "enable_lora" not in engine_kwargs("m", ModelConfig(), FOLDER, on_cpu=False)
    configured = ModelConfig(lora_modules={"a": "/a"})
    assert configured.lora_slots == DEFAULT_MAX_LORAS
    gpu = engine_kwargs("m", configured, FOLDER, on_cpu=False)
    assert (gpu["enable_lora"], gpu["max_loras"], gpu["max_lora_rank"]) == (True, 4, 16)
    # Slots for adapters registered later, without any configured.
    later = ModelConfig(max_loras=2, max_lora_rank=64)
    cpu = engine_kwargs("m", later, FOLDER, on_cpu=True)
    # One more on a CPU: the base model's lines run with a zero adapter there.
    assert (cpu["enable_lora"], cpu["max_loras"], cpu["max_lora_rank"]) == (True, 3, 64)
    off = ModelConfig(lora_modules={"a": "/a"}, max_loras=0)
    assert "enable_lora" not in engine_kwargs("m", off, FOLDER, on_cpu=False)


def row(i: int, model: str, content: str = "Hi") -> ClaimedRequest:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    line = {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    return ClaimedRequest(i, "batch_1", f"c{i}", orjson.dumps(line).decode(), 1)


def resolve(name: str) -> LoraSpec:
    if name == "gone":
        raise LineError("The model 'gone' does not exist.", "model", "model_not_found", 404)
    return LoraSpec(name, f"/adapters/{name}")


def test_a_chunk_is_grouped_by_adapter_base_model_first() -> None:
    models = ["b", MODEL, "a", "b", "gone", MODEL, "a", "b"]
    rows = [row(i, model) for i, model in enumerate(models)]
    engine = InstantEngine(MODEL)
    chunk = prepare_chunk(
        rows, engine, held=(), urgent=(), max_attempts=3, at=0.0, adapters=resolve
    )
    order = [
        (h.row.id, h.prepared.request.lora.name if h.prepared.request.lora else None)
        for h in chunk.ready
    ]
    # The base model's lines, then each adapter's in the order it first appears; within a
    # group the claim's (prefix) order is kept.
    assert order == [(1, None), (5, None), (0, "b"), (3, "b"), (7, "b"), (2, "a"), (6, "a")]
    assert [h.prepared.model for h in chunk.ready] == [MODEL, MODEL, "b", "b", "b", "a", "a"]
    (gone,) = chunk.failed
    assert gone.id == 4 and gone.status_code == 404


def test_urgent_lines_still_go_first_across_adapters() -> None:
    rows = [row(0, "a"), row(1, MODEL), row(2, "a")]
    rows[2] = ClaimedRequest(2, "urgent", "c2", rows[2].line_json, 1)
    engine = InstantEngine(MODEL)
    chunk = prepare_chunk(
        rows, engine, held=(), urgent={"urgent"}, max_attempts=3, at=0.0, adapters=resolve
    )
    assert [h.row.id for h in chunk.ready] == [2, 1, 0]


def test_an_adapter_name_names_one_thing() -> None:
    from offpeak.settings import Settings

    with pytest.raises(ValueError, match="also a served model"):
        Settings(models={"m": ModelConfig(lora_modules={"m": "/a"})})
    with pytest.raises(ValueError, match="also an adapter of m"):
        Settings(
            models={
                "m": ModelConfig(lora_modules={"a": "/a"}),
                "n": ModelConfig(lora_modules={"a": "/b"}),
            }
        )


def book_settings(tmp_path: Path) -> Any:
    from offpeak.settings import Settings

    return Settings(
        data_dir=tmp_path,
        blob_url=str(tmp_path / "blobs"),
        model_cache_dir=tmp_path / "cache",
        models={
            MODEL: ModelConfig(
                engine="instant", lora_modules={"local": "/adapters/local", "stored": "blob:ad/s"}
            ),
            "other": ModelConfig(engine="instant", lora_modules={"theirs": "/adapters/theirs"}),
        },
    )


def test_the_book_resolves_this_models_adapters_and_fetches_stored_ones(tmp_path: Path) -> None:
    from storage.blobs import get_blob_store
    from workers.adapters import AdapterBook

    settings = book_settings(tmp_path)
    book = AdapterBook(settings, MODEL, None)
    assert book.resolve("local") == LoraSpec("local", "/adapters/local")
    with pytest.raises(LineError) as other:
        book.resolve("theirs")
    assert (other.value.status_code, other.value.code) == (404, "model_not_found")
    with pytest.raises(LineError) as missing:
        book.resolve("stored")
    assert (missing.value.status_code, missing.value.code) == (500, "adapter_load_failed")

    blobs = get_blob_store(settings.resolved_blob_url)
    for name, data in (("adapter_config.json", b"{}"), ("adapter_model.safetensors", b"w")):
        with blobs.writer(f"ad/s/{name}") as out:
            out.write(data)
    stored = book.resolve("stored")
    folder = Path(stored.path)
    assert stored.name == "stored" and folder.is_relative_to(tmp_path / "cache")
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert book.resolve("stored") == stored  # fetched once


def test_a_database_away_leaves_the_last_list_and_faults_only_an_unknown_name(
    tmp_path: Path,
) -> None:
    from workers.adapters import AdapterBook
    from workers.engine.base import EngineFault

    away = f"sqlite:///{tmp_path}/no/such/folder/offpeak.db"
    book = AdapterBook(book_settings(tmp_path), MODEL, away)
    assert book.resolve("local").name == "local"
    with pytest.raises(EngineFault) as fault:
        book.resolve("registered-later")
    assert fault.value.blameless
