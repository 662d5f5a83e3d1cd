"""Markdown tables of the JSON results (``offpeak bench report``), for ``docs/benchmarks.md``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.harness import RESULTS_DIR


def _table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _load(folder: Path, name: str) -> dict[str, Any] | None:
    path = folder / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _loads(result: dict[str, Any]) -> str:
    start, end = result["machine"]["load_average"], result["load_average_end"]
    return f"Load average (1/5/15 min) {start} at the start, {end} at the end"


def markdown(folder: Path | None = None) -> str:
    """Every result found in ``folder`` (default ``bench/results``) as markdown."""
    folder = folder or RESULTS_DIR
    parts = []
    if (e2e := _load(folder, "e2e")) and "sizes" in e2e:
        parts.append(e2e_markdown(e2e))
    elif e2e:  # an older result: one size, one raw leg
        legs = e2e["legs"]
        names = {
            "a_raw_engine": "(a) `vllm.LLM.chat`, generation only",
            "b_run_batch": "(b) `vllm run_batch`, whole process",
            "c_offpeak": "(c) Offpeak, upload → output downloaded",
        }
        rows = [
            [names[k], f"{leg['seconds']:.1f}", f"{leg['completion_tokens']:,}",
             f"{leg['output_tokens_per_s']:,.0f}",
             f"{e2e['same_text_as_raw'][k]}/{e2e['params']['requests']}",
             str(leg["load_average"][0])]
            for k, leg in legs.items()
        ]  # fmt: skip
        ratios = e2e["ratios"]
        parts.append(
            "### End to end\n\n"
            + _table(
                [
                    "leg",
                    "seconds",
                    "output tokens",
                    "output tokens/s",
                    "same text as (a)",
                    "load (1 min)",
                ],
                rows,
            )  # fmt: skip
            + f"\n\nc/a = **{ratios['c_over_a']:.2f}** (target ≥ 0.90), "
            f"c/b = **{ratios['c_over_b']:.2f}** (target > 1). {_loads(e2e)}."
        )
    if kv_blocks := _load(folder, "kv-blocks"):
        parts.append(kv_blocks_markdown(kv_blocks))
    if intake := _load(folder, "intake"):
        rows = [
            [f"{r['file_mb']:.0f} MB", f"{r['lines']:,}", f"{r['upload_s']:.2f}",
             f"{r['validate_s']:.2f}", f"{r['total_s']:.2f}", f"**{r['mb_per_s']:.1f}**",
             f"{r['lines_per_s']:,.0f}", f"{r['orjson_parse_s']:.2f}",
             f"{r['intake_over_parse']:.1f}×", f"**{r['api_rss_growth_mb']:.1f}**",
             str(r["load_average"][0])]
            for r in intake["runs"]
        ]  # fmt: skip
        parts.append(
            "### Intake\n\n"
            + _table(
                [
                    "file",
                    "lines",
                    "upload s",
                    "create → rows stored s",
                    "total s",
                    "MB/s",
                    "lines/s",
                    "orjson parse s",
                    "total / parse",
                    "API RSS growth MiB",
                    "load (1 min)",
                ],
                rows,
            )  # fmt: skip
            + f"\n\n{_loads(intake)}."
        )
    if control := _load(folder, "control"):
        rows = [
            [f"{r['lines']:,}", f"{r['validate_s']:.2f}", f"{r['run_s']:.2f}",
             f"{r['finalize_s']:.2f}", f"{r['download_s']:.2f}", f"{r['total_s']:.2f}",
             f"**{r['requests_per_s']:,.0f}**", str(r["load_average"][0])]
            for r in control["runs"]
        ]  # fmt: skip
        parts.append(
            "### Control plane\n\n"
            + _table(
                [
                    "lines",
                    "validating s",
                    "in_progress s",
                    "finalizing s",
                    "download s",
                    "total s",
                    "requests/s",
                    "load (1 min)",
                ],
                rows,
            )  # fmt: skip
            + f"\n\n{_loads(control)}."
        )
    if memory := _load(folder, "memory"):
        rows = [
            [f"{r['lines']:,}", f"{r['engine_rss_baseline_mb']:.0f}",
             f"{r['engine_rss_peak_mb']:.0f}", f"**{r['engine_rss_growth_mb']:.1f}**",
             f"{r['control_rss_baseline_mb']:.0f}", f"{r['control_rss_peak_mb']:.0f}",
             f"**{r['control_rss_growth_mb']:.1f}**", f"{r['requests_per_s']:,.0f}"]
            for r in memory["runs"]
        ]  # fmt: skip
        parts.append(
            "### Worker memory\n\n"
            + _table(
                [
                    "lines",
                    "engine after warm-up MiB",
                    "engine peak MiB",
                    "engine growth MiB",
                    "control after warm-up MiB",
                    "control peak MiB",
                    "control growth MiB",
                    "requests/s",
                ],
                rows,
            )  # fmt: skip
            + f"\n\n{_loads(memory)}."
        )
    if colocate := _load(folder, "colocate"):
        parts.append(colocate_markdown(colocate))
    return "\n\n".join(parts) + "\n"


_LEG_NAMES = {
    "run_batch": "(b) `vllm run_batch`, whole process",
    "offpeak": "(c) Offpeak, upload → output downloaded",
}


def _leg_name(key: str, leg: dict[str, Any], best: str) -> str:
    if leg["kind"] == "raw":
        name = f"(a) `LLM.chat`, max_num_seqs {leg['max_num_seqs']}"
        return f"**{name}** (best)" if key == best else name
    return _LEG_NAMES.get(key, key)


def _rss(leg: dict[str, Any]) -> str:
    rss = leg.get("engine_rss_mib")
    if not rss:
        return ""
    return f"{rss['after_warm_up']:,.0f} / {rss['peak']:,.0f} / **+{rss['growth']:,.0f}**"


def _e2e_verdict(n: int, size: dict[str, Any], targets: dict[str, float]) -> str:
    offpeak = size["legs"]["offpeak"]
    met = "met" if size["met"].get("offpeak_over_best_raw") else "missed"
    return (
        f"{n:,} requests: Offpeak / best raw **{offpeak['over_best_raw']:.3f}** "
        f"(target ≥ {targets['offpeak_over_best_raw']}: {met}), Offpeak / run_batch "
        f"**{offpeak.get('over_run_batch', float('nan')):.2f}**"
    )


def e2e_markdown(result: dict[str, Any]) -> str:
    """``bench e2e``: legs × sizes, each leg's ratio to the fastest raw leg and
    to run_batch, its prefix-cache hit rate and, for Offpeak, the engine worker's RSS."""
    rows = []
    for n, size in result["sizes"].items():
        best = size["best_raw"]
        for key, leg in size["legs"].items():
            over_peer = leg.get("over_run_batch")
            ratio = f"{leg['over_best_raw']:.3f}"
            rows.append([
                f"{int(n):,}", _leg_name(key, leg, best), f"{leg['seconds']:.1f}",
                f"{leg['completion_tokens']:,}", f"{leg['output_tokens_per_s']:,.1f}",
                f"**{ratio}**" if key == "offpeak" else ratio,
                "" if over_peer is None else f"{over_peer:.2f}",
                f"{100 * leg['prefix_hit_rate']:.0f}%",
                f"{size['same_text_as_best_raw'][key]}/{int(n):,}", _rss(leg),
                f"{leg['load_average'][0]} → {leg.get('load_average_end', ['?'])[0]}",
            ])  # fmt: skip
    params, targets = result["params"], result["targets"]
    verdicts = "; ".join(_e2e_verdict(int(n), s, targets) for n, s in result["sizes"].items())
    engine = params["engine"]
    return (
        "### End to end, against the engine's best\n\n"
        + _table(
            [
                "requests",
                "leg",
                "seconds",
                "output tokens",
                "output tokens/s",
                "/ best raw",
                "/ run_batch",
                "prefix-cache hit",
                "same text as best raw",
                "engine worker RSS MiB (after warm-up / peak / growth)",
                "load (1 min) start → end",
            ],
            rows,
        )  # fmt: skip
        + f"\n\n{verdicts}. max_tokens ≤ {params['max_tokens']}; engine: dtype "
        f"{engine.get('dtype')}, block size {engine.get('block_size', 'vLLM default')}, "
        f"gpu_memory_utilization {engine.get('gpu_memory_utilization')}, prefix caching "
        f"{'on' if engine.get('enable_prefix_caching') else 'off'}, chunked prefill "
        f"{'on' if engine.get('enable_chunked_prefill') else 'off'}; Offpeak's max_num_seqs "
        f"{params['offpeak_max_num_seqs']}. {_loads(result)}."
    )


def kv_blocks_markdown(result: dict[str, Any]) -> str:
    """``bench kv-blocks``: the raw leg at each KV block size."""
    rows = [
        [size, f"{leg['seconds']:.1f}", f"{leg['completion_tokens']:,}",
         f"**{leg['output_tokens_per_s']:,.1f}**", f"{100 * leg['prefix_hit_rate']:.1f}%",
         f"{leg['cached_tokens']:,} / {leg['prompt_tokens']:,}",
         f"{leg['engine']['num_blocks']:,}", str(leg["load_average"][0])]
        for size, leg in result["runs"].items()
    ]  # fmt: skip
    rows += [[size, "refused by vLLM", "", "", "", "", "", ""] for size in result["refused"]]
    params = result["params"]
    return (
        "### KV block size on the CPU\n\n"
        + _table(
            [
                "block size",
                "seconds",
                "output tokens",
                "output tokens/s",
                "prefix-cache hit",
                "cached / prompt tokens",
                "KV blocks",
                "load (1 min)",
            ],
            rows,
        )  # fmt: skip
        + f"\n\n{params['requests']} requests, max_tokens ≤ {params['max_tokens']}, "
        f"max_num_seqs {params['engine']['max_num_seqs']}; fastest: block size "
        f"**{result['fastest']}**. {_loads(result)}."
    )


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{1000 * x:,.0f}"


def _prefill(result: dict[str, Any]) -> str:
    """The prefill term and the batch lines' tokens, for results that measured them."""
    prefill = result["step_model"].get("prefill")
    if not prefill:
        return ""
    lines = result.get("batch_line_tokens") or {}
    text = f", {1000 * prefill['prefill_s_per_token']:.2f} ms per prompt token of prefill"
    if lines:
        text += (
            f" (real-time prompts {result['step_model']['realtime_prompt_tokens']} tokens; batch "
            f"lines {lines['uncached_prompt']:.0f} uncached prompt and {lines['reply']:.0f} reply "
            "tokens on average)"
        )
    return text


def colocate_markdown(result: dict[str, Any]) -> str:
    """``bench colocate``'s legs and phases as one table, with its targets and verdicts."""
    names = {"a": "(a) real-time alone", "b": "(b) + batch, lane off",
             "c": "(c) + batch, lane on", "d": "(d) batch alone"}  # fmt: skip
    rows = []
    for leg, phases in result["legs"].items():
        for r in phases:
            bound = r.get("bound_tokens_per_s")
            rows.append([
                names.get(leg, leg), r["phase"], str(r["requests_served"]),
                _ms(r["ttft"]["p50"]), _ms(r["ttft"]["p95"]), _ms(r["ttft"]["p99"]),
                _ms(r["tpot"]["p50"]), _ms(r["tpot"]["p95"]), _ms(r["tpot"]["p99"]),
                f"{r['batch_output_tokens_per_s']:.1f}",
                "" if bound is None else f"{bound:.1f}",
            ])  # fmt: skip
    t, step = result["targets"], result["step_model"]
    harvest = result["harvest_c"]
    return (
        "### Co-serving through one vllm serve\n\n"
        + _table(
            [
                "leg",
                "phase",
                "served",
                "TTFT p50 ms",
                "p95",
                "p99",
                "TPOT p50 ms",
                "p95",
                "p99",
                "batch tok/s",
                "bound tok/s",
            ],
            rows,
        )  # fmt: skip
        + f"\n\nStep model measured on the server: a decode step of {step['base_ms']:.1f} ms + "
        f"{step['per_seq_ms']:.2f} ms per sequence{_prefill(result)}; TPOT floor (2.4 × one "
        f"sequence) {_ms(t['tpot_floor_step_model_s'])} ms; real-time capacity "
        f"{result['realtime_capacity_per_s']:.2f} requests/s. Targets: TTFT p95 ≤ "
        f"{_ms(t['ttft_p95_s'])} ms, TPOT p95 ≤ {_ms(t['tpot_p95_s'])} ms (2.4 × leg (a)'s quiet "
        f"p95). (c) inside in every phase: {result['met']['c_inside_targets_every_phase']}; "
        f"harvest (c) / bound: {'n/a' if harvest is None else f'{100 * harvest:.0f}%'} "
        f"(target ≥ 70%). {_loads(result)}."
    )
