"""Benchmark 4, worker memory: the peak RSS of the engine worker (and of the control worker,
which validates and writes the output file) while a batch runs on the instant engine, for a
small and a ten times larger batch, each on a fresh scratch service after the same warm-up.

Target: the peak stays flat, i.e. it does not grow with the batch's size. Flat is
judged as a growth (peak minus the worker's RSS after warm-up) at the large size no more than
``FLAT_SLACK_MB`` above the small size's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import control, harness

#: MB of extra growth at the large size still called flat (allocator and sampling noise).
FLAT_SLACK_MB = 20.0


def run(small: int = 5_000, large: int = 50_000, out_dir: Path | None = None) -> dict[str, Any]:
    """Measure both sizes; print the table, write ``memory.json``."""
    machine = harness.machine()
    runs = [control.measure(lines) for lines in (small, large)]
    first, last = runs
    extra = {
        worker: last[f"{worker}_rss_growth_mb"] - first[f"{worker}_rss_growth_mb"]
        for worker in ("engine", "control")
    }
    result = {
        "benchmark": "memory",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {"small": small, "large": large, "engine": "instant"},
        "runs": runs,
        "growth_difference_mb": extra,
        "targets": {"flat_slack_mb": FLAT_SLACK_MB},
        "met": {f"{worker}_flat": extra[worker] <= FLAT_SLACK_MB for worker in extra},
    }
    harness.print_table(
        f"worker memory: peak RSS over a batch, instant engine (load {machine['load_average']})",
        ["lines", "engine base MB", "engine peak MB", "engine +MB", "control base MB",
         "control peak MB", "control +MB", "requests/s"],
        [[r["lines"], r["engine_rss_baseline_mb"], r["engine_rss_peak_mb"],
          r["engine_rss_growth_mb"], r["control_rss_baseline_mb"], r["control_rss_peak_mb"],
          r["control_rss_growth_mb"], r["requests_per_s"]] for r in runs],
    )  # fmt: skip
    path = harness.write_result("memory", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
