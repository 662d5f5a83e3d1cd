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

Every leg computes on the same CPUs with the same threads: ``VLLM_CPU_OMP_THREADS_BIND`` is
set to every CPU this process may use (unless already set) before any leg starts, so the raw and
run_batch legs do not take vLLM's ``auto`` binding (which keeps a core back) while Offpeak's
engine honours the variable (``workers.engine.cpu_binding``); each leg's binding is in the JSON.
``kv_cache_gib`` gives every leg the same KV cache (``kv_cache_memory_bytes``).

Workloads: ``no-sharing`` (the sizes above, ``generator.chat_requests``), ``shared-prefix``
(``generator.shared_prefix_requests``: documents of ~600 tokens, each asked several questions,
shuffled; with a KV cache smaller than the documents together, as a GPU's is to a large file), or
any OpenAI batch file (``input_file``).

Output tokens/s is completion tokens (as each reports them) over that leg's seconds; the
prefix-cache hit rate is cached prompt tokens over prompt tokens (``num_cached_tokens`` of
vLLM's outputs, ``prompt_tokens_details.cached_tokens`` of run_batch's and Offpeak's usage);
prompt tokens computed (prompt minus cached) are set against the minimum possible, each distinct
prefix computed once (``minimum_prompt_tokens`` of the prompts' token ids), and in whole KV
blocks, as an engine's prefix cache can reach it (``minimum_prompt_tokens_in_blocks``).
Targets: c ≥ 0.95 × the best (a) and c faster than b, at every size; the
engine worker's RSS flat from the small batch to the large one; on ``shared-prefix`` c ≥ 1.5 × the
best (a) with every text the same, and c's prompt tokens computed ≤ 1.2 × the minimum.
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
from bench.generator import (
    ASSISTANT_SYSTEM_PROMPT,
    chat_requests,
    shared_prefix_requests,
    write_jsonl,
)
from offpeak.settings import DEFAULT_MODEL, ModelConfig, Settings
from workers.engine.cpu_binding import BIND_VARIABLE, format_cpus

#: The built-in workloads.
WORKLOADS = ("no-sharing", "shared-prefix")
#: ``shared-prefix``'s targets: Offpeak over the best raw leg, and its prompt tokens computed
#: over the minimum possible, at most.
SHARED_PREFIX_OVER_BEST_RAW = 1.5
SHARED_PREFIX_COMPUTED_OVER_MINIMUM = 1.2
#: ``shared-prefix``'s defaults: documents, questions per document, and a KV cache (GiB) the
#: documents together overflow about 2.7x (SmolLM2-135M in float32: 45 KiB per token).
DOCUMENTS = 16
QUESTIONS = 6
SHARED_PREFIX_KV_GIB = 0.15

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
#: The engine worker's CPUs (``workers.engine.cpu_binding.bound``).
_BINDING = re.compile(r"computes on CPUs? (\S+)")


def on_cpu() -> bool:
    """Whether vLLM runs on a CPU here (vllm-cpu), as the engine decides its device defaults."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def engine_kwargs(name: str, config: ModelConfig, model_dir: Path, cpu: bool) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments Offpeak's engine uses for ``config`` on this device
    (``workers.engine.vllm_engine.engine_kwargs``: dtype, chunked prefill and KV block size
    resolved), minus the model folder (given apart) and Offpeak's own choices, the priority
    scheduler and, on a CPU, the in-process executor (``docs/engine.md``): the raw legs run
    vLLM's default. Prompts as token ids are Offpeak's other choice; the raw legs send
    messages."""
    from workers.engine.vllm_engine import engine_kwargs as offpeak_kwargs

    kwargs = offpeak_kwargs(name, config, model_dir, on_cpu=cpu)
    for key in ("model", "tokenizer", "scheduling_policy", "distributed_executor_backend"):
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


def minimum_prompt_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Prompt tokens an engine must compute at the least for ``prompts`` (token ids): each
    distinct prefix once, i.e. the nodes of the prompts' token trie (sorted, each prompt adds
    what it does not share with its neighbour before it)."""
    ordered = sorted(list(p) for p in prompts)
    total = 0
    previous: list[int] = []
    for prompt in ordered:
        shared = 0
        for a, b in zip(prompt, previous, strict=False):
            if a != b:
                break
            shared += 1
        total += len(prompt) - shared
        previous = prompt
    return total


def minimum_prompt_tokens_in_blocks(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """``minimum_prompt_tokens`` as an engine that caches whole KV blocks of ``block_size``
    tokens can reach it: a prompt reuses only the whole blocks it shares with another
    (``workers.scheduler.chunking.shared_prefix_tokens``)."""
    from workers.scheduler.chunking import shared_prefix_tokens

    return sum(len(p) for p in prompts) - sum(shared_prefix_tokens(prompts, block_size))


def _tokens(leg: dict[str, Any]) -> dict[str, Any]:
    """Adds the leg's tokens/s, prefix-cache hit rate and prompt tokens computed."""
    leg["output_tokens_per_s"] = leg["completion_tokens"] / leg["seconds"]
    prompt = leg["prompt_tokens"]
    leg["prefix_hit_rate"] = leg["cached_tokens"] / prompt if prompt else 0.0
    leg["prompt_tokens_computed"] = prompt - leg["cached_tokens"]
    leg.setdefault("cpu_binding", os.environ.get(BIND_VARIABLE, "auto"))
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
            "minimum_prompt_tokens": minimum_prompt_tokens(
                [c["prompt_token_ids"] for c in completions]
            ),
            "minimum_prompt_tokens_in_blocks": minimum_prompt_tokens_in_blocks(
                [c["prompt_token_ids"] for c in completions], result["engine"]["block_size"]
            ),
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
        text = log.read_text(errors="replace") if log.exists() else ""
        slots = _SLOTS.findall(text)
        binding = _BINDING.findall(text)
    return _tokens(
        {
            **leg,
            "kind": "offpeak",
            "max_num_seqs": config.max_num_seqs_on(on_cpu()),
            # Where its engine computed, as the engine worker logged it.
            "cpu_binding": binding[-1] if binding else "unknown",
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
    """One size's verdict: every leg's ratio to the fastest raw leg (and to run_batch), its
    prompt tokens computed against the minimum possible, the texts each leg shares with the
    fastest raw leg, and the targets met. ``legs`` keep their ``texts``."""
    best = fastest(legs)[0]
    best_rate = legs[best]["output_tokens_per_s"]
    peer = legs.get("run_batch")
    minimum = legs[best].get("minimum_prompt_tokens")
    in_blocks = legs[best].get("minimum_prompt_tokens_in_blocks")
    for leg in legs.values():
        leg["over_best_raw"] = leg["output_tokens_per_s"] / best_rate
        if peer is not None:
            leg["over_run_batch"] = leg["output_tokens_per_s"] / peer["output_tokens_per_s"]
        if minimum:
            leg["minimum_prompt_tokens"] = minimum
            leg["computed_over_minimum"] = leg["prompt_tokens_computed"] / minimum
        if in_blocks:
            leg["minimum_prompt_tokens_in_blocks"] = in_blocks
            leg["computed_over_minimum_in_blocks"] = leg["prompt_tokens_computed"] / in_blocks
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
        met["same_texts"] = same["offpeak"] == len(reference)
    return {
        "requests": requests,
        "best_raw": best,
        "minimum_prompt_tokens": minimum,
        "minimum_prompt_tokens_in_blocks": in_blocks,
        "same_text_as_best_raw": same,
        "met": met,
    }


def _print(requests: int, verdict: dict[str, Any], legs: dict[str, dict[str, Any]]) -> None:
    harness.print_table(
        f"end to end: {requests:,} chat requests (best raw leg: {verdict['best_raw']})",
        ["leg", "max_num_seqs", "seconds", "output tokens", "tokens/s", "/ best raw",
         "/ run_batch", "prefix hit", "computed / min", "same text", "CPUs", "load (1 min)"],
        [[key, leg["max_num_seqs"], leg["seconds"], leg["completion_tokens"],
          leg["output_tokens_per_s"], leg["over_best_raw"], leg.get("over_run_batch", "n/a"),
          f"{100 * leg['prefix_hit_rate']:.0f}%", leg.get("computed_over_minimum", "n/a"),
          f"{verdict['same_text_as_best_raw'][key]}/{requests}", leg["cpu_binding"],
          leg["load_average"][0]]
         for key, leg in legs.items()],
    )  # fmt: skip


def workload_lines(
    workload: str, n: int, name: str, max_tokens: int, documents: int, questions: int
) -> list[dict[str, Any]]:
    """The built-in ``workload``'s lines (``WORKLOADS``); raises ``ValueError`` for another."""
    if workload == "no-sharing":
        return chat_requests(
            n, model=name, max_tokens=max_tokens, system_prompt=ASSISTANT_SYSTEM_PROMPT
        )
    if workload == "shared-prefix":
        return shared_prefix_requests(documents, questions, model=name, max_tokens=max_tokens)
    raise ValueError(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")


def _bind_every_leg() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for every leg: the operator's, else every CPU this process
    may use (set here, so every child inherits it)."""
    binding = os.environ.get(BIND_VARIABLE)
    if not binding and on_cpu():
        binding = format_cpus(sorted(os.sched_getaffinity(0)))
        os.environ[BIND_VARIABLE] = binding
    return binding or "auto"


def run(
    requests: Sequence[int] = SIZES,
    max_tokens: int = 32,
    out_dir: Path | None = None,
    gpu_memory_utilization: float | None = None,
    dtype: str | None = DTYPE,
    sweep: Sequence[int] = SWEEP,
    keep: int = KEEP,
    logs: Path | None = None,
    *,
    workload: str = "no-sharing",
    input_file: Path | None = None,
    kv_cache_gib: float | None = None,
    documents: int = DOCUMENTS,
    questions: int = QUESTIONS,
) -> dict[str, Any]:
    """Run the legs on the default model; print a table per size and write
    ``e2e-<workload>.json`` (``e2e.json`` for ``no-sharing``, ``e2e-input.json`` for a file).

    ``no-sharing``: one run per size in ``requests`` (ascending); ``shared-prefix``: one run of
    ``documents × questions`` lines (KV cache ``SHARED_PREFIX_KV_GIB`` unless ``kv_cache_gib``
    says); ``input_file``: one run of that OpenAI batch file (its lines' ``model`` is replaced
    by the default model's name).

    ``sweep`` is the raw leg's ``max_num_seqs`` values; after the first size only the ``keep``
    fastest of the size before run (``0``: all of them). ``gpu_memory_utilization`` and
    ``dtype`` replace the configured values in every leg (``None``: keep them; vllm-cpu
    reserves that fraction of the NUMA node's memory minus the process's own RSS for the KV
    cache and refuses to start when the difference is not positive); ``kv_cache_gib`` gives
    every leg a KV cache of that size instead. ``logs``: keep the scratch services' logs there
    (one folder per size). Raises ``RuntimeError`` when a leg fails.
    """
    from workers.model_store import ensure_model

    settings = Settings()
    name = DEFAULT_MODEL
    config = settings.models[name].model_copy(update={"engine": "vllm"})
    if gpu_memory_utilization is not None:
        config = config.model_copy(update={"gpu_memory_utilization": gpu_memory_utilization})
    if dtype is not None:
        config = config.model_copy(update={"dtype": dtype})
    if workload == "shared-prefix" and kv_cache_gib is None and input_file is None:
        kv_cache_gib = SHARED_PREFIX_KV_GIB
    if kv_cache_gib is not None:
        engine_args = {**config.engine_args, "kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
        config = config.model_copy(update={"engine_args": engine_args})
    model_dir = ensure_model(name, config, settings.model_cache_dir)
    kwargs = engine_kwargs(name, config, model_dir, on_cpu())
    binding = _bind_every_leg()
    machine = harness.machine()
    sizes: dict[str, dict[str, Any]] = {}
    raw_seqs = list(sweep)
    label = "input" if input_file is not None else workload
    runs: list[int] = sorted(requests) if label == "no-sharing" else [0]
    with tempfile.TemporaryDirectory(prefix="offpeak-e2e-") as tmp:
        for n in runs:
            if input_file is not None:
                lines = [orjson.loads(raw) for raw in input_file.read_bytes().splitlines()
                         if raw.strip()]  # fmt: skip
                for line in lines:
                    line.setdefault("body", {})["model"] = name
            else:
                lines = workload_lines(workload, n, name, max_tokens, documents, questions)
            n = len(lines)
            path = Path(tmp) / f"input-{n}.jsonl"
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
            if label == "shared-prefix":
                offpeak = legs["offpeak"]
                verdict["met"]["shared_prefix_over_best_raw"] = (
                    offpeak["over_best_raw"] >= SHARED_PREFIX_OVER_BEST_RAW
                )
                verdict["met"]["computed_within_minimum"] = (
                    offpeak.get("computed_over_minimum", float("inf"))
                    <= SHARED_PREFIX_COMPUTED_OVER_MINIMUM
                )
            _print(n, verdict, legs)
            kept = {k: {f: v for f, v in leg.items() if f != "texts"} for k, leg in legs.items()}
            sizes[str(n)] = {**verdict, "legs": kept}
            raw_seqs = next_sweep(legs, keep)
            # Written after every size, so a run stopped during a large size keeps the rest.
            sized = requests if label == "no-sharing" else [n]
            result = _result(machine, sizes, sized, max_tokens, sweep, keep, name, kwargs, config)
            result["params"].update(
                workload=label,
                input_file=str(input_file) if input_file else None,
                kv_cache_gib=kv_cache_gib,
                cpu_binding=binding,
                **({"documents": documents, "questions": questions}
                   if label == "shared-prefix" else {}),
            )  # fmt: skip
            file_name = "e2e" if label == "no-sharing" else f"e2e-{label}"
            written = harness.write_result(file_name, result, out_dir)
    for count, size in sizes.items():
        offpeak = size["legs"]["offpeak"]
        harness.console.print(
            f"{count} requests: Offpeak / best raw ({size['best_raw']}) = "
            f"{offpeak['over_best_raw']:.3f} (target ≥ {TARGET_OVER_BEST_RAW}), Offpeak / "
            f"run_batch = {offpeak['over_run_batch']:.2f} (target > 1), prompt tokens computed "
            f"/ minimum = {offpeak.get('computed_over_minimum', float('nan')):.2f}, engine "
            f"worker RSS +{offpeak['engine_rss_mib']['growth']:.0f} MiB"
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
