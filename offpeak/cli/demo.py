"""``offpeak demo``: the whole product on one machine, on the real default model.

Runs ``offpeak up`` as a child process (the API and both workers, on the embedded SQLite +
filesystem broker unless settings say otherwise; stopped at the end as Ctrl-C stops it),
submits ``examples/quickstart.jsonl`` through the official ``openai`` SDK (one batch per
endpoint, since a batch targets one endpoint: chat, completions and embeddings), shows
progress, prints answers (an embedding as its size and first values) with their usage, and
leaves the output on disk.
"""

from __future__ import annotations

import base64
import socket
import time
from collections import defaultdict
from importlib import resources
from pathlib import Path

import orjson
from openai import OpenAI
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from offpeak.cli import embedded_db
from offpeak.cli.client import read_lines
from offpeak.cli.supervisor import OffpeakUp
from offpeak.settings import Settings, get_settings
from offpeak.statuses import BatchStatus

#: Package data (``examples/quickstart.jsonl`` in a checkout links to it), so the demo finds it
#: wherever the package is installed (a wheel, the Docker image).
QUICKSTART = Path(str(resources.files("offpeak") / "examples" / "quickstart.jsonl"))
#: The documented local key of demo mode (tenant ``local``); never set it on a shared server.
DEMO_KEY = "sk-offpeak-local-demo"
OUTPUT = Path("offpeak-demo-output.jsonl")
#: The demo's own data folder (beside the quick start's ``.offpeak``, never inside it), unless
#: the operator chose where the data lives.
DEMO_DATA_DIR = Path(".offpeak-demo")


def demo_settings(settings: Settings) -> Settings:
    """``settings`` with the demo's data folder: ``DEMO_DATA_DIR`` of the current directory
    when ``OFFPEAK_DATA_DIR`` and ``OFFPEAK_DATABASE_URL`` are unset, so the demo's tenant, key
    and batches never land in the database ``offpeak up`` uses here; else as configured."""
    if embedded_db.configured(settings):
        return settings
    return settings.model_copy(update={"data_dir": DEMO_DATA_DIR.resolve()})


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def split_by_endpoint(path: Path, folder: Path) -> dict[str, Path]:
    """Write one file per ``url`` found in ``path`` (a batch runs one endpoint)."""
    groups: dict[str, list[bytes]] = defaultdict(list)
    for raw in path.read_bytes().splitlines():
        if raw.strip():
            groups[orjson.loads(raw)["url"]].append(raw)
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for url, lines in groups.items():
        target = folder / f"quickstart-{url.strip('/').replace('/', '-')}.jsonl"
        target.write_bytes(b"\n".join(lines) + b"\n")
        files[url] = target
    return files


def _answer(line: dict) -> str:  # type: ignore[type-arg]
    body = line["response"]["body"]
    if body.get("object") == "list":  # /v1/embeddings: one vector per input
        return " | ".join(_vector(d["embedding"]) for d in body["data"])
    texts = [c["message"]["content"] if "message" in c else c["text"] for c in body["choices"]]
    return " | ".join(t.strip().replace("\n", " ") for t in texts)


def _vector(embedding: list[float] | str) -> str:
    if isinstance(embedding, str):
        return f"base64 float32, {len(base64.b64decode(embedding)) // 4} dims"
    return f"{len(embedding)} dims [{embedding[0]:+.3f}, {embedding[1]:+.3f}, …]"


def run_demo(port: int, console: Console) -> int:
    settings = demo_settings(get_settings())
    if not _port_free(port):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    data_dir = settings.data_dir.resolve()
    env = {"OFFPEAK_LOCAL_API_KEY": DEMO_KEY, "OFFPEAK_DATA_DIR": str(data_dir)}
    console.print(f"[bold]Offpeak demo[/bold] · database {settings.resolved_database_url}")
    console.print(f"  broker {settings.resolved_broker_url} · files {settings.resolved_blob_url}")
    stack = OffpeakUp(env, port, data_dir / "logs")
    try:
        with console.status("offpeak up: the API and workers (the engine loads the model: ~30 s)"):
            stack.start()
            stack.wait_http()
        client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=DEMO_KEY)
        console.print(
            f"API on {stack.base_url}/v1 · models: {', '.join(m.id for m in client.models.list())}"
        )
        started = time.monotonic()
        batches = {}
        for url, path in split_by_endpoint(QUICKSTART, data_dir / "demo").items():
            with path.open("rb") as handle:
                file = client.files.create(file=(path.name, handle), purpose="batch")
            batch = client.batches.create(
                input_file_id=file.id,
                endpoint=url,  # type: ignore[arg-type]
                completion_window="24h",
                metadata={"source": "demo"},
            )
            batches[batch.id] = batch
            console.print(f"submitted {path.name} as {batch.id} ({url})")
        batches = _wait(client, stack, batches, console)
        seconds = time.monotonic() - started
        return _report(client, batches, seconds, console)
    finally:
        stack.stop()
        _revoke_demo_key(settings.resolved_database_url, console)
        console.print(f"logs in {stack.log_dir}")


def _revoke_demo_key(database_url: str, console: Console) -> None:
    """The demo's key is published in the docs: once the demo ends it must not open the
    database it ran on (a real one, when ``OFFPEAK_DATABASE_URL`` points there)."""
    from sqlalchemy.exc import SQLAlchemyError

    from api.services import keys
    from storage.db import session_scope

    try:
        with session_scope(database_url) as session:
            keys.revoke_known_key(session, DEMO_KEY)
    except SQLAlchemyError as exc:  # a demo that failed before its database was migrated
        console.print(f"[yellow]could not revoke the demo key: {type(exc).__name__}[/yellow]")


def _wait(client: OpenAI, stack: OffpeakUp, batches: dict, console: Console) -> dict:  # type: ignore[type-arg]
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        tasks = {bid: progress.add_task(bid, total=None, status="validating") for bid in batches}
        while True:
            stack.check_alive()
            for batch_id in batches:
                batch = client.batches.retrieve(batch_id)
                batches[batch_id] = batch
                counts = batch.request_counts
                progress.update(
                    tasks[batch_id],
                    total=counts.total or None,
                    completed=counts.completed + counts.failed,
                    status=f"{batch.status} · {batch.usage.output_tokens} tokens out",
                )
            if all(b.status in BatchStatus.FINAL for b in batches.values()):
                return batches
            time.sleep(0.5)


def _report(client: OpenAI, batches: dict, seconds: float, console: Console) -> int:  # type: ignore[type-arg]
    table = Table(title="answers (SmolLM2-135M-Instruct; embeddings: all-MiniLM-L6-v2)")
    for column in ("custom_id", "answer", "prompt", "completion"):
        table.add_column(column, overflow="fold")
    outputs, ok = [], True
    total_in = total_out = 0
    for batch in batches.values():
        ok &= batch.status == BatchStatus.COMPLETED
        lines = read_lines(client, batch.output_file_id)
        errors = read_lines(client, batch.error_file_id)
        outputs.extend(lines + errors)
        for line in lines:
            usage = line["response"]["body"]["usage"]
            table.add_row(
                line["custom_id"],
                _answer(line)[:90],
                str(usage["prompt_tokens"]),
                str(usage.get("completion_tokens", 0)),  # embeddings: input tokens only
            )
        for line in errors:
            table.add_row(line["custom_id"], f"[red]error: {line}[/red]", "-", "-")
        total_in += batch.usage.input_tokens
        total_out += batch.usage.output_tokens
    console.print(table)
    OUTPUT.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in outputs))
    for batch in batches.values():
        counts = batch.request_counts
        console.print(
            f"{batch.id}: {batch.status}, {counts.completed}/{counts.total} completed, "
            f"{counts.failed} failed, usage {batch.usage.input_tokens} in / "
            f"{batch.usage.output_tokens} out"
        )
    console.print(
        f"{total_in} prompt + {total_out} completion tokens in {seconds:.1f} s "
        f"(engine start included) · output written to {OUTPUT.resolve()}"
    )
    return 0 if ok else 1
