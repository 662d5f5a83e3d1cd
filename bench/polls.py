"""Benchmark: status polls, the API's main load.

A scratch service (API, idle control and engine workers on the instant engine) is given
``batches`` finished batches, then ``clients`` concurrent clients (aiohttp, one asyncio loop in
this process, 127.0.0.1 only) poll it for ``seconds``: each client loops on a weighted choice of
retrieve a batch (``GET /v1/batches/{id}``), list batches (``GET /v1/batches?limit=20``) and
download an output file (``GET /v1/files/{id}/content``), as users waiting on batches do. The
mix has no uploads or creates: the target is for workers idle. Every answer must be a 200
(anything else is counted and fails the run's check).

The floor, in the same run and on the same cores: the same clients against a bare FastAPI app
(``hello_app``: one ``async def`` route answering a small JSON object, on uvicorn with the same
worker count and options as ``offpeak serve``), and the retrieve's SQL statement run bare
(psycopg, ``SQL_FLOOR_CONNECTIONS`` connections, one loop) against the scratch database.
Neither can be beaten by the API on this machine: they bound what a fix can reach.

Targets: ≥ 1,000 retrieves/s with retrieve p95 ≤ 50 ms, and list and download p95 ≤ 100 ms.
The load generator shares the machine's cores with the API (2 here): its own CPU (``client_cpu_s``),
the API processes' (``api_cpu_s``) and the whole machine's (``machine_cpu_s``, PostgreSQL and
anything else running included) are in the JSON.
"""

from __future__ import annotations

import asyncio
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import psycopg
from fastapi import FastAPI

from bench import harness
from bench.generator import write_padded_file
from offpeak.settings import get_settings

MODEL = "bench-model"
TARGETS = {"retrieves_per_s": 1000.0, "retrieve_p95_ms": 50.0, "list_p95_ms": 100.0,
           "download_p95_ms": 100.0}  # fmt: skip
#: Weights of the mix: retrieve, list, download.
MIX = {"retrieve": 0.7, "list": 0.2, "download": 0.1}
#: Connections of the bare SQL floor: enough to keep PostgreSQL busy on a few cores, few enough
#: to leave room under ``max_connections`` beside the API's pools and other users of the server.
SQL_FLOOR_CONNECTIONS = 10
#: The retrieve's statement (``storage.repositories.batches.poll_row``), bare.
RETRIEVE_SQL = (
    "SELECT batches.id, batches.endpoint, batches.model, batches.errors, batches.input_file_id,"
    " batches.completion_window, batches.status, batches.output_file_id, batches.error_file_id,"
    " batches.created_at, batches.in_progress_at, batches.expires_at, batches.finalizing_at,"
    " batches.completed_at, batches.failed_at, batches.expired_at, batches.cancelling_at,"
    " batches.cancelled_at, batches.total, batches.completed, batches.failed,"
    " batches.input_tokens, batches.cached_tokens, batches.output_tokens, batches.metadata,"
    " batches.estimated_completion_at, batches.estimate, ledger_entries.gpu_seconds,"
    " ledger_entries.cost, ledger_entries.price, ledger_entries.realtime_price,"
    " ledger_entries.input_tokens + ledger_entries.output_tokens, ledger_entries.billed_at"
    " FROM batches LEFT OUTER JOIN ledger_entries ON ledger_entries.key = 'batch:' || batches.id"
    " WHERE batches.id = %s AND batches.tenant_id = %s"
)
#: One URL to request, and the kind its latency counts under.
Pick = Callable[[random.Random], tuple[str, str]]


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0–1) of ``values`` by nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def hello_app() -> FastAPI:
    """The floor's bare FastAPI app: ``GET /v1/batches/{batch_id}`` answers a small object."""
    app = FastAPI()

    @app.get("/v1/batches/{batch_id}")
    async def hello(batch_id: str) -> dict[str, str]:
        return {"id": batch_id, "object": "batch", "status": "completed"}

    return app


def prepare(
    service: harness.Service, folder: Path, batches: int, lines: int
) -> tuple[list[str], list[str]]:
    """``batches`` completed batches of ``lines`` lines each; their ids and output file ids."""
    path = folder / "polls.jsonl"
    write_padded_file(path, lines, lines * 256, model=MODEL)
    client = service.client
    file_id = harness.upload(client, path)
    ids = [harness.create(client, file_id).id for _ in range(batches)]
    outputs = []
    for batch_id in ids:
        batch = harness.wait_status(client, batch_id, stack=service.stack, timeout=600)
        if batch.status != "completed" or batch.output_file_id is None:
            raise RuntimeError(f"batch {batch_id} ended {batch.status}: {batch.errors}")
        outputs.append(batch.output_file_id)
    return ids, outputs


def _summary(latencies: dict[str, list[float]], elapsed: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, values in latencies.items():
        out[kind] = {
            "count": len(values),
            "per_s": len(values) / elapsed,
            "p50_ms": 1000 * percentile(values, 0.50),
            "p95_ms": 1000 * percentile(values, 0.95),
            "p99_ms": 1000 * percentile(values, 0.99),
        }
    out["total_per_s"] = sum(len(v) for v in latencies.values()) / elapsed
    return out


async def _poll(
    base_url: str, headers: dict[str, str], clients: int, seconds: float, kinds: list[str],
    pick: Pick,
) -> dict[str, Any]:  # fmt: skip
    """``clients`` loops, each requesting ``pick(rng)`` and reading the whole answer until
    ``seconds`` have passed; per-kind latencies (200s only) and error counts."""
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds}
    errors: dict[str, int] = {}
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=30.0)
    async with aiohttp.ClientSession(
        base_url, connector=connector, headers=headers, timeout=timeout
    ) as http:
        deadline = time.perf_counter() + seconds

        async def one(seed: int) -> None:
            rng = random.Random(seed)
            while time.perf_counter() < deadline:
                kind, url = pick(rng)
                started = time.perf_counter()
                try:
                    async with http.get(url) as response:
                        await response.read()
                        ok, label = response.status == 200, str(response.status)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    ok, label = False, type(exc).__name__
                if ok:
                    latencies[kind].append(time.perf_counter() - started)
                else:
                    errors[f"{kind} {label}"] = errors.get(f"{kind} {label}", 0) + 1

        started = time.perf_counter()
        await asyncio.gather(*(one(n) for n in range(clients)))
        elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "errors": errors, **_summary(latencies, elapsed)}


def _mix(ids: list[str], outputs: list[str]) -> Pick:
    kinds, weights = list(MIX), list(MIX.values())

    def pick(rng: random.Random) -> tuple[str, str]:
        kind = rng.choices(kinds, weights)[0]
        if kind == "retrieve":
            return kind, f"/v1/batches/{rng.choice(ids)}"
        if kind == "list":
            return kind, "/v1/batches?limit=20"
        return kind, f"/v1/files/{rng.choice(outputs)}/content"

    return pick


def _cpu_seconds(processes: list[psutil.Process]) -> dict[int, float]:
    out = {}
    for proc in processes:
        try:
            times = proc.cpu_times()
            out[proc.pid] = times.user + times.system
        except psutil.Error:
            continue
    return out


def measured(fn: Callable[[], dict[str, Any]], api_pid: int | None = None) -> dict[str, Any]:
    """``fn()``'s result with the CPU seconds it took: this process (the load generator), the
    tree of ``api_pid`` (the server's processes) and the machine's (every core, every process),
    and the load average when it started."""
    tree = []
    if api_pid is not None:
        root = psutil.Process(api_pid)
        tree = [root, *root.children(recursive=True)]
    load = harness.load_average()
    api_before, machine_before = _cpu_seconds(tree), psutil.cpu_times()
    me = resource.getrusage(resource.RUSAGE_SELF)
    result = fn()
    after = resource.getrusage(resource.RUSAGE_SELF)
    api_after, machine_after = _cpu_seconds(tree), psutil.cpu_times()
    busy = [
        getattr(machine_after, f) - getattr(machine_before, f)
        for f in machine_after._fields
        if f not in ("idle", "iowait", "steal", "guest", "guest_nice")
    ]
    result["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (me.ru_utime + me.ru_stime)
    result["api_cpu_s"] = sum(api_after[p] - api_before[p] for p in api_after if p in api_before)
    result["machine_cpu_s"] = sum(busy)
    result["load_average"] = load
    return result


@contextmanager
def hello_server(api_workers: int) -> Iterator[tuple[str, int]]:
    """``hello_app`` on uvicorn as ``offpeak serve`` runs the API (its options, ``api_workers``
    processes, 127.0.0.1); ``(base url, pid)``. Stopped on the way out."""
    port = harness.free_port()
    access_log = "--access-log" if get_settings().api_access_log else "--no-access-log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--factory", "bench.polls:hello_app",
         "--host", "127.0.0.1", "--port", str(port), "--workers", str(api_workers),
         "--log-level", "info", access_log],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the floor's uvicorn exited with {proc.returncode}")
            try:
                if httpx.get(f"{base_url}/v1/batches/up", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.3)
        yield base_url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _sql_floor(conninfo: str, seconds: float, ids: list[str]) -> dict[str, Any]:
    """``RETRIEVE_SQL`` on ``SQL_FLOOR_CONNECTIONS`` autocommit connections, each looping for
    ``seconds``: statements/s and their latency."""
    connections = [
        await psycopg.AsyncConnection.connect(conninfo, autocommit=True)
        for _ in range(SQL_FLOOR_CONNECTIONS)
    ]
    try:
        row = await (await connections[0].execute(
            "SELECT tenant_id FROM batches WHERE id = %s", (ids[0],)
        )).fetchone()  # fmt: skip
        assert row is not None
        tenant_id = row[0]
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def one(conn: psycopg.AsyncConnection[Any], seed: int) -> None:
            rng = random.Random(seed)
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                cursor = await conn.execute(RETRIEVE_SQL, (rng.choice(ids), tenant_id))
                await cursor.fetchall()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(one(c, n) for n, c in enumerate(connections)))
        elapsed = time.perf_counter() - started
    finally:
        for conn in connections:
            await conn.close()
    summary = _summary({"select": latencies}, elapsed)
    return {"seconds": elapsed, "connections": SQL_FLOOR_CONNECTIONS, **summary["select"]}


def _met(r: dict[str, Any]) -> dict[str, bool]:
    return {
        "retrieves_per_s": r["retrieve"]["per_s"] >= TARGETS["retrieves_per_s"],
        "retrieve_p95_ms": r["retrieve"]["p95_ms"] <= TARGETS["retrieve_p95_ms"],
        "list_p95_ms": r["list"]["p95_ms"] <= TARGETS["list_p95_ms"],
        "download_p95_ms": r["download"]["p95_ms"] <= TARGETS["download_p95_ms"],
        "no_errors": not r["errors"],
    }


def measure(
    api_workers: int, clients: int, seconds: float, floor_seconds: float, batches: int,
    lines: int,
) -> dict[str, Any]:  # fmt: skip
    """One poll run on a fresh scratch service whose API runs ``api_workers`` processes, then
    the floor: the bare app at the same worker count, the bare SQL on the same database."""
    env = {"OFFPEAK_API_WORKERS": str(api_workers)}
    with (
        tempfile.TemporaryDirectory(prefix="offpeak-polls-") as tmp,
        harness.scratch_service({MODEL: {"engine": "instant"}}, env=env) as service,
    ):
        ids, outputs = prepare(service, Path(tmp), batches, lines)
        time.sleep(2.0)  # the finalizes' follow-ups (webhooks, billing) settle: workers idle
        headers = {"Authorization": f"Bearer {service.client.api_key}"}
        base_url = service.stack.base_url
        pick = _mix(ids, outputs)
        r = measured(
            lambda: asyncio.run(_poll(base_url, headers, clients, seconds, list(MIX), pick)),
            service.stack.procs["api"].pid,
        )
        conninfo = service.database_url.replace("postgresql+psycopg://", "postgresql://")
        sql = measured(lambda: asyncio.run(_sql_floor(conninfo, floor_seconds, ids)))
    with hello_server(api_workers) as (hello_url, hello_pid):

        def hello(rng: random.Random) -> tuple[str, str]:
            return "retrieve", f"/v1/batches/{rng.choice(ids)}"

        bare = measured(
            lambda: asyncio.run(_poll(hello_url, {}, clients, floor_seconds, ["retrieve"], hello)),
            hello_pid,
        )
    r["api_workers"] = api_workers
    r["met"] = _met(r)
    r["floor"] = {"hello_app": bare, "sql": sql}
    return r


def run(
    api_workers: tuple[int, ...] = (1, 2),
    clients: int = 50,
    seconds: float = 60.0,
    batches: int = 20,
    lines: int = 200,
    out_dir: Path | None = None,
    floor_seconds: float | None = None,
) -> dict[str, Any]:
    """One run per API worker count, each with its floor (``floor_seconds``, default the
    smaller of ``seconds`` and 20); prints the tables, writes ``polls.json``."""
    floor_seconds = min(seconds, 20.0) if floor_seconds is None else floor_seconds
    machine = harness.machine()
    runs = [measure(n, clients, seconds, floor_seconds, batches, lines) for n in api_workers]
    result = {
        "benchmark": "polls",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {
            "clients": clients,
            "seconds": seconds,
            "floor_seconds": floor_seconds,
            "batches": batches,
            "lines_per_batch": lines,
            "mix": MIX,
            "client": f"aiohttp {aiohttp.__version__}, one asyncio loop",
        },  # fmt: skip
        "runs": runs,
        "targets": TARGETS,
    }
    rows = [
        [r["api_workers"], r["total_per_s"], r["retrieve"]["per_s"], r["retrieve"]["p50_ms"],
         r["retrieve"]["p95_ms"], r["list"]["p95_ms"], r["download"]["p95_ms"],
         sum(r["errors"].values()), r["client_cpu_s"], r["api_cpu_s"], r["machine_cpu_s"],
         " ".join(map(str, r["load_average"]))]
        for r in runs
    ]  # fmt: skip
    harness.print_table(
        f"status polls: {clients} clients for {seconds:.0f} s, workers idle "
        f"(load {machine['load_average']})",
        ["API workers", "requests/s", "retrieves/s", "retrieve p50 ms", "retrieve p95 ms",
         "list p95 ms", "download p95 ms", "errors", "client CPU s", "API CPU s",
         "machine CPU s", "load"],
        rows,
    )  # fmt: skip
    floors = [
        [r["api_workers"], bare["retrieve"]["per_s"], bare["retrieve"]["p95_ms"],
         bare["client_cpu_s"], bare["api_cpu_s"], sql["per_s"], sql["p95_ms"],
         sql["client_cpu_s"]]
        for r in runs
        for bare, sql in [(r["floor"]["hello_app"], r["floor"]["sql"])]
    ]  # fmt: skip
    harness.print_table(
        f"the floor, {floor_seconds:.0f} s each: a bare FastAPI app, {clients} clients; the "
        f"retrieve's SQL bare, {SQL_FLOOR_CONNECTIONS} connections",
        ["API workers", "bare app requests/s", "bare app p95 ms", "client CPU s",
         "server CPU s", "bare SQL statements/s", "bare SQL p95 ms", "SQL client CPU s"],
        floors,
    )  # fmt: skip
    path = harness.write_result("polls", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
