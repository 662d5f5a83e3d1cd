"""What tool-call and adapter lines cost: ``offpeak bench line-kinds``. Each ratio is against a
baseline measured in the same run, on the same prompts and ``max_tokens`` (temperature 0).

Two engines of the served default model, one after the other, each in a process of its own
(``bench.line_kinds_engine``), taking each leg's lines as one claimed chunk through the engine
worker's path (``prepare_chunk`` → the engine adapter → the answered records), without the
database and queue: those cost the same for every kind of line (``bench control``).

- **base engine** (the model as served, no LoRA): ``chat`` (plain chat lines), then
  ``tool_call`` (the same messages with one function tool and a named ``tool_choice``, so the
  answer is decoded to the tool's JSON schema).
- **LoRA engine** (the same model with ``ADAPTERS`` random rank-8 adapters configured, the
  default adapter slots): ``base_on_lora`` (the base model's lines; on a CPU they run through
  the zero adapter, ``workers.engine.lora``), ``one_adapter`` (every line on one adapter),
  ``mixed`` (the same lines spread over the ``ADAPTERS`` adapters, grouped by the runner) and
  ``mixed_ungrouped`` (the same, added in file order: what the grouping saves).

Ratios: output tokens/s of ``tool_call`` over ``chat`` and of ``one_adapter`` over ``chat`` (and
over ``base_on_lora``), and the leg time of ``mixed`` over ``one_adapter`` (goal:
``MIXED_GOAL`` at most).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Literal

from bench import harness
from bench.lora_adapters import write_adapter
from offpeak.settings import DEFAULT_MODEL, Settings

#: Adapters the mixed batch spreads its lines over.
ADAPTERS = 8
#: Rank of the generated adapters.
RANK = 8
#: The engines' KV cache: room for every line of a 64-line leg at once.
KV_CACHE_BYTES = 2**29
#: The mixed batch's time over the one-adapter batch's, at most.
MIXED_GOAL = 1.5

#: The function the tool-call lines must call: free text, so its arguments run as long as a
#: plain answer does. Its name is in no prompt (a template that ignores tools is detected by
#: the names missing from what it rendered: ``workers.engine.chat_template``).
TOOL = {
    "type": "function",
    "function": {
        "name": "record_note",
        "description": "Record a description of the topic.",
        "parameters": {
            "type": "object",
            "properties": {"topic": {"type": "string"}, "description": {"type": "string"}},
            "required": ["topic", "description"],
        },
    },
}
TOPICS = (
    "the ocean",
    "a mountain village",
    "the history of bread",
    "how bicycles work",
    "autumn in a forest",
    "the moon",
    "a busy train station",
    "why cats purr",
)

Engine = Literal["vllm", "instant"]


def chat_lines(
    n: int, max_tokens: int, models: list[str], *, tools: bool = False
) -> list[dict[str, Any]]:
    """``n`` chat request lines, line ``i`` on ``models[i % len(models)]`` with topic
    ``TOPICS[i % 8]`` and a number (prompts are alike in length but not one prefix); ``tools``:
    with ``TOOL`` and a named ``tool_choice`` for it."""
    lines = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body: dict[str, Any] = {
            "model": models[i % len(models)],
            "messages": [{"role": "user", "content": f"Note {i}: describe {topic} in detail."}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if tools:
            body["tools"] = [TOOL]
            body["tool_choice"] = {"type": "function", "function": {"name": "record_note"}}
        lines.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return lines


def specs(
    n: int, max_tokens: int, model: str, adapters: dict[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The two engines' legs (``bench.line_kinds_engine``'s spec, minus the model's settings)."""
    names = list(adapters)
    base = {
        "legs": [
            {"name": "chat", "lines": chat_lines(n, max_tokens, [model])},
            {"name": "tool_call", "lines": chat_lines(n, max_tokens, [model], tools=True)},
        ]
    }
    lora = {
        "adapters": adapters,
        "legs": [
            {"name": "base_on_lora", "lines": chat_lines(n, max_tokens, [model])},
            {"name": "one_adapter", "lines": chat_lines(n, max_tokens, names[:1])},
            {"name": "mixed", "lines": chat_lines(n, max_tokens, names)},
            {
                "name": "mixed_ungrouped",
                "lines": chat_lines(n, max_tokens, names),
                "grouped": False,
            },
        ],
    }
    return base, lora


def ratios(legs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Tokens/s and per-line time of each kind over its baseline (``docs/benchmarks.md``)."""

    def tps(name: str) -> float:
        return legs[name]["completion_tokens"] / legs[name]["seconds"]

    def per_line(name: str) -> float:
        return legs[name]["seconds"] / legs[name]["lines"]

    return {
        "tool_call_tokens_per_s": tps("tool_call") / tps("chat"),
        "tool_call_line_time": per_line("tool_call") / per_line("chat"),
        "adapter_tokens_per_s": tps("one_adapter") / tps("chat"),
        "adapter_line_time": per_line("one_adapter") / per_line("chat"),
        "adapter_tokens_per_s_vs_base_on_lora": tps("one_adapter") / tps("base_on_lora"),
        "lora_engine_base_tokens_per_s": tps("base_on_lora") / tps("chat"),
        "mixed_time": legs["mixed"]["seconds"] / legs["one_adapter"]["seconds"],
        "mixed_ungrouped_time": legs["mixed_ungrouped"]["seconds"] / legs["one_adapter"]["seconds"],
    }


def run(
    requests: int = 64, max_tokens: int = 32, engine: Engine = "vllm", out_dir: Path | None = None
) -> dict[str, Any]:
    """Measure every leg with ``requests`` lines of ``max_tokens``; print the table and write
    ``line-kinds.json``. ``engine`` ``instant``: the instant engine in this process (the legs
    and ratios without a model, for tests). Raises ``RuntimeError`` when a line or leg fails."""
    settings = Settings()
    name = DEFAULT_MODEL
    config = settings.models[name]
    # A small KV cache (the machine is shared): every leg's lines fit in it at once.
    engine_args = config.engine_args | {"kv_cache_memory_bytes": KV_CACHE_BYTES}
    config = config.model_copy(update={"engine_args": engine_args})
    machine = harness.machine()
    loads: list[list[float]] = [harness.load_average()]
    with tempfile.TemporaryDirectory(prefix="offpeak-line-kinds-") as tmp:
        folder = Path(tmp)
        if engine == "instant":
            from bench.line_kinds_engine import run_legs
            from workers.engine.instant import InstantEngine

            adapters = {f"adapter-{i}": str(folder / f"adapter-{i}") for i in range(ADAPTERS)}
            base, lora = specs(requests, max_tokens, name, adapters)
            legs = run_legs(InstantEngine(name), base) | run_legs(InstantEngine(name), lora)
            load_s = {"base": 0.0, "lora": 0.0}
        else:
            from workers.model_store import ensure_model

            model_dir = ensure_model(name, config, settings.model_cache_dir)
            adapters = {
                f"adapter-{i}": str(
                    write_adapter(folder / f"adapter-{i}", model_dir, "random", rank=RANK, seed=i)
                )
                for i in range(ADAPTERS)
            }
            base, lora = specs(requests, max_tokens, name, adapters)
            lora_config = config.model_copy(
                update={"lora_modules": adapters, "max_lora_rank": RANK}
            )
            legs, load_s = {}, {}
            for label, spec, cfg in (("base", base, config), ("lora", lora, lora_config)):
                spec |= {"model": name, "model_dir": str(model_dir), "config": cfg.model_dump()}
                measured = _engine_process(spec, folder / label)
                legs |= measured["legs"]
                load_s[label] = measured["load_s"]
                loads.append(harness.load_average())
    result: dict[str, Any] = {
        "engine": engine,
        "path": "prepare_chunk + engine adapter (no database, no queue)",
        "model": name,
        "requests": requests,
        "max_tokens": max_tokens,
        "adapters": ADAPTERS,
        "adapter_rank": RANK,
        "adapter_slots": config.model_copy(update={"lora_modules": {"a": "a"}}).lora_slots,
        "machine": machine,
        "load_average_during": loads,
        "engine_load_s": load_s,
        "legs": legs,
        "ratios": ratios(legs),
        "mixed_goal": MIXED_GOAL,
    }
    result["met"] = {"mixed_within_goal": result["ratios"]["mixed_time"] <= MIXED_GOAL}
    _print(result)
    harness.write_result("line-kinds", result, out_dir)
    return result


def _engine_process(spec: dict[str, Any], folder: Path) -> dict[str, Any]:
    folder.mkdir()
    (folder / "spec.json").write_text(json.dumps(spec))
    out = folder / "out.json"
    command = [sys.executable, "-m", "bench.line_kinds_engine"]
    command += ["--spec", str(folder / "spec.json"), "--output", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"engine leg failed ({done.returncode}): {done.stderr[-4000:]}")
    return json.loads(out.read_text())


def _print(result: dict[str, Any]) -> None:
    rows = []
    for leg, m in result["legs"].items():
        rows.append(
            [
                leg,
                m["lines"],
                m["prompt_tokens"] / m["lines"],
                m["completion_tokens"] / m["lines"],
                m["seconds"],
                m["completion_tokens"] / m["seconds"],
                m["seconds"] / m["lines"],
                m["tool_calls_parsed"],
            ]
        )
    columns = ["leg", "lines", "prompt tok/line", "output tok/line", "s", "output tok/s"]
    columns += ["s/line", "calls parsed"]
    harness.print_table(f"Line kinds on {result['model']} ({result['engine']})", columns, rows)
    harness.print_table(
        "Ratios (each over its baseline, same run)",
        ["ratio", "value"],
        [[k, v] for k, v in result["ratios"].items()],
    )
