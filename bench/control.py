"""Benchmark 3, the control plane: a batch on the instant engine (a fixed short answer, no
model) through PostgreSQL and Redis, timed from ``batches.create`` to the output file downloaded,
so everything but the model is measured: validation, claims, results, counts, finalization and
the output file. Phases come from polling the batch every 100 ms.

Target (issue 6): at least 3,000 requests/s on this 2-core machine for 50,000 lines, so the
service never starves a GPU.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench.generator import write_padded_file
from bench.harness import MB, MIB, RssSampler, Service

MODEL = "bench-model"
TARGET_REQUESTS_PER_S = 3000.0
#: Bytes per request line: a short chat request (a sentence of user content).
LINE_BYTES = 256


def instant_service(**kwargs: Any) -> Any:
    """A scratch service whose one model runs on the instant engine."""
    return harness.scratch_service({MODEL: {"engine": "instant"}}, **kwargs)


def run_batch(service: Service, folder: Path, lines: int) -> dict[str, Any]:
    """Upload a ``lines``-line file (not timed), then time create → completed → output file
    downloaded, sampling the workers' RSS. Raises ``RuntimeError`` unless every line succeeded."""
    path = folder / f"control-{lines}.jsonl"
    size = write_padded_file(path, lines, lines * LINE_BYTES, model=MODEL)
    client = service.client
    file_id = harness.upload(client, path)
    load = harness.load_average()
    phases: dict[str, float] = {}
    with (
        RssSampler(service.pid("engine")) as engine_rss,
        RssSampler(service.pid("control")) as control_rss,
    ):
        started = time.perf_counter()
        batch = harness.create(client, file_id)
        while batch.status not in harness.ENDED:
            phases.setdefault(batch.status, time.perf_counter() - started)
            time.sleep(0.1)
            service.stack.check_alive()
            batch = client.batches.retrieve(batch.id)
        ended = time.perf_counter()
        if batch.status != "completed" or batch.output_file_id is None:
            raise RuntimeError(f"batch ended {batch.status}: {batch.errors}")
        output = folder / f"control-{lines}.out.jsonl"
        out_bytes = harness.download(client, batch.output_file_id, output)
        downloaded = time.perf_counter()
    counts = batch.request_counts
    assert counts is not None
    if counts.completed != lines:
        raise RuntimeError(f"{counts.completed} of {lines} lines completed")
    total = downloaded - started
    in_progress = phases.get("in_progress", 0.0)
    finalizing = phases.get("finalizing", ended - started)
    path.unlink()
    output.unlink()
    return {
        "lines": lines,
        "input_mb": size / MB,
        "output_mb": out_bytes / MB,
        "validate_s": in_progress,
        "run_s": finalizing - in_progress,
        "finalize_s": ended - started - finalizing,
        "download_s": downloaded - ended,
        "total_s": total,
        "requests_per_s": lines / total,
        "engine_rss_baseline_mb": engine_rss.baseline / MIB,
        "engine_rss_peak_mb": engine_rss.peak / MIB,
        "engine_rss_growth_mb": engine_rss.growth / MIB,
        "control_rss_baseline_mb": control_rss.baseline / MIB,
        "control_rss_peak_mb": control_rss.peak / MIB,
        "control_rss_growth_mb": control_rss.growth / MIB,
        "load_average": load,
    }


def measure(lines: int) -> dict[str, Any]:
    """``run_batch`` on a fresh scratch service (API, control and engine worker) after a
    warm-up batch, so every size starts from the same worker state."""
    with (
        tempfile.TemporaryDirectory(prefix="offpeak-control-") as tmp,
        instant_service() as service,
    ):
        harness.warm_up(service, MODEL, Path(tmp))
        return run_batch(service, Path(tmp), lines)


def run(lines: int = 50_000, out_dir: Path | None = None) -> dict[str, Any]:
    """Measure one ``lines``-line batch; print the table, write ``control.json``."""
    machine = harness.machine()
    r = measure(lines)
    result = {
        "benchmark": "control",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {"lines": lines, "line_bytes": LINE_BYTES, "engine": "instant"},
        "runs": [r],
        "targets": {"requests_per_s": TARGET_REQUESTS_PER_S},
        "met": {"requests_per_s": r["requests_per_s"] >= TARGET_REQUESTS_PER_S},
    }
    harness.print_table(
        f"control plane: instant engine, create → completed → output downloaded "
        f"(load {machine['load_average']})",
        ["lines", "validate s", "run s", "finalize s", "download s", "total s", "requests/s"],
        [[r["lines"], r["validate_s"], r["run_s"], r["finalize_s"], r["download_s"],
          r["total_s"], r["requests_per_s"]]],
    )  # fmt: skip
    path = harness.write_result("control", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
