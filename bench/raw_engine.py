"""Leg (a) of ``bench e2e``: the raw engine, in a process of its own.

``python -m bench.raw_engine --input IN --model-dir DIR --engine-json '{…}' --output OUT.json``
loads ``vllm.LLM`` with the given engine arguments, warms it up with one short request, then times
one ``LLM.chat`` over every request of the file (generation only: the model is already loaded)
and writes the timing, each request's completion, prompt token ids and prompt-cache hits
(``num_cached_tokens``)
and the KV cache the engine allocated (block size, blocks) as JSON. A process of its own so its
engine is gone before the next leg starts, and under a main guard because vLLM spawns its engine
core.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import orjson


def run(input_path: Path, model_dir: Path, engine: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    lines = [orjson.loads(raw) for raw in input_path.read_bytes().splitlines() if raw.strip()]
    started = time.perf_counter()
    llm = LLM(model=str(model_dir), tokenizer=str(model_dir), **engine)
    load_s = time.perf_counter() - started
    hello: list[Any] = [[{"role": "user", "content": "Hello"}]]
    llm.chat(hello, SamplingParams(max_tokens=4), use_tqdm=False)
    params = [
        SamplingParams(
            temperature=line["body"].get("temperature", 1.0),
            max_tokens=line["body"]["max_tokens"],
        )
        for line in lines
    ]
    started = time.perf_counter()
    conversations: list[Any] = [line["body"]["messages"] for line in lines]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    completions = {
        line["custom_id"]: {
            "text": out.outputs[0].text,
            "prompt_tokens": len(out.prompt_token_ids or []),
            "completion_tokens": len(out.outputs[0].token_ids),
            "cached_tokens": int(out.num_cached_tokens or 0),
            "prompt_token_ids": list(out.prompt_token_ids or []),
        }
        for line, out in zip(lines, outputs, strict=True)
    }
    config = llm.llm_engine.vllm_config
    kv_cache = {
        "block_size": config.cache_config.block_size,
        "num_blocks": config.cache_config.num_gpu_blocks,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
    }
    llm.llm_engine.engine_core.shutdown()
    return {"load_s": load_s, "seconds": seconds, "completions": completions, "engine": kv_cache}


def main() -> None:
    from offpeak.process_tree import die_with_parent, spawned_children_die_with_this_process

    # Its engine-core, and this process, end with the benchmark that started it.
    die_with_parent()
    spawned_children_die_with_this_process()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--engine-json", required=True, help="keyword arguments for vllm.LLM")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    result = run(args.input, args.model_dir, json.loads(args.engine_json))
    args.output.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
