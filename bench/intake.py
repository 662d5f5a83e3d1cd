"""Benchmark 2, intake: a generated JSONL file is uploaded, a batch is created on it, and the
control worker validates it into request rows. Measured from the first byte of the upload to the
batch being ``in_progress`` (every row stored), in MB/s and lines/s, against the time this
process takes merely to parse the same file with orjson; and the API process's peak RSS growth
while it receives the file (sampled every 10 ms).

Targets: at least 20 MB/s; RSS growth under 150 MB for a 200 MB file.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg

from bench import harness
from bench.generator import write_padded_file
from bench.harness import MB, MIB, RssSampler
from offpeak.statuses import BatchStatus

MODEL = "bench-model"
TARGET_MB_S = 20.0
TARGET_RSS_MB = 150.0


def parse_seconds(path: Path) -> float:
    """Seconds to read ``path`` and ``orjson.loads`` every line: the floor for any intake."""
    started = time.perf_counter()
    with path.open("rb") as handle:
        for line in handle:
            if line.strip():
                orjson.loads(line)
    return time.perf_counter() - started


def stored_rows(database_url: str, batch_id: str) -> int:
    with psycopg.connect(database_url.replace("+psycopg", "")) as conn:
        row = conn.execute("SELECT count(*) FROM requests WHERE batch_id = %s", [batch_id])
        return int(row.fetchone()[0])  # type: ignore[index]


def measure(path: Path, lines: int) -> dict[str, Any]:
    """One file through a fresh scratch service (API + control worker)."""
    size = path.stat().st_size
    parse = parse_seconds(path)
    with harness.scratch_service({MODEL: {"engine": "instant"}}, roles=("control",)) as service:
        client = service.client
        # The control worker must be consuming before the clock starts.
        small = path.parent / "small.jsonl"
        write_padded_file(small, 4, 4000, model=MODEL)
        warm = harness.create(client, harness.upload(client, small))
        harness.wait_status(
            client, warm.id, (BatchStatus.IN_PROGRESS,), stack=service.stack, timeout=120
        )
        load = harness.load_average()
        with RssSampler(service.pid("api")) as api_rss:
            started = time.perf_counter()
            file_id = harness.upload(client, path)
            uploaded = time.perf_counter()
        batch = harness.create(client, file_id)
        created = time.perf_counter()
        batch = harness.wait_status(
            client, batch.id, (BatchStatus.IN_PROGRESS,), stack=service.stack
        )
        ended = time.perf_counter()
        if batch.status != BatchStatus.IN_PROGRESS:
            raise RuntimeError(f"intake batch ended {batch.status}: {batch.errors}")
        rows = stored_rows(service.database_url, batch.id)
    total = ended - started
    return {
        "file_mb": size / MB,
        "lines": lines,
        "rows_stored": rows,
        "upload_s": uploaded - started,
        "create_s": created - uploaded,
        "validate_s": ended - created,
        "total_s": total,
        "mb_per_s": size / MB / total,
        "lines_per_s": lines / total,
        "orjson_parse_s": parse,
        "intake_over_parse": total / parse,
        "api_rss_baseline_mb": api_rss.baseline / MIB,
        "api_rss_peak_mb": api_rss.peak / MIB,
        "api_rss_growth_mb": api_rss.growth / MIB,
        "load_average": load,
    }


def run(
    lines: int = 50_000, megabytes: tuple[float, ...] = (100.0, 200.0), out_dir: Path | None = None
) -> dict[str, Any]:
    """Measure each file size (decimal MB) of ``lines`` lines; print the table, write
    ``intake.json`` and return the result."""
    machine = harness.machine()
    results = []
    with tempfile.TemporaryDirectory(prefix="offpeak-intake-") as tmp:
        for mb in megabytes:
            path = Path(tmp) / f"intake-{lines}-{mb:g}MB.jsonl"
            write_padded_file(path, lines, int(mb * MB), model=MODEL)
            results.append(measure(path, lines))
            path.unlink()
    first, biggest = results[0], max(results, key=lambda r: r["file_mb"])
    result = {
        "benchmark": "intake",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {"lines": lines, "megabytes": list(megabytes)},
        "runs": results,
        "targets": {
            "mb_per_s": TARGET_MB_S,
            "api_rss_growth_mb_at_largest": TARGET_RSS_MB,
        },
        "met": {
            "mb_per_s": first["mb_per_s"] >= TARGET_MB_S,
            "api_rss_growth_mb_at_largest": biggest["api_rss_growth_mb"] < TARGET_RSS_MB,
        },
    }
    harness.print_table(
        f"intake: upload + validation + rows stored (load {machine['load_average']})",
        ["file", "lines", "upload s", "validate s", "total s", "MB/s", "lines/s", "parse s",
         "× parse", "API RSS +MB"],
        [
            [f"{r['file_mb']:.0f} MB", r["lines"], r["upload_s"], r["validate_s"], r["total_s"],
             r["mb_per_s"], r["lines_per_s"], r["orjson_parse_s"], r["intake_over_parse"],
             r["api_rss_growth_mb"]]
            for r in results
        ],
    )  # fmt: skip
    path = harness.write_result("intake", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
