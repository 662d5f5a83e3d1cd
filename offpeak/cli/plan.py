"""`offpeak plan memory|batch`, `offpeak simulate policies` and `offpeak calibrate MODEL`.

Command-line faces of ``workers.planner``, ``workers.sim.policies`` and ``workers.calibration``: the
calculations of ``docs/planning.md`` as tools an operator runs. Every command prints rich tables, or
one JSON object with ``--json``; ``--plot FILE.png`` draws the result with matplotlib (imported only
then, so the CLI starts fast).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from offpeak.settings import get_settings
from workers import planner
from workers.planner import StepModel

if TYPE_CHECKING:
    from workers.engine.base import Engine

plan_app = typer.Typer(
    help="Capacity planning: the step model and KV-cache memory (docs/planning.md).",
    no_args_is_help=True,
)
simulate_app = typer.Typer(help="Simulations of batching policies.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")]
PlotOption = Annotated[
    Path | None, typer.Option("--plot", help="Also draw the result into this PNG file.")
]


def _console() -> Console:
    # Built per command, not at import, so output follows whatever sys.stdout is at call time.
    return Console()


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{option} needs positive integers, e.g. 10,20,30,40")
    return values


# --- plan memory ------------------------------------------------------------------------------


def _kv_per_token(
    kv_bytes_per_token: int | None, config_path: Path | None, dtype_size: int | None
) -> int:
    if kv_bytes_per_token is not None:
        return kv_bytes_per_token
    if config_path is None:
        raise typer.BadParameter(
            "give --kv-bytes-per-token, --config CONFIG.json or --model-folder FOLDER"
        )
    try:
        return planner.kv_bytes_per_token(planner.read_config(config_path), dtype_size)
    except (OSError, ValueError) as err:
        raise typer.BadParameter(str(err)) from None


def _weights(
    weights_gb: float | None,
    params_billion: float | None,
    dtype_size: int | None,
    config_path: Path | None,
    model_folder: Path | None,
) -> int:
    if weights_gb is not None:
        return round(weights_gb * 1e9)
    if params_billion is not None:
        if dtype_size is None and config_path is not None:
            config = planner.read_config(config_path)
            dtype = config.get("torch_dtype") or config.get("dtype")
            dtype_size = planner.dtype_bytes(str(dtype)) if dtype else None
        if dtype_size is None:
            raise typer.BadParameter("--params-billion needs --dtype-bytes or a config's dtype")
        return planner.weights_bytes(params_billion * 1e9, dtype_size)
    if model_folder is not None:
        try:
            return planner.weights_bytes_in_folder(model_folder)
        except FileNotFoundError as err:
            raise typer.BadParameter(str(err)) from None
    raise typer.BadParameter("give --weights-gb, --params-billion or --model-folder")


@plan_app.command("memory")
def plan_memory_command(
    config: Annotated[
        Path | None, typer.Option(help="A model's config.json (or its folder) for the KV cache.")
    ] = None,
    model_folder: Annotated[
        Path | None,
        typer.Option(help="A Hugging Face model folder: config.json and *.safetensors sizes."),
    ] = None,
    kv_bytes_per_token: Annotated[
        int | None, typer.Option(help="KV-cache bytes per token, instead of a config.")
    ] = None,
    dtype_bytes: Annotated[
        int | None, typer.Option(help="Bytes per element, overriding the config's torch_dtype.")
    ] = None,
    weights_gb: Annotated[float | None, typer.Option(help="Weights, in GB (1e9 bytes).")] = None,
    params_billion: Annotated[
        float | None, typer.Option(help="Weights as parameters (billions) x dtype bytes.")
    ] = None,
    device_gb: Annotated[float, typer.Option(help="Device memory, in GB (1e9 bytes).")] = 80.0,
    utilization: Annotated[
        float, typer.Option(help="Fraction of device memory the engine may use (vLLM's).")
    ] = 1.0,
    reserved_tokens: Annotated[
        int, typer.Option(help="Tokens reserved per sequence up front (the whole context).")
    ] = 8192,
    paged_avg_tokens: Annotated[
        int, typer.Option(help="Tokens a sequence uses on average when memory is paged.")
    ] = 2000,
    plot: PlotOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Sequences that fit in memory: reserved for the whole context vs paged as tokens arrive.

    Llama 3 8B on an 80 GB GPU: --kv-bytes-per-token 131072 --weights-gb 16 --device-gb 80
    prints 59 reserved at 8,192 tokens and 244 paged at 2,000.
    """
    config_path = config or model_folder
    kv = _kv_per_token(kv_bytes_per_token, config_path, dtype_bytes)
    weights = _weights(weights_gb, params_billion, dtype_bytes, config_path, model_folder)
    device = round(device_gb * 1e9 * utilization)
    try:
        plan = planner.plan_memory(device, weights, kv, reserved_tokens, paged_avg_tokens)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if plot is not None:
        _plot_memory(plan, plot)
    if as_json:
        typer.echo(json.dumps({**asdict(plan), "kv_budget_bytes": plan.kv_budget_bytes}))
        return
    _print_memory(plan, plot)


def _print_memory(plan: planner.MemoryPlan, plot: Path | None) -> None:
    console = _console()
    memory = Table(title="Memory", show_header=False)
    memory.add_column()
    memory.add_column(justify="right")
    memory.add_row("device (usable)", _gb(plan.device_bytes))
    memory.add_row("weights", _gb(plan.weights_bytes))
    memory.add_row("left for the KV cache", _gb(plan.kv_budget_bytes))
    kib = plan.kv_bytes_per_token / 1024
    memory.add_row("KV cache per token", f"{plan.kv_bytes_per_token:,} B ({kib:,.1f} KiB)")
    console.print(memory)

    fits = Table(title="Sequences that fit")
    fits.add_column("memory per sequence")
    for name in ("tokens", "bytes each", "sequences"):
        fits.add_column(name, justify="right")
    for label, tokens, shown, count in (
        ("reserved for the whole context", plan.reserved_tokens, "", plan.reserved_sequences),
        ("paged, as tokens arrive", plan.paged_avg_tokens, " avg", plan.paged_sequences),
    ):
        each = _gb(plan.kv_bytes_per_token * tokens)
        fits.add_row(label, f"{tokens:,}{shown}", each, str(count))
    console.print(fits)
    if plot is not None:
        console.print(f"plot written to {plot}")


def _plot_memory(plan: planner.MemoryPlan, path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    labels = [
        f"reserved\n{plan.reserved_tokens:,} tokens each",
        f"paged\n{plan.paged_avg_tokens:,} tokens on average",
    ]
    counts = [plan.reserved_sequences, plan.paged_sequences]
    bars = ax.bar(labels, counts, color=["#999999", "#2a7ab9"])
    ax.bar_label(bars)
    ax.set_ylabel("sequences that fit")
    ax.set_title(
        f"KV cache {_gb(plan.kv_budget_bytes)} at {plan.kv_bytes_per_token:,} B/token "
        f"(weights {_gb(plan.weights_bytes)})",
        fontsize=10,
    )
    fig.savefig(path, dpi=100)


# --- plan batch -------------------------------------------------------------------------------


def _step_model(
    base_ms: float, per_seq_ms: float, calibrated: str | None, device: str | None
) -> tuple[StepModel, str]:
    """The step model to plan with, and where it came from (for the printout)."""
    if calibrated is None:
        return StepModel(base_ms, per_seq_ms), f"{base_ms:g} ms + {per_seq_ms:g} ms per sequence"
    from workers.calibration import current_device, load_calibration

    device = device or current_device()
    cache_dir = get_settings().model_cache_dir
    model = load_calibration(calibrated, device, cache_dir)
    if model is None:
        typer.echo(
            f"no calibration for {calibrated} on {device} in {cache_dir}; "
            f"run `offpeak calibrate {calibrated}`",
            err=True,
        )
        raise typer.Exit(1)
    source = (
        f"{model.base_ms:.3f} ms + {model.per_seq_ms:.4f} ms per sequence "
        f"(calibrated: {calibrated} on {device})"
    )
    return model, source


@plan_app.command("batch")
def plan_batch_command(
    base_ms: Annotated[float, typer.Option(help="Fixed ms of one decode step.")] = 10.0,
    per_seq_ms: Annotated[float, typer.Option(help="Extra ms per sequence in the batch.")] = 0.4,
    floor: Annotated[
        float,
        typer.Option(help="Tokens/s every user must see (real time); 0 for none (offline)."),
    ] = 40.0,
    candidates: Annotated[
        str, typer.Option(help="Comma-separated batch sizes to tabulate.")
    ] = "10,20,30,40",
    max_batch_memory: Annotated[
        int | None,
        typer.Option(help="Sequences that fit in memory (see `offpeak plan memory`)."),
    ] = None,
    calibrated: Annotated[
        str | None,
        typer.Option(help="Use the step model `offpeak calibrate` measured for this model."),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(help="Device of the calibration (default: this host's; e.g. cpu)."),
    ] = None,
    plot: PlotOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Step time, tokens/s per user and in total by batch size; the largest batch that keeps
    every user at or above --floor (exact and among the candidates), capped by memory.

    Defaults are the worked example of docs/planning.md: 10 + 0.4 ms, 40 tokens/s, candidates
    10/20/30/40 give 30; the exact answer is 37. With --floor 0 (offline) the answer is
    --max-batch-memory.
    """
    model, source = _step_model(base_ms, per_seq_ms, calibrated, device)
    sizes = _int_list(candidates, "--candidates")
    floor_or_none = floor if floor > 0 else None
    # Candidates memory cannot hold are out whatever their speed.
    fitting = [b for b in sizes if max_batch_memory is None or b <= max_batch_memory]
    if floor_or_none is None:
        best = max(fitting, default=None)
    else:
        best = planner.best_candidate(model, fitting, floor_or_none)
    exact = planner.largest_batch(model, floor_or_none) if floor_or_none else None
    try:
        chosen: int | None = planner.largest_batch(model, floor_or_none, max_batch_memory)
    except ValueError:
        chosen = None  # no floor and no memory limit: unbounded
    notes = {b: "" for b in sizes}
    if best is not None:
        notes[best] = "best candidate"
    if exact:
        notes[exact] = "exact largest at the floor"
    if max_batch_memory:
        notes.setdefault(max_batch_memory, "memory limit")
    rows = planner.batch_table(model, sorted(notes))
    if plot is not None:
        _plot_batch(model, rows, floor_or_none, chosen, plot)
    summary = {
        "base_ms": model.base_ms,
        "per_seq_ms": model.per_seq_ms,
        "floor_tokens_per_s": floor_or_none,
        "rows": [{**asdict(r), "note": notes[r.batch]} for r in rows],
        "best_candidate": best,
        "exact_largest": exact,
        "max_batch_memory": max_batch_memory,
        "chosen": chosen,
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    _print_batch(summary, source, plot)


def _print_batch(summary: dict[str, Any], source: str, plot: Path | None) -> None:
    console = _console()
    floor = summary["floor_tokens_per_s"]
    table = Table(title=f"Step model: {source}")
    table.add_column("batch", justify="right")
    table.add_column("step ms", justify="right")
    table.add_column("each user tok/s", justify="right")
    table.add_column("total tok/s", justify="right")
    table.add_column("")
    for row in summary["rows"]:
        ok = floor is None or row["per_user_tokens_per_s"] >= floor * (1 - 1e-12)
        style = None if ok else "dim"
        table.add_row(
            str(row["batch"]),
            f"{row['step_ms']:.1f}",
            f"{row['per_user_tokens_per_s']:,.1f}",
            f"{row['total_tokens_per_s']:,.0f}",
            row["note"],
            style=style,
        )
    console.print(table)
    if floor is not None:
        best = summary["best_candidate"]
        console.print(
            f"Largest candidate at >= {floor:g} tokens/s per user: "
            + (str(best) if best is not None else "none")
        )
        console.print(
            f"Exact largest batch at >= {floor:g} tokens/s per user: {summary['exact_largest']}"
        )
    else:
        console.print("Offline (no per-user floor): the largest batch memory allows.")
    memory = summary["max_batch_memory"]
    if summary["chosen"] is None:
        console.print("Unbounded without a floor: pass --max-batch-memory (`offpeak plan memory`).")
    elif memory is not None:
        console.print(f"With memory for {memory:,} sequences: batch {summary['chosen']:,}")
    if plot is not None:
        console.print(f"plot written to {plot}")


def _plot_batch(
    model: StepModel,
    rows: list[planner.BatchRow],
    floor: float | None,
    chosen: int | None,
    path: Path,
) -> None:
    import numpy as np
    from matplotlib.figure import Figure

    largest = max([r.batch for r in rows] + [chosen or 0])
    batches = np.arange(1, max(2, math.ceil(largest * 1.1)) + 1)
    step_ms = model.base_ms + model.per_seq_ms * batches
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(batches, batches * 1000.0 / step_ms, color="#2a7ab9", label="total tokens/s")
    ax.scatter([r.batch for r in rows], [r.total_tokens_per_s for r in rows], color="#2a7ab9")
    ax.set_xlabel("batch size (sequences)")
    ax.set_ylabel("total tokens/s", color="#2a7ab9")
    users = ax.twinx()
    users.plot(batches, 1000.0 / step_ms, color="#d9534f", label="tokens/s each user sees")
    users.set_ylabel("tokens/s each user sees", color="#d9534f")
    if floor is not None:
        users.axhline(floor, color="#d9534f", linestyle=":", label=f"floor {floor:g} tokens/s")
    if chosen:
        ax.axvline(chosen, color="black", linestyle="--", linewidth=1, label=f"batch {chosen}")
    handles = ax.get_legend_handles_labels()
    more = users.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="center right", fontsize=8)
    ax.set_title(f"{model.base_ms:g} ms + {model.per_seq_ms:g} ms per sequence", fontsize=10)
    fig.savefig(path, dpi=100)


# --- simulate policies ------------------------------------------------------------------------


@simulate_app.command("policies")
def simulate_policies_command(
    rate: Annotated[float, typer.Option(help="Requests per second (Poisson arrivals).")] = 4.0,
    seconds: Annotated[float, typer.Option(help="Simulated duration, in seconds.")] = 120.0,
    min_reply: Annotated[int, typer.Option(help="Shortest reply, in tokens.")] = 50,
    max_reply: Annotated[int, typer.Option(help="Longest reply, in tokens (inclusive).")] = 500,
    base_ms: Annotated[float, typer.Option(help="Fixed ms of one decode step.")] = 10.0,
    per_seq_ms: Annotated[float, typer.Option(help="Extra ms per sequence in the batch.")] = 0.4,
    static_size: Annotated[int, typer.Option(help="Requests per static batch.")] = 8,
    max_batch: Annotated[int, typer.Option(help="Slots for continuous batching.")] = 32,
    seed: Annotated[int, typer.Option(help="Random seed (numpy default_rng).")] = 0,
    as_json: JsonFlag = False,
) -> None:
    """One at a time vs static batches vs continuous batching on one simulated device.

    Defaults are docs/planning.md's: 427 requests; 46 finished one at a time; continuous
    batching about ten times that throughput with nothing left queued.
    """
    from workers.sim.policies import simulate_policies

    try:
        workload, results = simulate_policies(
            rate, seconds, min_reply, max_reply, base_ms, per_seq_ms, static_size, max_batch, seed
        )
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "requests": len(workload.arrivals),
                    "seconds": seconds,
                    "policies": [asdict(r) for r in results],
                }
            )
        )
        return
    console = _console()
    console.print(f"{len(workload.arrivals):,} requests arrive over {seconds:g} s")
    table = Table()
    table.add_column("policy", no_wrap=True)
    for name in ("tokens/s", "finished", "median wait", "p95 wait", "still queued"):
        table.add_column(name, justify="right")
    for r in results:
        table.add_row(
            r.policy,
            f"{r.tokens_per_s:,.0f}",
            str(r.finished),
            f"{r.median_wait_s:.1f} s",
            f"{r.p95_wait_s:.1f} s",
            str(r.still_queued),
        )
    console.print(table)


# --- calibrate --------------------------------------------------------------------------------


def build_engine(model: str) -> Engine:
    """Load served model ``model`` into the real engine, as the worker does.

    Raises ``typer.BadParameter`` for a model the settings do not configure.
    """
    from workers.engine.vllm_engine import VllmEngine
    from workers.model_store import ensure_model

    settings = get_settings()
    if model not in settings.models:
        raise typer.BadParameter(
            f"unknown model {model!r}; configured: {', '.join(settings.models)}"
        )
    config = settings.models[model]
    return VllmEngine.load(model, config, ensure_model(model, config, settings.model_cache_dir))


def calibrate_command(
    model: Annotated[str, typer.Argument(help="A served model name from the settings.")],
    batch_sizes: Annotated[
        str, typer.Option(help="Comma-separated batch sizes to time.")
    ] = "1,8,32,64",
    decode_tokens: Annotated[
        int, typer.Option(help="Tokens each sequence generates per batch size.")
    ] = 32,
    device: Annotated[
        str | None, typer.Option(help="Device name to store under (default: detected).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Measure MODEL's decode step time at several batch sizes on this host and store the fitted
    base + per-sequence ms for `offpeak plan batch --calibrated MODEL` and the scheduler.
    """
    from workers.calibration import calibrate, current_device
    from workers.scheduler.chunking import engine_room

    settings = get_settings()
    sizes = _int_list(batch_sizes, "--batch-sizes")
    engine = build_engine(model)
    try:
        # The engine runs at most max_num_seqs at once (as loaded: an unset one is the
        # device's default); larger sizes would be mismeasured.
        limit = engine_room(engine, settings.models.get(model)).max_num_seqs
        sizes = [b for b in sizes if b <= limit] or [1, limit]
        result = calibrate(
            engine,
            sizes,
            decode_tokens,
            cache_dir=settings.model_cache_dir,
            device=device or current_device(),
        )
    finally:
        engine.close()
    if as_json:
        typer.echo(json.dumps(asdict(result)))
        return
    console = _console()
    table = Table(title=f"{result.model} on {result.device}")
    table.add_column("batch", justify="right")
    table.add_column("mean decode step ms", justify="right")
    table.add_column("steps timed", justify="right")
    table.add_column("fit ms", justify="right")
    for p in result.points:
        fit = result.step_model.step_ms(p.batch)
        table.add_row(str(p.batch), f"{p.step_ms:.2f}", str(p.steps), f"{fit:.2f}")
    console.print(table)
    console.print(
        f"step = {result.step_model.base_ms:.3f} ms + {result.step_model.per_seq_ms:.4f} ms "
        f"per sequence; stored in {settings.model_cache_dir / 'calibration.json'}"
    )
