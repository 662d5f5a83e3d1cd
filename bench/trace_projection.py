"""ON PAPER, not measured: the trace's co-serving on one H100, from the step model's shape.

The bench measures a ``SharedStep`` on this CPU (decode ``base + per_seq × running``, prefill
per prompt token) and how much of its bound the lane harvested. The same shape on a GPU, for
Llama 3.1 8B in bf16 (``bench.projection``'s model and efficiencies):

- ``base``: one decode step reads every weight once, ``weights bytes / (bandwidth × efficiency)``;
- ``per_seq``: each running sequence's KV cache read once per step, ``context × KV bytes per
  token / (bandwidth × efficiency)``, at the trace's mean context;
- ``prefill``: ``2 × parameters`` FLOPs per prompt token at a fraction of the bf16 peak.

H100 SXM figures from NVIDIA's H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3, 989 TFLOPS dense
bf16. The trace is taken at its own rate and token counts (unscaled). The projected batch
tokens/s is the bound at the lane's TPOT target (``ratio ×`` the mean step of the real-time load
alone) times the harvest leg (c) measured here: an estimate carried over, not a GPU run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bench.colocate import SharedStep
from bench.projection import LLAMA_31_8B, LLAMA_31_8B_PARAMETERS, Assumptions
from workers import planner


@dataclass(frozen=True)
class Gpu:
    name: str = "H100 SXM (80 GB HBM3, 3.35 TB/s, 989 TFLOPS dense bf16)"
    bandwidth_bytes_per_s: float = 3.35e12
    bf16_flops: float = 989e12


def gpu_step(gpu: Gpu, context_tokens: float) -> SharedStep:
    """Llama 3.1 8B bf16's step on ``gpu`` with sequences of ``context_tokens`` of context."""
    eff = Assumptions()
    bandwidth = gpu.bandwidth_bytes_per_s * eff.bandwidth_efficiency
    kv_per_token = planner.kv_bytes_per_token(LLAMA_31_8B)
    weights = 2 * LLAMA_31_8B_PARAMETERS  # bf16
    return SharedStep(
        base_s=weights / bandwidth,
        per_seq_s=context_tokens * kv_per_token / bandwidth,
        prefill_s_per_token=2 * LLAMA_31_8B_PARAMETERS / (gpu.bf16_flops * eff.flops_efficiency),
    )


def project(
    rate: float,
    prompt: float,
    reply: float,
    tpot_ratio: float,
    harvest: float | None,
    batch_prompt: float = 1000.0,
    batch_reply: float = 500.0,
    gpu: Gpu | None = None,
) -> dict[str, Any]:
    """The trace (``rate`` requests/s of ``prompt`` + ``reply`` tokens) on one GPU: its load,
    the mean step alone and with the lane at ``tpot_ratio ×`` it, the bound on batch tokens/s
    (batch lines of ``batch_prompt`` + ``batch_reply`` tokens) and that bound × ``harvest``, the
    harvest taken at most 1 (a harvest over the bound is the bound misread in saturated windows,
    not batch work a GPU would add)."""
    gpu = gpu or Gpu()
    step = gpu_step(gpu, prompt + reply / 2)
    alone = step.mean_step(rate, prompt, reply)
    target = tpot_ratio * alone
    lines, bound = step.bound(target, rate, prompt, reply, batch_prompt, batch_reply)
    load = rate * (step.per_seq_s * reply + step.prefill_s_per_token * prompt)
    return {
        "on_paper": True,
        "gpu": asdict(gpu),
        "model": "Llama 3.1 8B bf16",
        "step_model_s": asdict(step),
        "trace": {"rate_per_s": rate, "prompt_tokens": prompt, "reply_tokens": reply},
        "realtime_load_fraction": load,
        "mean_step_alone_s": alone,
        "lane_tpot_target_s": target,
        "bound_lines": lines,
        "bound_batch_tokens_per_s": bound,
        "harvest_measured": harvest,
        "projected_batch_tokens_per_s": None if harvest is None else bound * min(harvest, 1.0),
        "batch_line_tokens": {"prompt": batch_prompt, "reply": batch_reply},
    }
