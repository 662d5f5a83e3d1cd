"""Benchmark: status polls, the API's main load (issue 14, part 4).

A scratch service (API, idle control and engine workers on the instant engine) is given
``batches`` finished batches, then ``clients`` concurrent clients (httpx, asyncio, one process,
127.0.0.1 only) poll it for ``seconds``: each client loops on a weighted choice of retrieve a
batch (``GET /v1/batches/{id}``), list batches (``GET /v1/batches?limit=20``) and download an
output file (``GET /v1/files/{id}/content``), as users waiting on batches do. The mix has no
uploads or creates: the target is for workers idle. Every answer must be a 200 (anything else
is counted and fails the run's check).

Targets: ≥ 1,000 retrieves/s with retrieve p95 ≤ 50 ms, and list and download p95 ≤ 100 ms.
The load generator shares the machine's cores with the API (2 here): its own CPU share is in
the JSON (``client_cpu_s``).
"""

from __future__ import annotations

import asyncio
import random
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import harness
from bench.generator import write_padded_file

MODEL = "bench-model"
TARGETS = {"retrieves_per_s": 1000.0, "retrieve_p95_ms": 50.0, "list_p95_ms": 100.0,
           "download_p95_ms": 100.0}  # fmt: skip
#: Weights of the mix: retrieve, list, download.
MIX = {"retrieve": 0.7, "list": 0.2, "download": 0.1}


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0–1) of ``values`` by nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


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


async def _poll(
    base_url: str, key: str, clients: int, seconds: float, ids: list[str], outputs: list[str]
) -> dict[str, Any]:
    latencies: dict[str, list[float]] = {kind: [] for kind in MIX}
    errors: dict[str, int] = {}
    kinds, weights = list(MIX), list(MIX.values())
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=30.0
    ) as http:
        deadline = time.perf_counter() + seconds

        async def one(seed: int) -> None:
            rng = random.Random(seed)
            while time.perf_counter() < deadline:
                kind = rng.choices(kinds, weights)[0]
                if kind == "retrieve":
                    url = f"/v1/batches/{rng.choice(ids)}"
                elif kind == "list":
                    url = "/v1/batches?limit=20"
                else:
                    url = f"/v1/files/{rng.choice(outputs)}/content"
                started = time.perf_counter()
                try:
                    response = await http.get(url)
                    await response.aread()
                    ok = response.status_code == 200
                    label = str(response.status_code)
                except httpx.HTTPError as exc:
                    ok, label = False, type(exc).__name__
                if ok:
                    latencies[kind].append(time.perf_counter() - started)
                else:
                    errors[f"{kind} {label}"] = errors.get(f"{kind} {label}", 0) + 1

        started = time.perf_counter()
        await asyncio.gather(*(one(n) for n in range(clients)))
        elapsed = time.perf_counter() - started
    result: dict[str, Any] = {"seconds": elapsed, "errors": errors}
    for kind, values in latencies.items():
        result[kind] = {
            "count": len(values),
            "per_s": len(values) / elapsed,
            "p50_ms": 1000 * percentile(values, 0.50),
            "p95_ms": 1000 * percentile(values, 0.95),
            "p99_ms": 1000 * percentile(values, 0.99),
        }
    result["total_per_s"] = sum(len(v) for v in latencies.values()) / elapsed
    return result


def measure(
    api_workers: int, clients: int, seconds: float, batches: int, lines: int
) -> dict[str, Any]:
    """One poll run on a fresh scratch service whose API runs ``api_workers`` processes."""
    env = {"OFFPEAK_API_WORKERS": str(api_workers)}
    with (
        tempfile.TemporaryDirectory(prefix="offpeak-polls-") as tmp,
        harness.scratch_service({MODEL: {"engine": "instant"}}, env=env) as service,
    ):
        ids, outputs = prepare(service, Path(tmp), batches, lines)
        time.sleep(2.0)  # the finalizes' follow-ups (webhooks, billing) settle: workers idle
        key = str(service.client.api_key)
        load = harness.load_average()
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        r = asyncio.run(_poll(service.stack.base_url, key, clients, seconds, ids, outputs))
        after = resource.getrusage(resource.RUSAGE_SELF)
    r["client_cpu_s"] = (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime)
    r["api_workers"] = api_workers
    r["load_average"] = load
    r["met"] = {
        "retrieves_per_s": r["retrieve"]["per_s"] >= TARGETS["retrieves_per_s"],
        "retrieve_p95_ms": r["retrieve"]["p95_ms"] <= TARGETS["retrieve_p95_ms"],
        "list_p95_ms": r["list"]["p95_ms"] <= TARGETS["list_p95_ms"],
        "download_p95_ms": r["download"]["p95_ms"] <= TARGETS["download_p95_ms"],
        "no_errors": not r["errors"],
    }
    return r


def run(
    api_workers: tuple[int, ...] = (1, 2),
    clients: int = 50,
    seconds: float = 60.0,
    batches: int = 20,
    lines: int = 200,
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """One run per API worker count; prints the table, writes ``polls.json``."""
    machine = harness.machine()
    runs = [measure(n, clients, seconds, batches, lines) for n in api_workers]
    result = {
        "benchmark": "polls",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {
            "clients": clients,
            "seconds": seconds,
            "batches": batches,
            "lines_per_batch": lines,
            "mix": MIX,
        },  # fmt: skip
        "runs": runs,
        "targets": TARGETS,
    }
    rows = [
        [r["api_workers"], r["total_per_s"], r["retrieve"]["per_s"], r["retrieve"]["p50_ms"],
         r["retrieve"]["p95_ms"], r["list"]["p95_ms"], r["download"]["p95_ms"],
         sum(r["errors"].values()), r["client_cpu_s"], " ".join(map(str, r["load_average"]))]
        for r in runs
    ]  # fmt: skip
    harness.print_table(
        f"status polls: {clients} clients for {seconds:.0f} s, workers idle "
        f"(load {machine['load_average']})",
        ["API workers", "requests/s", "retrieves/s", "retrieve p50 ms", "retrieve p95 ms",
         "list p95 ms", "download p95 ms", "errors", "client CPU s", "load"],
        rows,
    )  # fmt: skip
    path = harness.write_result("polls", result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
