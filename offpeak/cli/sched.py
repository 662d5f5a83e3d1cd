"""`offpeak pause`, `offpeak resume` and `offpeak simulate day`: the scheduler's commands
(`offpeak pause BATCH_ID` pauses one batch through the API: ``batch_commands.pause_batch``).

``pause``/``resume`` flip the admin switch in the database (the same switch as
``POST /v1/admin/scheduler/pause``), so they work wherever the settings reach the database, API up
or not. ``simulate day`` replays a day of real-time load and batch arrivals through the real
scheduler on a virtual clock (``workers.sim.day``); ``simulate colocate`` runs the batch lane's
controller against a simulated shared real-time server (``workers.sim.colocate``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Annotated

import typer
from rich.console import Console

from offpeak.settings import get_settings

PoolOption = Annotated[
    str, typer.Option("--pool", help="A worker pool (OFFPEAK_SCHEDULER__POOL), or * for all.")
]


BatchArgument = Annotated[
    str | None,
    typer.Argument(help="A batch to pause or resume alone (through the API) instead of a pool."),
]


def pause_command(
    batch_id: BatchArgument = None,
    pool: PoolOption = "*",
    hard: Annotated[
        bool, typer.Option("--hard", help="Stop urgent batches too (windows may be missed).")
    ] = False,
    reason: Annotated[str | None, typer.Option(help="Shown in logs and the admin view.")] = None,
) -> None:
    """Pause batch work: workers yield as they do to high load (urgent batches keep running
    unless --hard) within one load poll, until `offpeak resume`. With BATCH_ID, pause that
    batch alone (`offpeak resume BATCH_ID` resumes it)."""
    if batch_id is not None:
        from offpeak.cli.batch_commands import pause_batch

        pause_batch(batch_id, paused=True)
        return
    from storage.db import session_scope
    from storage.repositories import scheduler as scheduler_repo

    with session_scope(get_settings().resolved_database_url) as session:
        switch = scheduler_repo.pause(session, pool, hard=hard, reason=reason, at=time.time())
    kind = "hard-paused" if switch.hard else "paused"
    Console().print(
        f"batch work {kind} on pool {switch.pool!r}" + (f": {reason}" if reason else "")
    )


def resume_command(batch_id: BatchArgument = None, pool: PoolOption = "*") -> None:
    """Resume batch work paused with `offpeak pause` (the load signals still apply); with
    BATCH_ID, that batch."""
    if batch_id is not None:
        from offpeak.cli.batch_commands import pause_batch

        pause_batch(batch_id, paused=False)
        return
    from storage.db import session_scope
    from storage.repositories import scheduler as scheduler_repo

    with session_scope(get_settings().resolved_database_url) as session:
        switch = scheduler_repo.resume(session, pool, at=time.time())
    if switch.paused:
        Console().print(f"pool {switch.pool!r} resumed, but {switch.reason}")
    else:
        Console().print(f"batch work resumed on pool {switch.pool!r}")


def _curve(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise typer.BadParameter("24 comma-separated numbers, one per hour") from None
    if len(values) != 24 or min(values) < 0:
        raise typer.BadParameter("24 comma-separated non-negative loads, one per hour")
    return values


def simulate_day_command(
    hours: Annotated[float, typer.Option(help="Simulated hours measured.")] = 24.0,
    start_hour: Annotated[float, typer.Option(help="Hour of day the replay starts.")] = 8.0,
    load_curve: Annotated[
        str | None,
        typer.Option(help="24 comma-separated hourly real-time loads (0 idle, 1 saturated)."),
    ] = None,
    trough: Annotated[float, typer.Option(help="Lowest load of the default curve (02:00).")] = 0.05,
    peak: Annotated[float, typer.Option(help="Highest load of the default curve (14:00).")] = 0.85,
    noise: Annotated[float, typer.Option(help="Smooth random noise on the load, ±.")] = 0.03,
    fill: Annotated[
        float, typer.Option(help="Batch work offered, as a multiple of the valleys' capacity.")
    ] = 1.2,
    batches: Annotated[int, typer.Option(help="Batches submitted over the day.")] = 40,
    arrivals_from: Annotated[float, typer.Option(help="First hour batches arrive.")] = 8.0,
    arrivals_to: Annotated[float, typer.Option(help="Hour batches stop arriving.")] = 20.0,
    min_reply: Annotated[int, typer.Option(help="Shortest reply, in tokens.")] = 400,
    max_reply: Annotated[int, typer.Option(help="Longest reply, in tokens.")] = 2400,
    window: Annotated[str, typer.Option(help="Each batch's completion_window.")] = "24h",
    base_ms: Annotated[float, typer.Option(help="Fixed ms of one decode step.")] = 10.0,
    per_seq_ms: Annotated[float, typer.Option(help="Extra ms per running sequence.")] = 0.4,
    max_num_seqs: Annotated[int, typer.Option(help="The engine's sequence limit.")] = 256,
    low_water: Annotated[
        float | None, typer.Option(help="Override the configured low-water mark.")
    ] = None,
    high_water: Annotated[
        float | None, typer.Option(help="Override the configured high-water mark.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Random seed (load noise, arrivals).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Replay a day of real-time load and batch arrivals through the real scheduler, with the
    default step model (10 ms + 0.4 ms per sequence) on a virtual clock; the configured scheduler
    settings apply (its load signals are replaced by the curve)."""
    from workers.sim.day import DayParams, simulate_day
    from workers.sim.load import diurnal_curve

    policy = get_settings().scheduler
    changes = {
        k: v for k, v in (("low_water", low_water), ("high_water", high_water)) if v is not None
    }
    try:
        policy = policy.model_validate(policy.model_dump() | changes)
        params = DayParams(
            hours=hours,
            start_hour=start_hour,
            load_curve=_curve(load_curve) or tuple(diurnal_curve(trough, peak)),
            noise=noise,
            fill=fill,
            batches=batches,
            arrivals_from_hour=arrivals_from,
            arrivals_to_hour=arrivals_to,
            min_reply=min_reply,
            max_reply=max_reply,
            window=window,
            base_ms=base_ms,
            per_seq_ms=per_seq_ms,
            max_num_seqs=max_num_seqs,
            seed=seed,
        )
        report = simulate_day(params, policy)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    summary = {
        "batches": report.batches,
        "inside_window": report.inside_window,
        "inside_window_pct": round(report.inside_window_pct, 2),
        "expired": report.expired,
        "completion_tokens": report.completion_tokens,
        "prompt_tokens": report.prompt_tokens,
        "cached_tokens": report.cached_tokens,
        "valley_seconds": report.valley_seconds,
        "valley_busy_seconds": round(report.valley_busy_seconds, 1),
        "valley_used_pct": round(report.valley_used_pct, 2),
        "busy_above_high_seconds": round(report.busy_above_high_seconds, 2),
        "busy_seconds": round(report.busy_seconds, 1),
        "gate_changes": report.gate_changes,
        "yields": report.yields,
        "aborted_sequences": report.aborted,
        "urgent_batches": report.urgent_batches,
        "last_end_hours": round(report.last_end_hours, 2),
        "wall_seconds": round(report.wall_seconds, 2),
        "low_water": report.low_water,
        "high_water": report.high_water,
        "params": asdict(params),
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    _print_day(report)


def _print_day(report) -> None:  # type: ignore[no-untyped-def]
    p = report.params
    hit = report.cached_tokens / report.prompt_tokens if report.prompt_tokens else 0.0
    start = f"{int(p.start_hour):02d}:{int(p.start_hour % 1 * 60):02d}"
    lines = [
        f"Simulated {p.hours:g} h from {start}: {report.batches} batches arriving "
        f"{p.arrivals_from_hour:g}-{p.arrivals_to_hour:g} h, {p.fill:g}x the valleys' capacity",
        f"step {p.base_ms:g} ms + {p.per_seq_ms:g} ms x {p.max_num_seqs} sequences; "
        f"water marks {report.low_water:g} / {report.high_water:g}",
        "",
        f"batches finished inside their window  {report.inside_window}/{report.batches} "
        f"({report.inside_window_pct:.1f}%)",
        f"batch tokens served                   {report.completion_tokens:,} completion",
        f"                                      {report.prompt_tokens:,} prompt "
        f"({100 * hit:.0f}% from the prefix cache)",
        f"valley idle capacity used             {report.valley_used_pct:.1f}% "
        f"({report.valley_busy_seconds / 3600:.2f} of {report.valley_seconds / 3600:.2f} h)",
        f"batch work while load > high-water    {report.busy_above_high_seconds:.1f} s",
        f"gate changes, yields, aborted seqs    {report.gate_changes}, {report.yields}, "
        f"{report.aborted:,}",
        f"batches that became urgent            {report.urgent_batches}",
        f"last batch ended                      {report.last_end_hours:.1f} h after the start",
        f"wall time                             {report.wall_seconds:.1f} s",
    ]
    console = Console()
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)


def simulate_colocate_command(
    base_ms: Annotated[float, typer.Option(help="Fixed ms of one decode step.")] = 10.0,
    per_seq_ms: Annotated[float, typer.Option(help="Extra ms per running sequence.")] = 0.4,
    max_num_seqs: Annotated[int, typer.Option(help="The server's sequence limit.")] = 256,
    phase_seconds: Annotated[float, typer.Option(help="Seconds of each phase.")] = 300.0,
    quiet: Annotated[
        float, typer.Option(help="Quiet real-time rate, a fraction of the real-time capacity.")
    ] = 0.2,
    busy: Annotated[
        float, typer.Option(help="Busy real-time rate, a fraction of the real-time capacity.")
    ] = 0.8,
    seed: Annotated[int, typer.Option(help="Random seed (arrivals).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """The batch lane's controller against a simulated real-time server sharing its steps (default:
    the step model's GPU-like 10 ms + 0.4 ms per sequence): real-time alone, batch with the lane
    off, batch with the lane at the configured settings; per phase quiet, busy, quiet."""
    from workers.sim.colocate import ColocateParams, simulate_colocate

    try:
        params = ColocateParams(
            base_ms=base_ms,
            per_seq_ms=per_seq_ms,
            max_num_seqs=max_num_seqs,
            phase_seconds=phase_seconds,
            quiet=quiet,
            busy=busy,
            seed=seed,
        )
        summary = simulate_colocate(params, get_settings().scheduler.lane)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if as_json:
        typer.echo(json.dumps(summary))
        return
    console = Console()
    console.print(
        f"step {base_ms:g} ms + {per_seq_ms:g} ms x sequences, max_num_seqs {max_num_seqs}; TPOT "
        f"target {1000 * summary['tpot_target_s']:.1f} ms -> {summary['floor_batch']} sequences "
        "at the floor",
        highlight=False,
    )

    def ms(x: float | None) -> str:
        return "   n/a" if x is None else f"{1000 * x:6.1f}"

    console.print(
        "leg phase        rt/s  served  TTFT p95  TPOT p50  TPOT p95  batch tok/s  bound tok/s",
        highlight=False,
    )
    for leg, phases in summary["legs"].items():
        for ph in phases:
            console.print(
                f"({leg}) {ph['name']:<11} {ph['rate_per_s']:5.2f} {ph['served']:7d}  "
                f"{ms(ph['ttft_p95'])}    {ms(ph['tpot_p50'])}    {ms(ph['tpot_p95'])}  "
                f"{ph['batch_tokens_per_s']:11,.0f}  {ph['bound_tokens_per_s']:11,.0f}",
                highlight=False,
            )
    harvest = ", ".join("n/a" if h is None else f"{100 * h:.0f}%" for h in summary["harvest"])
    console.print(f"harvest (c) per phase, batch tokens/s over the bound: {harvest}")
