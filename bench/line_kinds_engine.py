"""The legs of ``offpeak bench line-kinds`` on one engine: each leg's request lines taken through
the engine worker's own path (``prepare_chunk``: the endpoint's preparation, the adapter lookup
and the grouping by adapter; then the engine adapter's ``add`` and ``step``; then the answered
records), timed from the first ``add`` to the last result.

``python -m bench.line_kinds_engine --spec SPEC.json --output OUT.json`` loads the real model
(``VllmEngine.load``, the served model's settings with the spec's ``lora_modules``) in a process
of its own, so each engine is gone before the next starts, and runs the spec's legs in order.
``run_legs`` runs them on an engine already made (the instant engine in tests).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from offpeak.endpoints import openai_line
from storage.repositories.requests import ClaimedRequest
from workers.engine.base import Engine, LoraSpec
from workers.engine_io import LineError
from workers.runner import results
from workers.runner.admission import prepare_chunk

#: Unix seconds stamped on every answer, so runs are alike.
AT = 1_796_000_000.0


def adapter_lookup(adapters: dict[str, str]) -> Callable[[str], LoraSpec]:
    """The runner's ``adapters`` callable over ``{name: folder}``; an unknown name is a 404."""

    def lookup(name: str) -> LoraSpec:
        if name not in adapters:
            raise LineError(
                f"The model '{name}' does not exist.", "model", "model_not_found", status_code=404
            )
        return LoraSpec(name, adapters[name])

    return lookup


def run_leg(
    engine: Engine,
    lines: list[dict[str, Any]],
    adapters: dict[str, str],
    *,
    grouped: bool = True,
) -> dict[str, Any]:
    """Run ``lines`` (request lines as dicts) as one claimed chunk; ``grouped`` ``False`` adds
    them in file order instead of the runner's (the control that shows what grouping buys).
    Returns the leg's seconds, lines answered and failed, prompt and completion tokens, mean
    seconds from the first ``add`` to each line's answer, finish reasons, the tool calls whose
    arguments parse as JSON, and ``adapter_runs``: runs of lines on one adapter in the order
    they joined the engine (a chunk grouped by adapter has one per adapter). Raises
    ``RuntimeError`` when a line fails."""
    rows = [
        ClaimedRequest(n, "batch_line_kinds", line["custom_id"], orjson.dumps(line).decode(), 1)
        for n, line in enumerate(lines, start=1)
    ]
    chunk = prepare_chunk(
        rows,
        engine,
        held=set(),
        urgent=set(),
        max_attempts=3,
        at=AT,
        adapters=adapter_lookup(adapters),
    )
    if chunk.failed:
        raise RuntimeError(f"{len(chunk.failed)} lines failed: {chunk.failed[0].result}")
    ready = chunk.ready if grouped else sorted(chunk.ready, key=lambda h: h.row.id)
    held = {line.request_id: line for line in ready}
    models = [lora.name if (lora := h.prepared.request.lora) else None for h in ready]
    finished_after: list[float] = []
    answered = []
    started = time.perf_counter()
    for line in ready:
        engine.add(line.prepared.request)
    while engine.num_unfinished():
        for result in engine.step():
            finished_after.append(time.perf_counter() - started)
            done = held[result.request_id]
            answered.append(results.answered(done.row, done.prepared, result, int(AT), AT))
    seconds = time.perf_counter() - started
    stored = [results.stored(line) for line in answered]
    failed = [line for line in stored if line.status != "succeeded"]
    if failed:
        raise RuntimeError(f"{len(failed)} lines failed: {failed[0].result}")
    reasons: dict[str, int] = {}
    calls = 0
    for record in stored:
        # The line as the output file has it (the stored record rendered).
        body = orjson.loads(openai_line("r", record.result or ""))["response"]["body"]
        choice = body["choices"][0]
        reasons[choice["finish_reason"]] = reasons.get(choice["finish_reason"], 0) + 1
        calls += sum(_parses(call) for call in choice["message"].get("tool_calls") or ())
    return {
        "lines": len(stored),
        "seconds": seconds,
        "prompt_tokens": sum(line.tokens.prompt for line in stored),
        "completion_tokens": sum(line.tokens.completion for line in stored),
        "mean_line_seconds": sum(finished_after) / max(len(finished_after), 1),
        "finish_reasons": reasons,
        "tool_calls_parsed": calls,
        "adapter_runs": sum(1 for i, m in enumerate(models) if i == 0 or m != models[i - 1]),
    }


def _parses(call: dict[str, Any]) -> bool:
    try:
        return isinstance(json.loads(call["function"]["arguments"]), dict)
    except ValueError:
        return False


def run_legs(engine: Engine, spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each of ``spec["legs"]`` (``{"name", "lines", "grouped"}``) on ``engine``, in order, after
    the first leg's lines once untimed; each leg after a warm-up of its own: its first line once
    per model it names (so grammar compilation and an
    adapter's first load are not timed; swapping adapters in and out of the engine's slots is).
    ``spec["adapters"]``: ``{name: folder}``."""
    adapters: dict[str, str] = spec.get("adapters") or {}
    measured: dict[str, dict[str, Any]] = {}
    # The first batch of a fresh engine runs slower than the next ones of its size.
    first = spec["legs"][0]["lines"]
    run_leg(
        engine, [{**line, "custom_id": f"warm-{line['custom_id']}"} for line in first], adapters
    )
    for leg in spec["legs"]:
        lines: list[dict[str, Any]] = leg["lines"]
        firsts: dict[str, dict[str, Any]] = {}
        for line in lines:
            firsts.setdefault(line["body"]["model"], line)
        warm = [{**line, "custom_id": f"warm-{n}"} for n, line in enumerate(firsts.values())]
        run_leg(engine, warm, adapters)
        measured[leg["name"]] = run_leg(engine, lines, adapters, grouped=leg.get("grouped", True))
    return measured


def main() -> None:
    from offpeak.process_tree import die_with_parent, spawned_children_die_with_this_process
    from offpeak.settings import ModelConfig
    from workers.engine.vllm_engine import VllmEngine

    # Its engine-core, and this process, end with the benchmark that started it.
    die_with_parent()
    spawned_children_die_with_this_process()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    config = ModelConfig.model_validate(spec["config"])
    started = time.perf_counter()
    engine = VllmEngine.load(spec["model"], config, Path(spec["model_dir"]))
    load_s = time.perf_counter() - started
    try:
        legs = run_legs(engine, spec)
    finally:
        engine.close()
    args.output.write_text(json.dumps({"load_s": load_s, "legs": legs}))


if __name__ == "__main__":
    main()
