"""The ``offpeak`` command line: run the service (``serve``, ``worker``, ``migrate``, ``up``),
manage keys, and use it as a client (``submit``, ``status``, ``download``, ``demo``).

This package holds every entry point (the commands, the demo, the supervisor of ``offpeak up``,
the client helpers, the benchmark commands) and may import anything; nothing below it (the core
``offpeak``, ``storage``, ``api``, ``workers``) imports it. The import contracts in
``pyproject.toml`` check that.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from offpeak.cli import batch_commands, help_text, keys
from offpeak.cli.bench import bench_app
from offpeak.cli.config import config_app
from offpeak.cli.models import models_app
from offpeak.cli.plan import calibrate_command, plan_app, simulate_app
from offpeak.cli.sched import (
    pause_command,
    resume_command,
    simulate_colocate_command,
    simulate_day_command,
)
from offpeak.cli.tenants import tenants_app
from offpeak.cli.webhooks import webhooks_app
from offpeak.settings import Settings, get_settings

app = typer.Typer(help="Offpeak: the OpenAI Batch API on idle GPU time.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(plan_app, name="plan")
app.add_typer(simulate_app, name="simulate")
app.add_typer(bench_app, name="bench")
app.add_typer(webhooks_app, name="webhooks")
app.add_typer(tenants_app, name="tenants")
app.add_typer(models_app, name="models")
app.add_typer(config_app, name="config")
console = Console()


def _sealing_keys(settings: Settings) -> list[str]:
    """The keys webhook secrets are sealed with (``storage.sealing.keys_for``); exits 1 saying
    what to set when a server database has none."""
    from storage import sealing

    try:
        return sealing.keys_for(settings)
    except sealing.SealingError as exc:
        Console(stderr=True, soft_wrap=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None


@app.command()
def migrate(
    create: Annotated[
        bool,
        typer.Option("--create", help="Make a new, empty embedded database if there is none."),
    ] = False,
) -> None:
    """Create or upgrade the database schema (Alembic ``upgrade head``).

    With the embedded SQLite database and OFFPEAK_DATA_DIR unset (the default ``.offpeak``
    folder of the current directory), a new database is made only with --create: run from
    another folder, migrate would otherwise start an empty one there. Exits 1 saying so."""
    import migrations
    from offpeak.cli import embedded_db

    settings = get_settings()
    refusal = embedded_db.new_database_refusal(settings, create)
    if refusal:
        Console(stderr=True, soft_wrap=True).print(f"[red]{refusal}[/red]")
        raise typer.Exit(1)
    keys = _sealing_keys(settings)  # before any change: a server database needs its key
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    migrations.upgrade(settings.resolved_database_url)
    from sqlalchemy.engine import make_url

    from storage import sealing
    from storage.db import session_scope
    from storage.repositories import webhooks as webhooks_repo

    shown = make_url(settings.resolved_database_url).render_as_string(hide_password=True)
    console.print(f"database at revision head: {shown}", soft_wrap=True)
    sealing.configure(keys)
    with session_scope(settings.resolved_database_url) as session:
        sealed = webhooks_repo.seal_clear_secrets(session)
    if sealed:
        console.print(f"{sealed} webhook endpoint(s) had a signing secret in clear: now sealed")


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Interface to bind.")] = None,
    port: Annotated[int | None, typer.Option(help="TCP port.")] = None,
    workers: Annotated[
        int | None, typer.Option(help="Uvicorn worker processes (default: api_workers).")
    ] = None,
) -> None:
    """Run the HTTP API (expects ``offpeak migrate`` to have run)."""
    import uvicorn

    from api.server import server_options

    settings = get_settings()
    _sealing_keys(settings)  # refused here with a message, not in each uvicorn process
    uvicorn.run(
        "api.app:create_app",
        factory=True,
        host=host or settings.api_host,
        port=port or settings.api_port,
        workers=workers or settings.api_workers,
        log_level="info",
        access_log=settings.api_access_log,
        **server_options(settings),
    )


@app.command()
def worker(
    role: Annotated[
        str, typer.Option(help="control (validate, finalize, sweep) or engine.")
    ] = "engine",
    models: Annotated[str | None, typer.Option(help="Comma-separated models to serve.")] = None,
    concurrency: Annotated[int, typer.Option(help="Threads of a control worker.")] = 4,
    loglevel: Annotated[str, typer.Option()] = "INFO",
    stop_timeout: Annotated[
        float, typer.Option(help="Seconds after SIGTERM before the worker exits regardless.")
    ] = 25.0,
) -> None:
    """Run a Celery worker. ``engine`` loads each served model's engine once, then runs batch
    work from those models' queues in one process (``solo`` pool: an engine cannot live in a
    daemonic prefork child). ``control`` runs validation, finalization and the periodic sweep.

    SIGTERM (or SIGINT) stops it: it takes no new work, hands the lines it holds back, closes its
    engines and exits, within ``--stop-timeout`` seconds; a second signal exits at once. Its
    children (vLLM's engine-core) die with it, even if it is SIGKILLed. An engine that does
    not start at boot is named with its ``gpu_memory_utilization`` on stderr, the engines
    started before it are closed, and the worker exits 78 (``workers.engine.load_failure``).
    A worker Celery stops on an error it cannot recover from exits with Celery's code (1), so a
    supervisor restarts it."""
    import logging
    import signal

    from offpeak import process_tree

    def exit_now(signum: int, _frame: object) -> None:
        # Until Celery runs nothing is held: stop the engine being built, and exit.
        process_tree.kill_children(timeout=0)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, exit_now)
    process_tree.spawned_children_die_with_this_process()
    if models:
        os.environ["OFFPEAK_WORKER_MODELS"] = models
        get_settings.cache_clear()
    settings = get_settings()
    _sealing_keys(settings)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=loglevel, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    from offpeak import celery_app

    node = f"{role}-{os.getpid()}@{socket.gethostname()}"
    on_shutdown: Callable[[], None] | None = None  # an engine worker's stop
    if role == "control":
        import threading

        from workers import estimate

        # Validation counts prompt tokens with each model's tokenizer: load them meanwhile.
        threading.Thread(target=estimate.warm, args=(settings,), daemon=True).start()
        argv = [
            "worker",
            "-Q",
            celery_app.control_queue(settings),
            "-P",
            "threads",
            "-c",
            str(concurrency),
            # No -B: beat runs as a thread (workers.beat), not a child that outlives a SIGKILL.
            "-n",
            node,
            "--loglevel",
            loglevel,
        ]
    elif role == "engine":
        unknown = [m for m in settings.served_models if m not in settings.models]
        if unknown:
            raise typer.BadParameter(f"not configured: {', '.join(unknown)}", param_hint="--models")
        from workers import engine_worker

        engine = engine_worker.EngineWorker(settings)
        engine_worker.install(engine)
        engine.boot()  # engines loaded, runners built: a drain starts at once
        on_shutdown = engine.shut_down
        argv = ["worker", "-Q", ",".join(engine.queues()), "-P", "solo", "-n", node]
        argv += ["--loglevel", loglevel]
    else:
        raise typer.BadParameter("role must be 'control' or 'engine'", param_hint="--role")
    from workers import worker_metrics
    from workers.celery_worker import install_stop_handling, run_worker
    from workers.runner import worker_id as this_worker

    worker_metrics.start_server(settings, role, this_worker())  # OFFPEAK_METRICS_PORT; 0 = off
    install_stop_handling(role, stop_timeout, on_shutdown)
    try:
        code = run_worker(argv)
    finally:
        if on_shutdown is not None:
            on_shutdown()  # if Celery ended without worker_shutdown
        process_tree.kill_children(timeout=5)
    # Handed back and closed: the interpreter's own teardown would only add seconds, outside
    # the stop timeout.
    process_tree.exit_without_teardown(code)


@app.command()
def up(
    host: Annotated[str | None, typer.Option(help="Interface the API binds.")] = None,
    port: Annotated[int | None, typer.Option(help="The API's TCP port.")] = None,
    engines: Annotated[int, typer.Option(help="Engine workers to run (0: none).")] = 1,
    models: Annotated[
        str | None, typer.Option(help="Comma-separated models the engine workers serve.")
    ] = None,
    log_dir: Annotated[
        Path | None, typer.Option(help="Where each process logs. Default: <data_dir>/logs.")
    ] = None,
) -> None:
    """Run the whole service on this machine: migrate, then the API, a control worker and the
    engine workers as child processes. Exits 1 at once, starting nothing, when the API's port is
    taken (naming what holds it). A process that exits is restarted (backoff 1, 2, 4 ... 60
    s) and the restart logged; Ctrl-C or SIGTERM stops them all, vLLM's engine-core included
    (a second Ctrl-C kills them at once)."""
    import logging
    import subprocess
    import sys

    from offpeak.cli.port_check import PortTakenError, ensure_free
    from offpeak.cli.supervisor import Supervisor, host_engines, up_children

    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = get_settings()
    try:  # before anything starts: a taken port made the API restart forever beside workers
        ensure_free(host or settings.api_host, port or settings.api_port)
    except PortTakenError as exc:
        Console(stderr=True).print(f"[red]offpeak up: {exc}[/red]", soft_wrap=True)
        raise typer.Exit(1) from None
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    folder = log_dir or settings.data_dir.resolve() / "logs"
    migrated = subprocess.run([sys.executable, "-m", "offpeak", "migrate"], check=False)
    if migrated.returncode != 0:
        raise typer.Exit(migrated.returncode)
    children = up_children(engines, models, port, host)
    base = f"http://{host or settings.api_host}:{port or settings.api_port}"
    console.print(
        f"Offpeak up: starting {', '.join(c.name for c in children)} · logs in {folder} · "
        "Ctrl-C stops everything",
        soft_wrap=True,
    )
    threading.Thread(target=_say_when_listening, args=(base,), daemon=True).start()
    raise typer.Exit(Supervisor(children, host_engines(engines, models), folder).run())


def _say_when_listening(base: str, patience: float = 120.0) -> None:
    """Print the API's address once its ``/healthz`` answers (``offpeak up``), so the address is
    never shown before a client can use it; after ``patience`` seconds, where its log is."""
    import httpx

    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{base}/healthz", timeout=2.0)
        except httpx.HTTPError:
            time.sleep(0.5)
            continue
        console.print(f"Offpeak up: API on {base}/v1", soft_wrap=True)
        return
    console.print(f"Offpeak up: no answer at {base} yet; see the API's log", soft_wrap=True)


def _base_url() -> str:
    settings = get_settings()
    return os.environ.get("OPENAI_BASE_URL") or f"http://{settings.api_host}:{settings.api_port}/v1"


def _client():  # type: ignore[no-untyped-def]
    from offpeak.cli import rate_limit_notice

    settings = get_settings()
    base_url = _base_url()
    api_key = os.environ.get("OPENAI_API_KEY") or settings.local_api_key
    if not api_key:
        raise typer.BadParameter("set OPENAI_API_KEY (see `offpeak keys create`)")
    return rate_limit_notice.client(base_url, api_key)  # says on stderr when it is rate-limited


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A JSONL batch file.")],
    endpoint: Annotated[str | None, typer.Option(help="Default: the first line's url.")] = None,
    window: Annotated[str, typer.Option("--completion-window")] = "24h",
    wait: Annotated[
        bool, typer.Option("--wait", help="Show progress until the batch ends.")
    ] = False,
) -> None:
    """Upload FILE and create a batch (through the OpenAI SDK, as a user's code would). With
    --wait, warns on stderr when no live worker can run the batch (from the server's /healthz)."""
    from offpeak.cli import client as client_tools

    if not client_tools.has_content(file):
        Console(stderr=True, soft_wrap=True).print(
            f"{file} is empty: there is no request line to submit"
        )
        raise typer.Exit(1)
    batch = client_tools.submit(_client(), file, endpoint, window)
    console.print(f"batch [bold]{batch.id}[/bold] created ({batch.status})")
    if wait:
        wait_and_exit(batch.id, client_tools.first_model(file))


def wait_and_exit(batch_id: str, model: str | None, results: Path | None = None) -> None:
    """``offpeak.cli.watching.wait_and_exit`` with this CLI's client and console."""
    from offpeak.cli import watching

    watching.wait_and_exit(_client(), batch_id, model, console, results)


@app.command()
def watch(
    batch_id: str,
    results: Annotated[
        Path | None,
        typer.Option(
            "--results",
            help="Append the batch's lines to this file as they end (resumes after its last).",
        ),
    ] = None,
) -> None:
    """Show an existing batch's progress until it ends, as ``submit --wait`` does, and exit with
    its outcome (0 completed, 3 failed, 4 expired, 5 cancelled; 130 after Ctrl-C, which stops
    the watching, not the batch). With ``--results FILE``, every line of the batch is in FILE
    when it exits, each as the output or error file holds it."""
    wait_and_exit(batch_id, None, results)


@app.command()
def status(batch_id: str) -> None:
    """Show a batch's status, request counts and usage."""
    from offpeak.cli import client as client_tools

    client_tools.print_summary(_client().batches.retrieve(batch_id), console)


@app.command("usage")
def usage_command(
    days: Annotated[int, typer.Option(help="Batches that ended in the last DAYS days.")] = 30,
    group_by: Annotated[
        str, typer.Option(help="model, day, adapter (per LoRA adapter) or none.")
    ] = "model",
) -> None:
    """What this key's tenant was billed: requests, tokens, GPU-seconds, cost, price, saving;
    then its quotas and rate limit beside its use of them, its queued lines with the lines of
    other tenants ahead of them, and its share of the engines against its entitled share."""
    import time

    from offpeak.cli import client as client_tools

    end = int(time.time()) + 1
    grouping = None if group_by == "none" else group_by
    client = _client()
    report = client_tools.usage(client, end - days * 86_400, end, grouping)
    client_tools.print_usage(report, console)
    client_tools.print_limits(client_tools.limits(client), console)
    client_tools.print_queue(client_tools.queue(client), console)


@app.command()
def download(
    batch_id: str,
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Where to write the output file.")
    ] = Path("output.jsonl"),
    partial: Annotated[
        bool,
        typer.Option(
            "--partial",
            help="Append the lines ended so far, output and errors, to OUTPUT (resumes "
            "after its last line); the batch may still be running.",
        ),
    ] = False,
) -> None:
    """Download a finished batch's output file (and its error file next to it, if any). Exits 6,
    saying why, when the batch has no file to download (it has not ended, or ended empty).
    With ``--partial``: the lines ended so far, appended to OUTPUT."""
    from offpeak.cli import client as client_tools

    if partial:
        from offpeak.cli import partial_results

        client = _client()
        added = partial_results.append_ready(client, batch_id, output)
        status = client.batches.retrieve(batch_id).status
        console.print(f"appended {added:,} lines to {output} (batch {status})")
        return

    try:
        paths = client_tools.download(_client(), batch_id, output)
    except client_tools.NoOutputError as exc:
        from offpeak.cli import exit_codes

        Console(stderr=True).print(f"[red]{exc}[/red]")
        raise typer.Exit(exit_codes.NOTHING_TO_DO) from None
    for path in paths:
        console.print(f"wrote {path}")


@app.command()
def demo(
    port: Annotated[int, typer.Option(help="Port for the demo API.")] = 8765,
) -> None:
    """Start the API and workers, run examples/quickstart.jsonl on the real default model through
    the OpenAI SDK, show progress and answers, and leave the output file on disk."""
    from offpeak.cli.demo import run_demo

    raise typer.Exit(run_demo(port, console))


app.command("list")(batch_commands.list_command)
app.command("cancel")(batch_commands.cancel_command)
app.command("retry")(batch_commands.retry_command)
app.command("estimate")(batch_commands.estimate_command)
keys_app.command("create")(keys.create_command)
keys_app.command("list")(keys.list_command)
keys_app.command("revoke")(keys.revoke_command)
keys_app.command("new-secret-key")(batch_commands.keys_new_secret_key_command)
keys_app.command("reseal")(batch_commands.keys_reseal_command)
app.command("calibrate")(calibrate_command)
app.command("pause")(pause_command)
app.command("resume")(resume_command)
simulate_app.command("day")(simulate_day_command)
simulate_app.command("colocate")(simulate_colocate_command)


def _database_folder_problem(exc: Exception) -> str | None:
    """One line for SQLite's ``unable to open database file`` (the embedded database's folder
    does not exist: a relative ``OFFPEAK_DATA_DIR`` used from another directory, or no
    ``offpeak migrate`` yet), naming the folder; ``None`` for any other database error."""
    if "unable to open database file" not in str(exc):
        return None
    from offpeak.cli import embedded_db

    return embedded_db.open_failure(get_settings())


def main() -> None:
    """The console entry point: client errors print one line, not a traceback, and exit with
    ``exit_codes`` (1 an API error, 7 the API unreachable, 1 a data folder that cannot be
    opened)."""
    import openai
    import sqlalchemy.exc

    from offpeak.cli import exit_codes

    try:
        app()
    except openai.APIConnectionError as exc:
        console.print(
            f"[red]cannot reach the Offpeak API at {exc.request.url}: "
            f"{exc}[/red] (is `offpeak serve` running, and OPENAI_BASE_URL right?)",
            soft_wrap=True,
        )
        raise SystemExit(exit_codes.UNREACHABLE) from None
    except sqlalchemy.exc.OperationalError as exc:
        message = _database_folder_problem(exc)
        if message is None:
            raise
        console.print(f"[red]{message}[/red]", soft_wrap=True)
        raise SystemExit(exit_codes.ERROR) from None
    except openai.APIStatusError as exc:
        try:
            message = exc.response.json()["error"]["message"]
        except Exception:  # not our error shape (a proxy's page): show the status only
            message = exc.response.text[:200]
        console.print(f"[red]error {exc.status_code}: {message}[/red]", soft_wrap=True)
        hint = _base_url_hint(exc.status_code, _base_url())
        if hint:
            console.print(hint, soft_wrap=True)
        raise SystemExit(exit_codes.ERROR) from None


def _base_url_hint(status_code: int, base_url: str) -> str | None:
    """For a 404 from a base URL that does not end in ``/v1`` (the OpenAI SDK appends the
    route, e.g. ``/batches``, to it): the URL to try instead."""
    if status_code != 404 or base_url.rstrip("/").endswith("/v1"):
        return None
    return (
        f"hint: OPENAI_BASE_URL is {base_url}; Offpeak's routes are under /v1, so it should "
        f"likely be {base_url.rstrip('/')}/v1"
    )


help_text.unwrap_all(app)
