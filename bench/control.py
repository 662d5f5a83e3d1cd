"""Benchmark 3, the control plane: a batch on the instant engine (a fixed short answer, no
model) through PostgreSQL and Redis, timed from ``batches.create`` to the output file downloaded,
so everything but the model is measured: validation, claims, results, counts, finalization and
the output file. Phases come from polling the batch every 100 ms.

Targets, so the service never starves a GPU: at least 10,000 requests/s for 50,000 lines on a 2-core
machine, and at least half the database's own floor measured in the same run on the same database
(``floor``): the same row transitions in bare SQL with no Python between them: the lines COPYed in,
the claim UPDATEs in the runner's chunk size, the result UPDATEs with the batch's counters, and the
output read back.
"""

from __future__ import annotations

import re
import secrets
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psycopg
import psycopg.sql

from bench import harness
from bench.generator import write_padded_file
from bench.harness import MB, MIB, RssSampler, Service

MODEL = "bench-model"
TARGET_REQUESTS_PER_S = 10_000.0
#: Offpeak's requests/s over the floor's.
TARGET_FLOOR_RATIO = 0.5
#: The floor's model: no worker serves it, so nothing but the floor touches its rows.
FLOOR_MODEL = "bench-floor"
#: Bytes per request line: a short chat request (a sentence of user content).
LINE_BYTES = 256
#: Seconds between the workers' RSS samples. Each sample walks ``/proc`` for the process tree:
#: at the sampler's default 10 ms the samplers would take CPU from Offpeak but not the floor.
RSS_INTERVAL = 0.25


#: The floor's row transitions in one procedure: per chunk, the claim's UPDATE (the ordered index
#: range scan, ``FOR UPDATE SKIP LOCKED``, lease, attempt) and the write-back's UPDATE (fenced on
#: owner and status, the output line, the tokens) with the batch's counters, each chunk its own
#: transaction as the runner's are. Server-side seconds come back in the INOUT parameters.
FLOOR_PROCEDURE = """
CREATE OR REPLACE PROCEDURE offpeak_bench_floor(
    p_batch text, p_model text, p_chunk int, p_template text,
    INOUT claim_s double precision DEFAULT 0, INOUT write_s double precision DEFAULT 0,
    INOUT chunks int DEFAULT 0)
LANGUAGE plpgsql AS $$
DECLARE
    ids bigint[];
    t timestamptz;
    now_s double precision;
BEGIN
    LOOP
        t := clock_timestamp();
        now_s := extract(epoch FROM t);
        WITH c AS (
            UPDATE requests SET status = 'running', lease_owner = 'floor',
                lease_expires_at = now_s + 120, attempts = attempts + 1
            WHERE id IN (
                SELECT id FROM requests
                WHERE model = p_model AND status = 'pending' AND deadline > floor(now_s)::bigint
                  AND batch_id = ANY (ARRAY[p_batch])
                ORDER BY deadline, id LIMIT p_chunk FOR UPDATE SKIP LOCKED)
            RETURNING id, line_json)
        SELECT array_agg(id) INTO ids FROM c WHERE length(line_json) > 0;
        COMMIT;
        claim_s := claim_s + extract(epoch FROM clock_timestamp() - t);
        EXIT WHEN ids IS NULL;
        chunks := chunks + 1;
        t := clock_timestamp();
        WITH w AS (
            UPDATE requests AS q SET status = 'succeeded', status_code = 200,
                result = replace(p_template, '@CUSTOM_ID@', q.custom_id),
                prompt_tokens = 60, cached_tokens = 0, completion_tokens = 2,
                finished_at = now_s, lease_owner = NULL, lease_expires_at = NULL
            FROM unnest(ids) AS r(id)
            WHERE q.id = r.id AND q.lease_owner = 'floor' AND q.status = 'running'
            RETURNING q.batch_id, q.prompt_tokens, q.completion_tokens)
        UPDATE batches AS b SET completed = b.completed + s.n,
            input_tokens = b.input_tokens + s.p, output_tokens = b.output_tokens + s.c
        FROM (SELECT batch_id, count(*) AS n, sum(prompt_tokens) AS p,
                     sum(completion_tokens) AS c FROM w GROUP BY batch_id) AS s
        WHERE b.id = s.batch_id;
        COMMIT;
        write_s := write_s + extract(epoch FROM clock_timestamp() - t);
    END LOOP;
END $$
"""

_INTAKE = (
    "batch_id, line, custom_id, model, deadline, line_json, status, prompt_tokens, "
    "cached_tokens, completion_tokens, attempts"
)


def _copy_text(value: str) -> str:
    """``value`` escaped for COPY's text format."""
    return (
        value.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    )


def floor(
    database_url: str, like_batch: str, input_path: Path, output_line: str, chunk: int
) -> dict[str, Any]:
    """The database's floor for the same batch: ``input_path``'s lines COPYed into a copy of
    batch ``like_batch`` (one transaction, as intake's), ``offpeak_bench_floor`` (claims of
    ``chunk`` lines and their result UPDATEs, each its own transaction), then ``COPY … TO
    STDOUT`` of the output rows in line order, as finalize reads them. ``output_line`` (a real
    output line of the Offpeak leg, its custom_id replaced by each row's) is every row's result.
    The COPY buffer is built before the clock starts. Seconds of each phase; the rows are
    deleted afterwards."""
    conninfo = database_url.replace("postgresql+psycopg://", "postgresql://")
    floor_id = f"batch_floor_{secrets.token_hex(6)}"
    with input_path.open("rb") as handle:
        raw_lines = [raw.rstrip(b"\n").decode() for raw in handle if raw.strip()]
    first = orjson.loads(output_line)
    template = output_line.replace(orjson.dumps(first["custom_id"]).decode(), '"@CUSTOM_ID@"', 1)
    deadline = int(time.time()) + 86_400
    buffer = "".join(
        f"{floor_id}\t{n}\t{orjson.loads(raw)['custom_id']}\t{FLOOR_MODEL}\t{deadline}\t"
        f"{_copy_text(raw)}\tpending\t0\t0\t0\t0\n"
        for n, raw in enumerate(raw_lines, start=1)
    ).encode()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(FLOOR_PROCEDURE)
        conn.execute("DROP TABLE IF EXISTS floor_batch")
        conn.execute(
            "CREATE TEMP TABLE floor_batch AS SELECT * FROM batches WHERE id = %s", (like_batch,)
        )
        conn.execute(
            "UPDATE floor_batch SET id = %s, status = 'in_progress', model = %s, completed = 0, "
            "failed = 0, input_tokens = 0, cached_tokens = 0, output_tokens = 0, "
            "output_file_id = NULL",
            (floor_id, FLOOR_MODEL),
        )
        started = time.perf_counter()
        with conn.transaction(), conn.cursor() as cursor:
            cursor.execute("INSERT INTO batches SELECT * FROM floor_batch")
            with cursor.copy(f"COPY requests ({_INTAKE}) FROM STDIN") as copy:
                copy.write(buffer)
        copied = time.perf_counter()
        row = conn.execute(
            "CALL offpeak_bench_floor(%s, %s, %s, %s)", (floor_id, FLOOR_MODEL, chunk, template)
        ).fetchone()
        ran = time.perf_counter()
        assert row is not None
        out_bytes = 0
        # As finalize reads them (``requests.iter_finished``), in line order.
        query = psycopg.sql.SQL(
            "COPY (SELECT custom_id, status, result FROM requests WHERE batch_id = {} "
            "ORDER BY line) TO STDOUT"
        ).format(psycopg.sql.Literal(floor_id))
        with conn.cursor() as cursor, cursor.copy(query) as copy:
            for block in copy:
                out_bytes += len(block)
        read = time.perf_counter()
        done = conn.execute("SELECT completed FROM batches WHERE id = %s", (floor_id,)).fetchone()
        # Timed: the retention sweep's work for a batch, in one statement rather than pieces.
        with conn.transaction():
            conn.execute("DELETE FROM requests WHERE batch_id = %s", (floor_id,))
            conn.execute("DELETE FROM batches WHERE id = %s", (floor_id,))
        deleted = time.perf_counter()
        conn.execute("DROP PROCEDURE offpeak_bench_floor")
    lines = len(raw_lines)
    if done is None or done[0] != lines:
        raise RuntimeError(f"floor completed {done} of {lines} lines")
    total = read - started
    return {
        "lines": lines,
        "chunk": chunk,
        "chunks": row[2],
        "copy_s": copied - started,
        "claim_s": row[0],
        "write_s": row[1],
        "call_s": ran - copied,
        "read_s": read - ran,
        "read_mb": out_bytes / MB,
        "delete_s": deleted - read,
        "total_s": total,
        "requests_per_s": lines / total,
    }


def requests_footprint(database_url: str) -> dict[str, float]:
    """Bytes of the ``requests`` table per row it holds: on disk (heap with TOAST, and its
    indexes, dead versions not yet vacuumed included) and of the live rows themselves."""
    conninfo = database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), coalesce(sum(pg_column_size(r.*)), 0), "
            "pg_table_size('requests'), pg_indexes_size('requests') FROM requests AS r"
        ).fetchone()
    assert row is not None
    rows = max(row[0], 1)
    return {
        "rows": row[0],
        "live_row_bytes": row[1] / rows,
        "table_bytes": row[2] / rows,
        "index_bytes": row[3] / rows,
    }


def instant_service(**kwargs: Any) -> Any:
    """A scratch service whose one model runs on the instant engine."""
    return harness.scratch_service({MODEL: {"engine": "instant"}}, **kwargs)


def claim_sizes(service: Service, name: str = "engine") -> list[int]:
    """Engine worker ``name``'s claims so far (lines each), from its log's "claimed N lines"."""
    text = (service.stack.log_dir / f"{name}.log").read_text(errors="replace")
    return [int(m) for m in re.findall(r": claimed (\d+) lines", text)]


def engine_names(service: Service) -> list[str]:
    """The running engine workers' process names: ``engine``, then ``engine2``, ``engine3``, …"""
    return [name for name in service.stack.procs if name.startswith("engine")]


def add_engine_workers(service: Service, count: int, timeout: float = 300.0) -> None:
    """Start engine workers ``engine2`` … ``engine<count>`` beside the first, each its own
    process, and wait until ``count`` engine workers have registered ready. Raises
    ``TimeoutError`` with their logs otherwise."""
    for n in range(2, count + 1):
        service.stack.start_worker("engine", f"engine{n}")
    conninfo = service.database_url.replace("postgresql+psycopg://", "postgresql://")
    deadline = time.monotonic() + timeout
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FROM workers WHERE ready AND role = 'engine'"
            ).fetchone()
            if row is not None and row[0] >= count:
                return
            service.stack.check_alive()
            if time.monotonic() > deadline:
                logs = "\n".join(service.stack.tail(n) for n in engine_names(service))
                raise TimeoutError(f"{row} of {count} engine workers ready:\n{logs}")
            time.sleep(0.2)


def run_batch(
    service: Service, folder: Path, lines: int, *, with_floor: bool = False
) -> dict[str, Any]:
    """Upload a ``lines``-line file (not timed), then time create → completed → output file
    downloaded, sampling the workers' RSS. Raises ``RuntimeError`` unless every line succeeded.

    ``with_floor``: then stop the control worker (its sweep would finalize the floor's batch)
    and measure ``floor`` on the same file and database, in the mean chunk size of this batch's
    claims; the result gets ``floor`` and ``floor_ratio`` (Offpeak's requests/s over the
    floor's)."""
    names = engine_names(service)
    claims_before = {name: len(claim_sizes(service, name)) for name in names}
    path = folder / f"control-{lines}.jsonl"
    size = write_padded_file(path, lines, lines * LINE_BYTES, model=MODEL)
    client = service.client
    file_id = harness.upload(client, path)
    load = harness.load_average()
    phases: dict[str, float] = {}
    with (
        RssSampler(service.pid("engine"), RSS_INTERVAL) as engine_rss,
        RssSampler(service.pid("control"), RSS_INTERVAL) as control_rss,
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
    extra: dict[str, Any] = {}
    by_worker = {name: claim_sizes(service, name)[claims_before[name] :] for name in names}
    sizes = [size for worker in by_worker.values() for size in worker]
    extra["lines_by_engine_worker"] = [sum(worker) for worker in by_worker.values()]
    extra["requests_per_row"] = requests_footprint(service.database_url)
    if with_floor:
        chunk = round(sum(sizes) / len(sizes)) if sizes else 1024
        with output.open() as handle:
            first_line = handle.readline().rstrip("\n")
        service.stack.kill("control", signal.SIGTERM)
        extra["claims"] = len(sizes)
        extra["floor"] = floor(service.database_url, batch.id, path, first_line, chunk)
        extra["floor_ratio"] = (lines / total) / extra["floor"]["requests_per_s"]
    path.unlink()
    output.unlink()
    return extra | {
        "engine_workers": len(names),
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


def measure(
    lines: int,
    *,
    engine_workers: int = 1,
    with_floor: bool = False,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """``run_batch`` on a fresh scratch service (API, control worker and ``engine_workers``
    engine worker processes, all on one database) after a warm-up batch, so every size starts
    from the same worker state. ``profile_dir``: the
    workers run their tasks under cProfile (``workers.profiling``) and write ``.prof`` files
    there (the profiler slows them: a profiled run's figures are not the benchmark's)."""
    env = {"OFFPEAK_PROFILE_DIR": str(profile_dir)} if profile_dir else None
    with (
        tempfile.TemporaryDirectory(prefix="offpeak-control-") as tmp,
        instant_service(env=env) as service,
    ):
        add_engine_workers(service, engine_workers)
        harness.warm_up(service, MODEL, Path(tmp))
        return run_batch(service, Path(tmp), lines, with_floor=with_floor)


def run(
    lines: int = 50_000,
    out_dir: Path | None = None,
    profile_dir: Path | None = None,
    engine_workers: tuple[int, ...] = (1,),
) -> dict[str, Any]:
    """Measure one ``lines``-line batch and the database's floor on the same file, once per
    count of ``engine_workers`` (each on a fresh service and database); print the tables, write
    ``control.json``. A target is met when every run meets it."""
    machine = harness.machine()
    runs = [
        measure(lines, engine_workers=n, with_floor=True, profile_dir=profile_dir)
        for n in engine_workers
    ]
    result = {
        "benchmark": "control",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {
            "lines": lines,
            "line_bytes": LINE_BYTES,
            "engine": "instant",
            "engine_workers": list(engine_workers),
        },
        "profiled": profile_dir is not None,
        "runs": runs,
        "targets": {"requests_per_s": TARGET_REQUESTS_PER_S, "floor_ratio": TARGET_FLOOR_RATIO},
        "met": {
            "requests_per_s": all(r["requests_per_s"] >= TARGET_REQUESTS_PER_S for r in runs),
            "floor_ratio": all(r["floor_ratio"] >= TARGET_FLOOR_RATIO for r in runs),
        },
    }
    harness.print_table(
        f"control plane: instant engine, create → completed → output downloaded "
        f"(load {machine['load_average']})",
        ["engine workers", "lines", "validate s", "run s", "finalize s", "download s",
         "total s", "requests/s", "lines by worker", "requests B/row (live/table/index)",
         "load (1 min)"],
        [[r["engine_workers"], r["lines"], r["validate_s"], r["run_s"], r["finalize_s"],
          r["download_s"], r["total_s"], r["requests_per_s"],
          " / ".join(str(n) for n in r["lines_by_engine_worker"]),
          " / ".join(f"{v:.0f}" for k, v in r["requests_per_row"].items() if k != "rows"),
          r["load_average"][0]]
         for r in runs],
    )  # fmt: skip
    harness.print_table(
        "the database's floor: the same transitions in bare SQL, one session",
        ["engine workers", "claims × chunk", "COPY in s", "claims s", "result writes s",
         "read out s", "total s", "requests/s", "Offpeak / floor", "delete s"],
        [[r["engine_workers"], f"{r['floor']['chunks']} × {r['floor']['chunk']}",
          r["floor"]["copy_s"], r["floor"]["claim_s"], r["floor"]["write_s"],
          r["floor"]["read_s"], r["floor"]["total_s"], r["floor"]["requests_per_s"],
          r["floor_ratio"], r["floor"]["delete_s"]] for r in runs],
    )  # fmt: skip
    path = harness.write_result("control", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
