"""A GPU projection ON PAPER, not a measurement: Llama 3.1 8B in bf16 on one H200, from the
planner's cost models (``workers.planner``), for an offline workload of fixed prompt and answer
lengths. Every assumption is a named parameter and is printed with the result.

- Memory: the KV-cache budget is the device's usable memory minus the weights
  (``planner.plan_memory``); the chunk's ``max_num_seqs`` comes from ``choose_engine_limits``
  (paged KV, every sequence may run to its ``max_tokens``, capped at 1,024).
- Decode is memory-bandwidth bound: one step reads every weight once and each running sequence's
  KV cache once, so ``step ≈ weights bytes / bandwidth + batch × context × KV bytes per token /
  bandwidth`` (a ``planner.StepModel``: base + per sequence), at an achieved fraction of the
  peak bandwidth; it is compute bound instead when ``2 × parameters × batch`` FLOPs take longer.
- Prefill is compute bound: ``2 × parameters × prompt tokens`` FLOPs per request at an achieved
  fraction of the peak bf16 FLOP rate, added to decode time (chunked prefill overlaps some of it,
  so this errs on the slow side).
- Offpeak's own cost: the engine's tokens/s times the runner's measured efficiency at GPU-like
  step rates, ``ratio`` of ``bench/results/overhead.json`` (``offpeak bench overhead``: the
  real runner on a fake engine that sleeps a 10 ms + 0.1 ms × running step, against the fake
  alone), not an assumption. Without that file, 1.0 and the output says so.
- Dollars: the GPU's price per hour over the tokens it produces in that hour.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import harness
from offpeak.billing import format_usd
from workers import planner

#: Llama 3.1 8B's ``config.json`` fields the planner reads (meta-llama/Llama-3.1-8B-Instruct).
LLAMA_31_8B: dict[str, Any] = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 131_072,
}
LLAMA_31_8B_PARAMETERS = 8.03e9


@dataclass(frozen=True)
class Assumptions:
    gpu: str = "H200 (141 GB HBM3e, 4.8 TB/s)"
    memory_bytes: float = 141e9
    bandwidth_bytes_per_s: float = 4.8e12
    #: Dense bf16 tensor-core peak (H200 SXM datasheet: 989 TFLOPS without sparsity).
    bf16_flops: float = 989e12
    #: Fractions of the peaks a tuned engine reaches (decode kernels ~70-80% of HBM bandwidth,
    #: large prefill GEMMs ~50-60% of tensor-core peak).
    bandwidth_efficiency: float = 0.75
    flops_efficiency: float = 0.5
    #: vLLM's ``gpu_memory_utilization`` and what activations, CUDA graphs and the allocator keep.
    gpu_memory_utilization: float = 0.9
    runtime_overhead_bytes: float = 4e9
    prompt_tokens: int = 1000
    output_tokens: int = 500
    price_per_hour: float = 3.50
    #: Offpeak's tokens/s over the engine's alone at GPU step rates (``bench overhead``'s
    #: measured ``ratio``); ``None``: read it from ``overhead.json`` (1.0 if there is none).
    runner_efficiency: float | None = None


def measured_runner_efficiency(results: Path | None = None) -> tuple[float, str]:
    """``(ratio, source)`` from ``overhead.json`` in ``results`` (default bench/results)."""
    path = (results or harness.RESULTS_DIR) / "overhead.json"
    if not path.exists():
        return 1.0, "not measured (no overhead.json): 1.0"
    data = json.loads(path.read_text())
    ratio = min(1.0, float(data["ratio"]))
    load = data["offpeak"].get("load_average")
    return ratio, f"measured by offpeak bench overhead ({path.name}, load {load})"


def project(a: Assumptions | None = None) -> dict[str, Any]:
    """The projection's figures (tokens/s, $ per million tokens) and the planner's reasoning."""
    a = a or Assumptions()
    source = "given"
    if a.runner_efficiency is None:
        efficiency, source = measured_runner_efficiency()
        a = replace(a, runner_efficiency=efficiency)
    assert a.runner_efficiency is not None
    kv = planner.kv_bytes_per_token(LLAMA_31_8B)
    weights = planner.weights_bytes(LLAMA_31_8B_PARAMETERS, planner.dtype_bytes("bfloat16"))
    usable = int(a.memory_bytes * a.gpu_memory_utilization - a.runtime_overhead_bytes)
    need = a.prompt_tokens + a.output_tokens
    memory = planner.plan_memory(usable, weights, kv, paged_avg_tokens=need)
    chunk = planner.MAX_NUM_SEQS_CAP
    batch, max_model_len, why = planner.choose_engine_limits(
        [a.prompt_tokens] * chunk,
        [a.output_tokens] * chunk,
        kv,
        memory.kv_budget_bytes,
        LLAMA_31_8B["max_position_embeddings"],
    )
    bandwidth = a.bandwidth_bytes_per_s * a.bandwidth_efficiency
    flops = a.bf16_flops * a.flops_efficiency
    average_context = a.prompt_tokens + a.output_tokens / 2
    step = planner.StepModel(
        base_ms=weights / bandwidth * 1e3, per_seq_ms=average_context * kv / bandwidth * 1e3
    )
    memory_step_ms = step.step_ms(batch)
    compute_step_ms = 2 * LLAMA_31_8B_PARAMETERS * batch / flops * 1e3
    step_ms = max(memory_step_ms, compute_step_ms)
    decode_tokens_per_s = batch * 1000 / step_ms
    prefill_s = 2 * LLAMA_31_8B_PARAMETERS * a.prompt_tokens / flops
    engine_seconds_per_request = a.output_tokens / decode_tokens_per_s + prefill_s
    engine_output_tokens_per_s = a.output_tokens / engine_seconds_per_request
    # The runner's claims, write-backs and accounting, measured at GPU-like step rates.
    seconds_per_request = engine_seconds_per_request / a.runner_efficiency
    output_tokens_per_s = a.output_tokens / seconds_per_request
    tokens_per_s = (a.prompt_tokens + a.output_tokens) / seconds_per_request
    dollars_per_s = a.price_per_hour / 3600
    return {
        "label": "projection on paper, not measured",
        "assumptions": asdict(a),
        "kv_bytes_per_token": kv,
        "weights_bytes": weights,
        "kv_budget_bytes": memory.kv_budget_bytes,
        "sequences_reserved_8192": memory.reserved_sequences,
        "sequences_paged": memory.paged_sequences,
        "max_num_seqs": batch,
        "max_model_len": max_model_len,
        "engine_limits": why,
        "step_base_ms": step.base_ms,
        "step_per_seq_ms": step.per_seq_ms,
        "decode_step_ms": step_ms,
        "decode_bound": "memory bandwidth" if memory_step_ms >= compute_step_ms else "compute",
        "compute_step_ms": compute_step_ms,
        "decode_tokens_per_s": decode_tokens_per_s,
        "prefill_ms_per_request": prefill_s * 1e3,
        "engine_output_tokens_per_s": engine_output_tokens_per_s,
        "runner_efficiency": a.runner_efficiency,
        "runner_efficiency_source": source,
        "output_tokens_per_s": output_tokens_per_s,
        "requests_per_s": output_tokens_per_s / a.output_tokens,
        "dollars_per_million_output_tokens": dollars_per_s / output_tokens_per_s * 1e6,
        "dollars_per_million_tokens": dollars_per_s / tokens_per_s * 1e6,
    }


def run(price_per_hour: float = 3.50, out_dir: Path | None = None) -> dict[str, Any]:
    """Print the projection and write ``projection.json``."""
    p = project(Assumptions(price_per_hour=price_per_hour))
    a = p["assumptions"]
    harness.print_table(
        "GPU projection ON PAPER (not measured): Llama 3.1 8B bf16 on one H200",
        ["quantity", "value"],
        [
            ["workload", f"{a['prompt_tokens']} prompt + {a['output_tokens']} output tokens"],
            ["KV cache per token", f"{p['kv_bytes_per_token']:,} B"],
            ["weights", f"{p['weights_bytes'] / 1e9:.2f} GB"],
            ["KV budget", f"{p['kv_budget_bytes'] / 1e9:.1f} GB"],
            ["max_num_seqs (planner)", p["max_num_seqs"]],
            ["decode step", f"{p['decode_step_ms']:.1f} ms ({p['decode_bound']} bound)"],
            ["decode tokens/s", f"{p['decode_tokens_per_s']:,.0f}"],
            ["prefill per request", f"{p['prefill_ms_per_request']:.2f} ms"],
            ["engine output tokens/s", f"{p['engine_output_tokens_per_s']:,.0f}"],
            ["× Offpeak's runner efficiency",
             f"{p['runner_efficiency']:.3f} ({p['runner_efficiency_source']})"],
            ["output tokens/s", f"{p['output_tokens_per_s']:,.0f}"],
            ["requests/s to keep it fed", f"{p['requests_per_s']:,.1f}"],
            [f"per M output tokens at {format_usd(a['price_per_hour'])}/h",
             format_usd(p["dollars_per_million_output_tokens"])],
            ["per M tokens (input + output)", format_usd(p["dollars_per_million_tokens"])],
        ],
    )  # fmt: skip
    harness.console.print(p["engine_limits"])
    path = harness.write_result("projection", p, out_dir)
    harness.console.print(f"wrote {path}")
    return p
