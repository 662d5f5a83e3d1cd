"""Benchmark, files of any size: a file of small request lines through every stage on the
instant engine (no model), once per size, each on a fresh scratch service whose
``max_file_bytes`` and ``max_requests_per_batch`` are raised to admit it. Stages, each timed on
its own: the upload, validation (create → ``in_progress``), the drain (→ ``finalizing``),
finalize (→ ``completed``), paging every result through ``GET /v1/batches/{id}/results`` and
downloading the output file (its lines counted as they arrive, not written to this machine's
disk: a fresh gigabyte written to the page cache costs more per byte than a few megabytes, which
would time the client's disk, not the service; ``docs/benchmarks.md``). The peak RSS of each
process (API, control worker, engine worker, and this benchmark's own, the client) is sampled
over all of them.

Targets against the smallest size, measured in the same run: every process's peak RSS at most
``TARGET_RSS_RATIO`` times as large (memory flat) and every stage's seconds per line at most
``TARGET_PER_LINE_RATIO`` times as long (time linear).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench.control import LINE_BYTES, MODEL, instant_service
from bench.generator import write_padded_file
from bench.harness import MB, MIB, RssSampler, Service
from offpeak.cli import partial_results
from offpeak.statuses import BatchStatus

TARGET_RSS_RATIO = 1.5
TARGET_PER_LINE_RATIO = 1.2
#: Seconds between RSS samples: coarse enough to leave the workers the CPU (each sample walks
#: ``/proc``), fine enough for stages that last seconds.
RSS_INTERVAL = 0.25
STAGES = ("upload", "validate", "drain", "finalize", "page", "download")
PROCESSES = ("api", "control", "engine", "client")


def _limits(lines: int, size: int) -> dict[str, str]:
    """The service's settings that admit a file of ``lines`` lines and ``size`` bytes (never
    below the defaults)."""
    return {
        "OFFPEAK_MAX_FILE_BYTES": str(max(200 * 1024 * 1024, size + (1 << 20))),
        "OFFPEAK_MAX_REQUESTS_PER_BATCH": str(max(50_000, lines)),
    }


def _page_all(service: Service, batch_id: str, path: Path) -> int:
    """Every result line of the batch through the results pages, appended to ``path`` as
    ``offpeak download --partial`` does; returns how many."""
    return partial_results.append_ready(service.client, batch_id, path)


def run_file(service: Service, path: Path, lines: int, folder: Path) -> dict[str, Any]:
    """Time each stage of ``path`` (``lines`` lines) on ``service``; raises ``RuntimeError``
    unless every line completed and both reads return every line."""
    client = service.client
    samplers = {
        "api": RssSampler(service.pid("api"), RSS_INTERVAL),
        "control": RssSampler(service.pid("control"), RSS_INTERVAL),
        "engine": RssSampler(service.pid("engine"), RSS_INTERVAL),
        "client": RssSampler(os.getpid(), RSS_INTERVAL),
    }
    load = harness.load_average()
    marks: dict[str, float] = {}
    for sampler in samplers.values():
        sampler.__enter__()
    try:
        started = time.perf_counter()
        file_id = harness.upload(client, path)
        marks["upload"] = time.perf_counter()
        batch = harness.create(client, file_id)
        while batch.status not in harness.ENDED:
            now = time.perf_counter()
            if batch.status in (BatchStatus.IN_PROGRESS, BatchStatus.FINALIZING):
                marks.setdefault("validate", now)
            if batch.status == BatchStatus.FINALIZING:
                marks.setdefault("drain", now)
            time.sleep(0.1)
            service.stack.check_alive()
            batch = client.batches.retrieve(batch.id)
        marks["finalize"] = time.perf_counter()
        # A stage too short for a poll to see ends where the next one does.
        marks.setdefault("drain", marks["finalize"])
        marks.setdefault("validate", marks["drain"])
        if batch.status != BatchStatus.COMPLETED or batch.output_file_id is None:
            raise RuntimeError(f"batch ended {batch.status}: {batch.errors}")
        paged_path = folder / "paged.jsonl"
        paged = _page_all(service, batch.id, paged_path)
        marks["page"] = time.perf_counter()
        out_bytes, out_lines = harness.download_lines(client, batch.output_file_id)
        marks["download"] = time.perf_counter()
    finally:
        for sampler in samplers.values():
            sampler.__exit__(None, None, None)
    counts = batch.request_counts
    if counts is None or counts.completed != lines or paged != lines or out_lines != lines:
        raise RuntimeError(
            f"{counts} completed, {paged} paged, {out_lines} downloaded, of {lines} lines"
        )
    paged_path.unlink()
    seconds, before = {}, started
    for stage in STAGES:
        seconds[stage] = marks[stage] - before
        before = marks[stage]
    rss: dict[str, dict[str, float]] = {}
    for name, sampler in samplers.items():
        # The client's own samples hold the service too (its children): only its own process.
        own = name == "client"
        base = sampler.parts_baseline.get("root", 0) if own else sampler.baseline
        peak = sampler.parts_peak.get("root", 0) if own else sampler.peak
        rss[name] = {"baseline_mb": base / MIB, "peak_mb": peak / MIB}
    total = marks["download"] - started
    return {
        "lines": lines,
        "file_mb": path.stat().st_size / MB,
        "output_mb": out_bytes / MB,
        "stage_s": seconds,
        "stage_us_per_line": {stage: s / lines * 1e6 for stage, s in seconds.items()},
        "total_s": total,
        "lines_per_s": lines / total,
        "rss": rss,
        "load_average": load,
        "load_average_end": harness.load_average(),
    }


def measure(lines: int, line_bytes: int = LINE_BYTES) -> dict[str, Any]:
    """One ``lines``-line file (``line_bytes`` bytes a line) on a fresh scratch service, after
    the same warm-up batch, so every size starts from the same worker state."""
    with tempfile.TemporaryDirectory(prefix="offpeak-large-file-") as tmp:
        folder = Path(tmp)
        path = folder / f"large-{lines}.jsonl"
        size = write_padded_file(path, lines, lines * line_bytes, model=MODEL)
        with instant_service(env=_limits(lines, size)) as service:
            harness.warm_up(service, MODEL, folder)
            return run_file(service, path, lines, folder)


def ratios(small: dict[str, Any], large: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``large`` over ``small``: each process's peak RSS and each stage's seconds per line."""
    return {
        "rss_peak": {p: large["rss"][p]["peak_mb"] / small["rss"][p]["peak_mb"] for p in PROCESSES},
        "us_per_line": {
            s: large["stage_us_per_line"][s] / max(small["stage_us_per_line"][s], 1e-9)
            for s in STAGES
        },
    }


def run(
    sizes: tuple[int, ...] = (50_000, 2_000_000), out_dir: Path | None = None
) -> dict[str, Any]:
    """Measure each size (lines) in order; ratios are against the first. Prints the tables and
    writes ``large-file.json`` (after each size, so a long run leaves what finished)."""
    machine = harness.machine()
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {}
    for lines in sizes:
        runs.append(measure(lines))
        base = runs[0]
        by_size = [ratios(base, r) | {"lines": r["lines"]} for r in runs[1:]]
        result = {
            "benchmark": "large-file",
            "machine": machine,
            "load_average_end": harness.load_average(),
            "params": {"sizes": list(sizes), "line_bytes": LINE_BYTES, "engine": "instant"},
            "runs": runs,
            "ratios": by_size,
            "targets": {"rss_ratio": TARGET_RSS_RATIO, "per_line_ratio": TARGET_PER_LINE_RATIO},
            "met": {
                "rss_flat": all(
                    v <= TARGET_RSS_RATIO for r in by_size for v in r["rss_peak"].values()
                ),
                "time_linear": all(
                    v <= TARGET_PER_LINE_RATIO for r in by_size for v in r["us_per_line"].values()
                ),
            },
        }
        path = harness.write_result("large-file", result, out_dir)
    _print(result)
    harness.console.print(f"wrote {path}")
    return result


def _print(result: dict[str, Any]) -> None:
    runs = result["runs"]
    harness.print_table(
        f"files of any size: µs per line by stage, instant engine (load "
        f"{result['machine']['load_average']})",
        ["lines", "file MB", *(f"{s} µs/line" for s in STAGES), "total s", "lines/s"],
        [[r["lines"], r["file_mb"], *(r["stage_us_per_line"][s] for s in STAGES), r["total_s"],
          r["lines_per_s"]] for r in runs],
    )  # fmt: skip
    harness.print_table(
        "peak RSS MB by process (baseline after warm-up → peak)",
        ["lines", *PROCESSES],
        [[r["lines"], *(f"{r['rss'][p]['baseline_mb']:.0f} → {r['rss'][p]['peak_mb']:.0f}"
                        for p in PROCESSES)] for r in runs],
    )  # fmt: skip
    harness.print_table(
        f"large / smallest (targets: RSS ≤ {TARGET_RSS_RATIO}×, µs/line ≤ "
        f"{TARGET_PER_LINE_RATIO}×)",
        ["lines", *(f"{p} RSS" for p in PROCESSES), *(f"{s} µs/line" for s in STAGES)],
        [[r["lines"], *(r["rss_peak"][p] for p in PROCESSES),
          *(r["us_per_line"][s] for s in STAGES)] for r in result["ratios"]],
    )  # fmt: skip
