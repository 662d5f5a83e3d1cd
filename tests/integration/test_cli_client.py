"""The client CLI a script can trust: exit codes of ``submit --wait`` and
``download``, ``list`` / ``cancel`` / ``retry`` / ``estimate`` / ``keys list`` / ``keys revoke``,
money without scientific notation, a usage table that fits 80 columns, one cost-per-million
figure on the dashboard and in the CLI, the batch's cost estimate, ``after=`` cursors, and a
data folder that cannot be opened. Through typer's CliRunner on the in-process API (the
official openai SDK underneath), with the instant engine: none of this is about the model."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from rich.console import Console
from typer.testing import CliRunner

from offpeak import cli
from offpeak.billing import format_usd
from offpeak.cli import client as client_tools
from offpeak.cli import exit_codes
from offpeak.settings import ModelConfig, ModelPricing, Settings, get_settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.repositories import batches as batches_repo
from tests.support.batches import line
from tests.support.billing import AcctTenant as Tenant
from tests.support.billing import end
from workers.engine.instant import InstantEngine
from workers.estimate import estimate_batch
from workers.runner import Runner
from workers.validation import run_validation

MODEL = "cli-model"
#: Only the cost-card test runs this model, so the dashboard's fleet-wide card is its batch's.
CARD_MODEL = "cli-card-model"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    prices = ModelPricing(input_per_million=1.0, output_per_million=4.0)
    return settings.model_copy(
        update={
            "models": {m: ModelConfig(engine="instant") for m in (MODEL, CARD_MODEL)},
            "pricing": {MODEL: prices, CARD_MODEL: prices},
            # A tiny CPU price, so amounts come out around 1e-5 dollars and below.
            "gpu_cost_per_hour": {"cpu": 0.05},
            "flush_seconds": 0.05,
            "metrics_window_seconds": 3600.0,
        }
    )


@pytest.fixture()
def tenant(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Tenant:
    tenant = Tenant(settings)
    monkeypatch.setattr(cli, "_client", lambda: tenant.sdk)
    return tenant


def jsonl(*lines: bytes) -> bytes:
    return b"\n".join(lines) + b"\n"


def write(tmp_path: Path, data: bytes, name: str = "in.jsonl") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def drive(tenant: Tenant, action: Callable[[str], None]) -> threading.Thread:
    """Run ``action(batch_id)`` in a thread once the tenant's first batch exists: the work a
    control and an engine worker would do while ``submit --wait`` polls."""

    def body() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            page = tenant.sdk.batches.list(limit=1).data
            if page:
                action(page[0].id)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def validate(settings: Settings, batch_id: str) -> None:
    """The validation task's two steps (``workers.tasks.validate_batch``): the file checked
    and its lines stored, then the cost estimate counted from them."""
    run_validation(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    estimate_batch(settings, batch_id)


def run_lines(settings: Settings, model: str = MODEL) -> None:
    Runner(settings, InstantEngine(model), "cli-test", lambda _b: None).drain()


def expire(settings: Settings, batch_id: str) -> None:
    with session_scope(settings.resolved_database_url) as session:
        row = batches_repo.get_any(session, batch_id)
        assert row is not None
        row.expires_at = int(time.time()) - 1


def submit_wait(tmp_path: Path, data: bytes) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, ["submit", str(write(tmp_path, data)), "--wait"])
    return result.exit_code, result.output


# --- submit --wait and download: exit codes ------------------------------------------------


def test_submit_wait_exits_0_when_the_batch_completes(
    settings: Settings, tenant: Tenant, tmp_path: Path
) -> None:
    def complete(batch_id: str) -> None:
        validate(settings, batch_id)
        run_lines(settings)
        end(settings, batch_id)

    worker = drive(tenant, complete)
    code, output = submit_wait(tmp_path, jsonl(line("a", MODEL), line("b", MODEL)))
    worker.join(10)
    assert code == exit_codes.OK, output
    assert "completed" in output and "ended" not in output


def test_submit_wait_exits_3_and_says_so_when_the_batch_fails(
    settings: Settings, tenant: Tenant, tmp_path: Path
) -> None:
    worker = drive(tenant, lambda batch_id: validate(settings, batch_id))
    code, output = submit_wait(tmp_path, jsonl(line("a", "no-such-model")))
    worker.join(10)
    assert code == exit_codes.BATCH_FAILED == 3
    assert "ended failed (exit 3)" in output
    assert "model_not_found" in output  # the summary names the problem


def test_submit_wait_exits_4_when_the_batch_expires(
    settings: Settings, tenant: Tenant, tmp_path: Path
) -> None:
    def run_out(batch_id: str) -> None:
        validate(settings, batch_id)
        expire(settings, batch_id)
        end(settings, batch_id)

    worker = drive(tenant, run_out)
    code, output = submit_wait(tmp_path, jsonl(line("a", MODEL)))
    worker.join(10)
    assert code == exit_codes.BATCH_EXPIRED == 4
    assert "ended expired (exit 4)" in output


def test_submit_wait_exits_5_when_the_batch_is_cancelled(
    settings: Settings, tenant: Tenant, tmp_path: Path
) -> None:
    def cancel(batch_id: str) -> None:
        validate(settings, batch_id)
        tenant.sdk.batches.cancel(batch_id)  # not the CLI: one CliRunner at a time owns stdout
        end(settings, batch_id)

    worker = drive(tenant, cancel)
    code, output = submit_wait(tmp_path, jsonl(line("a", MODEL)))
    worker.join(10)
    assert code == exit_codes.BATCH_CANCELLED == 5
    assert "ended cancelled (exit 5)" in output


def test_cancel_moves_a_batch_to_cancelling(settings: Settings, tenant: Tenant) -> None:
    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(line("a", MODEL))), purpose="batch")
    batch = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    result = CliRunner().invoke(cli.app, ["cancel", batch.id])
    assert result.exit_code == 0 and f"batch {batch.id} is cancelling" in result.output
    assert tenant.sdk.batches.retrieve(batch.id).status == "cancelling"


def test_download_without_output_exits_6_and_cancel_of_an_ended_batch_is_refused(
    settings: Settings, tenant: Tenant, tmp_path: Path
) -> None:
    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(line("a", MODEL))), purpose="batch")
    batch = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(cli.app, ["download", batch.id, "-o", str(out)])
    assert result.exit_code == exit_codes.NOTHING_TO_DO == 6
    assert f"batch {batch.id} is validating" in result.output and not out.exists()
    validate(settings, batch.id)
    run_lines(settings)
    end(settings, batch.id)
    result = CliRunner().invoke(cli.app, ["download", batch.id, "-o", str(out)])
    assert result.exit_code == 0 and out.exists()
    # An ended batch cannot be cancelled: the API's 409 reaches the user as an SDK error, which
    # the console entry point (``main``) turns into one line and exit 1.
    with pytest.raises(openai.ConflictError):
        CliRunner().invoke(cli.app, ["cancel", batch.id], catch_exceptions=False)


def test_the_console_entry_point_exits_7_when_the_api_is_unreachable() -> None:
    env = {**os.environ, "OPENAI_API_KEY": "sk-offpeak-nothing"}
    # Nothing listens on port 9 (discard) here: the SDK cannot connect.
    env["OPENAI_BASE_URL"] = "http://127.0.0.1:9/v1"
    unreachable = subprocess.run(
        [sys.executable, "-c", "from offpeak.cli import main; main()", "status", "batch_x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unreachable.returncode == exit_codes.UNREACHABLE == 7, unreachable.stderr
    assert "cannot reach the Offpeak API at http://127.0.0.1:9/v1/" in unreachable.stdout
    assert "Traceback" not in unreachable.stdout + unreachable.stderr


def test_an_api_error_is_one_line_and_exit_1(
    tenant: Tenant, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["offpeak", "status", "batch_nonexistent"])
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == exit_codes.ERROR == 1
    out = capsys.readouterr().out
    assert "error 404" in out and "batch_nonexistent" in out and "Traceback" not in out


# --- list, cancel, keys ---------------------------------------------------------------------


def test_list_shows_the_tenants_batches_newest_first_with_a_next_page(
    settings: Settings, tenant: Tenant
) -> None:
    ids = []
    for i in range(3):
        file = tenant.sdk.files.create(
            file=("in.jsonl", jsonl(line(f"a{i}", MODEL))), purpose="batch"
        )
        ids.append(
            tenant.sdk.batches.create(
                input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id
        )
    first = CliRunner().invoke(cli.app, ["list", "--limit", "2"])
    assert first.exit_code == 0, first.output
    assert ids[2] in first.output and ids[1] in first.output and ids[0] not in first.output
    assert first.output.index(ids[2]) < first.output.index(ids[1])
    assert f"offpeak list --after {ids[1]}" in first.output
    rest = CliRunner().invoke(cli.app, ["list", "--after", ids[1]])
    assert rest.exit_code == 0 and ids[0] in rest.output and ids[1] not in rest.output
    assert "more:" not in rest.output


def test_keys_list_and_revoke(
    settings: Settings, base_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from api.app import create_app

    for key, value in base_env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    runner = CliRunner()
    try:
        tenant_name = f"k{time.monotonic_ns() % 10**6}"
        made = runner.invoke(cli.app, ["keys", "create", "--tenant", tenant_name, "--name", "ci"])
        key = made.output.strip()
        listed = runner.invoke(cli.app, ["keys", "list", "--tenant", tenant_name])
        assert listed.exit_code == 0, listed.output
        assert tenant_name in listed.output and "ci" in listed.output
        assert key not in listed.output and key[:15] in listed.output  # the prefix only
        key_id = next(w for w in listed.output.split() if w.startswith("key_"))
        with TestClient(create_app(settings)) as http:
            sdk = OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http)
            assert sdk.with_options(max_retries=0).files.list().data == []
            revoked = runner.invoke(cli.app, ["keys", "revoke", key_id])
            assert revoked.exit_code == 0 and "revoked" in revoked.output, revoked.output
            with pytest.raises(openai.AuthenticationError):
                sdk.with_options(max_retries=0).files.list()
        again = runner.invoke(cli.app, ["keys", "list", "--tenant", tenant_name])
        assert time.strftime("%Y-%m-%d", time.gmtime()) in again.output.split(key_id)[1]
        unknown = runner.invoke(cli.app, ["keys", "revoke", "key_nope"])
        assert unknown.exit_code == exit_codes.ERROR and "no key has id" in unknown.output
    finally:
        get_settings.cache_clear()


# --- money, usage, cost cards, progress ---------------------------------------------------


def test_usage_table_fits_80_columns_labels_its_total_and_the_cost_cards_agree(
    settings: Settings, tenant: Tenant
) -> None:
    """The usage table at 80 columns, and one cost-per-million figure: the dashboard's card
    for the model, the usage report's total (the CLI's caption) and the batch's own, for a
    window in which the batch was the model's only work."""
    from api.services import dashboard

    # $1 per engine-second: the instant engine's microseconds cost more than the ledger's 1e-10
    # dollar resolution, which would otherwise decide the figure's third digit.
    settings = settings.model_copy(update={"gpu_cost_per_hour": {"cpu": 3600.0}})
    card_file = tenant.sdk.files.create(
        file=("in.jsonl", jsonl(*(line(f"c{i}", CARD_MODEL, body_max_tokens=2) for i in range(5)))),
        purpose="batch",
    )
    batch = tenant.sdk.batches.create(
        input_file_id=card_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    validate(settings, batch.id)
    run_lines(settings, CARD_MODEL)
    end(settings, batch.id)

    report = client_tools.usage(tenant.sdk, None, None, "model")
    out = io.StringIO()
    client_tools.print_usage(report, Console(file=out, width=80))
    table = out.getvalue()
    assert all(len(row) <= 80 for row in table.splitlines()), table
    for header in ("batches", "requests", "in tok", "out tok", "GPU-s", "cost", "price", "saving"):
        assert header in table
    total_row = next(row for row in table.splitlines() if row.startswith("total"))
    assert f"{report['total']['requests']:,}" in total_row
    assert "e-0" not in table and "e-1" not in table

    with session_scope(settings.resolved_database_url) as session:
        card = next(
            m
            for m in dashboard.data(session, settings, tenant.id, hours=1)["models"]
            if m["model"] == CARD_MODEL
        )
    shown = card["display"]["cost_per_million_tokens"]
    assert shown.startswith("$0.") and "e" not in shown
    per_million = report["total"]["cost_per_million_tokens"]
    assert f"cost per 1M tokens {shown}" in table
    assert format_usd(per_million) == shown
    retrieved = tenant.sdk.batches.retrieve(batch.id).model_extra or {}
    assert format_usd(retrieved["cost_per_million_tokens"]) == shown
    assert card["cost_per_million_tokens"] == pytest.approx(per_million, rel=1e-6)


def test_the_summary_and_the_dashboard_print_no_scientific_notation(
    settings: Settings, tenant: Tenant, tmp_path: Path
) -> None:
    from api.services import dashboard

    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(line("a", MODEL))), purpose="batch")
    batch = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    validate(settings, batch.id)
    run_lines(settings)
    end(settings, batch.id)
    result = CliRunner().invoke(cli.app, ["status", batch.id])
    assert result.exit_code == 0
    assert "$0.0" in result.output and "e-0" not in result.output, result.output
    with session_scope(settings.resolved_database_url) as session:
        [row] = dashboard.data(session, settings, tenant.id, hours=1)["batches"]
    assert row["display"]["price"] == format_usd(row["price"])
    assert row["price"] < 1e-4 and "e" not in row["display"]["price"]


# --- estimate -----------------------------------------------------------------------------


def test_a_validated_batch_carries_its_estimate_which_the_bill_matches(
    settings: Settings, tenant: Tenant, tmp_path: Path
) -> None:
    """Prompt tokens by the model's own tokenizer (the instant engine's: UTF-8 bytes) and the
    price range; after the run, the billed prompt tokens are the estimate's, and the price is
    inside the range. The openai SDK keeps the extra field (``batch.estimate``)."""
    lines = [
        line("a", MODEL, body_max_tokens=5),
        line("b", MODEL, body_max_tokens=7, body_n=2),
        line("c", MODEL, body_max_tokens=3, body_temperature=5),  # refused when it runs
    ]
    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    batch = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert (batch.model_extra or {}).get("estimate") is None  # not validated yet
    validate(settings, batch.id)
    estimate = tenant.sdk.batches.retrieve(batch.id).estimate  # type: ignore[attr-defined]
    prompt = len(InstantEngine(MODEL).encode_chat([{"role": "user", "content": "Hi"}]))
    assert estimate == {
        "prompt_tokens": 2 * prompt,
        "max_completion_tokens": 5 + 2 * 7,
        "price_low": pytest.approx(2 * prompt * 1.0 / 1e6 / 2),
        "price_high": pytest.approx((2 * prompt + 4.0 * 19) / 1e6 / 2),
        "requests": 2,
        "invalid_requests": 1,
    }
    run_lines(settings)
    end(settings, batch.id)
    ended = tenant.sdk.batches.retrieve(batch.id)
    assert ended.usage is not None and ended.usage.input_tokens == estimate["prompt_tokens"]
    price = (ended.model_extra or {})["price"]
    assert estimate["price_low"] <= price <= estimate["price_high"]
    out = CliRunner().invoke(cli.app, ["status", batch.id]).output
    assert "estimate" in out and f"{2 * prompt} prompt tokens" in out


def test_a_batch_runs_before_its_estimate_is_counted_and_a_redelivery_counts_it_once(
    settings: Settings, tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation puts the batch in progress without the estimate (its lines need not wait for
    advice); the estimate is counted after. Fault injected: the control worker dies between the
    two (the validation ran, the estimate never did); the redelivered validation message counts
    it, and a third delivery leaves the first figures as they are."""
    from workers import tasks

    monkeypatch.setattr(tasks, "get_settings", lambda: settings)
    lines = [line(c, MODEL, body_max_tokens=4) for c in "abc"]
    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(*lines)), purpose="batch")
    batch = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert estimate_batch(settings, batch.id) is None  # still validating: nothing to count
    run_validation(settings, get_blob_store(settings.resolved_blob_url), batch.id)
    started = tenant.sdk.batches.retrieve(batch.id)
    assert started.status == "in_progress"
    assert (started.model_extra or {}).get("estimate") is None
    tasks.validate_batch.run(batch.id)  # the message redelivered after the crash
    estimate = (tenant.sdk.batches.retrieve(batch.id).model_extra or {})["estimate"]
    assert estimate["requests"] == 3 and estimate["max_completion_tokens"] == 12
    with session_scope(settings.resolved_database_url) as session:
        batches_repo.get_any(session, batch.id).estimate = {**estimate, "requests": -1}
    tasks.validate_batch.run(batch.id)
    assert estimate_batch(settings, batch.id) is None
    again = (tenant.sdk.batches.retrieve(batch.id).model_extra or {})["estimate"]
    assert again["requests"] == -1, "an estimate once stored is never counted again"


# --- retry ----------------------------------------------------------------------------------


def test_retry_makes_a_batch_of_the_expired_lines_and_not_the_refused_ones(
    settings: Settings, tenant: Tenant
) -> None:
    good, refused = line("ok", MODEL), line("bad", MODEL, body_temperature=5)
    waiting = [line(f"w{i}", MODEL, body_max_tokens=4) for i in range(3)]
    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(good, refused)), purpose="batch")
    first = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="1h"
    )
    validate(settings, first.id)
    run_lines(settings)  # ok succeeds, bad fails alone with a 400
    end(settings, first.id)
    nothing = CliRunner().invoke(cli.app, ["retry", first.id])
    assert (
        nothing.exit_code == exit_codes.NOTHING_TO_DO and "no line that expired" in nothing.output
    )

    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(refused, *waiting)), purpose="batch")
    second = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="1h"
    )
    validate(settings, second.id)
    expire(settings, second.id)
    end(settings, second.id)  # every line expired unrun, the refused one too
    assert tenant.sdk.batches.retrieve(second.id).status == "expired"
    result = CliRunner().invoke(cli.app, ["retry", second.id])
    assert result.exit_code == 0, result.output
    assert f"4 lines of {second.id}" in result.output
    retry = tenant.sdk.batches.list(limit=1).data[0]
    assert retry.id != second.id and (retry.metadata or {}).get("retry_of") == second.id
    assert (retry.endpoint, retry.completion_window) == ("/v1/chat/completions", "1h")
    content = tenant.sdk.files.content(retry.input_file_id).content
    assert content.splitlines() == [refused, *waiting]  # the original lines, byte for byte
    running = CliRunner().invoke(cli.app, ["retry", retry.id])
    assert running.exit_code == exit_codes.NOTHING_TO_DO and "once it ends" in running.output


# --- after= cursors and the data folder ---------------------------------------------------


def test_an_unknown_after_is_a_400_and_a_known_one_pages(tenant: Tenant) -> None:
    sdk = tenant.sdk
    files = [sdk.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch") for i in range(3)]
    batch = sdk.batches.create(
        input_file_id=files[0].id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: sdk.batches.list(after="batch_nonexistent"),
        lambda: sdk.files.list(after="file-nonexistent"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["param"] == "after" and error["code"] == "invalid_value"
        assert "nonexistent" in error["message"]
    assert sdk.batches.list(after=batch.id).data == []
    newest_first = [f.id for f in sdk.files.list(order="desc").data]
    assert [f.id for f in sdk.files.list(order="desc", after=newest_first[0]).data] == (
        newest_first[1:]
    )
    sdk.files.delete(newest_first[0])  # a deleted file still marks its place
    assert [f.id for f in sdk.files.list(order="desc", after=newest_first[0]).data] == (
        newest_first[1:]
    )


def test_a_relative_data_folder_is_resolved_once_and_a_missing_one_fails_in_one_line(
    tmp_path: Path,
) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("OFFPEAK_") and k != "PYTHONPATH"
    }
    env["OFFPEAK_DATA_DIR"] = "relative-data"
    assert Settings(data_dir=Path("relative-data")).data_dir == Path.cwd() / "relative-data"
    elsewhere = tmp_path / "another-directory"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-c", "from offpeak.cli import main; main()", "keys", "list"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == exit_codes.ERROR, result.stderr
    out = result.stdout + result.stderr
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    assert f"the folder {elsewhere / 'relative-data'} does not exist" in out


def test_a_host_that_cannot_load_the_tokenizer_validates_without_an_estimate(
    settings: Settings, tenant: Tenant, caplog: pytest.LogCaptureFixture
) -> None:
    """The estimate is advice: a model whose folder this control worker cannot open (a real
    engine configured with a path that does not exist here) still validates and runs."""
    broken = "cli-no-folder-model"
    settings = settings.model_copy(
        update={"models": {**settings.models, broken: ModelConfig(path="/nonexistent/model")}}
    )
    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(line("a", broken))), purpose="batch")
    batch = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with caplog.at_level("WARNING", logger="workers.estimate"):
        validate(settings, batch.id)
    validated = tenant.sdk.batches.retrieve(batch.id)
    assert validated.status == "in_progress"
    assert (validated.model_extra or {}).get("estimate") is None
    assert any("no cost estimate" in r.getMessage() for r in caplog.records)


def test_an_endpoint_that_raises_while_estimating_does_not_fail_validation(
    settings: Settings, tenant: Tenant, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injected: the endpoint's ``prepare`` raises something unexpected for every line;
    the batch still validates, with its lines counted as invalid in the estimate."""
    from offpeak import endpoints

    chat = endpoints.ENDPOINTS["/v1/chat/completions"]

    def broken(_body: object, _tokenizer: object) -> None:
        raise KeyError("a bug in an endpoint module")

    monkeypatch.setattr(chat, "prepare", broken)
    file = tenant.sdk.files.create(file=("in.jsonl", jsonl(line("a", MODEL))), purpose="batch")
    batch = tenant.sdk.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    validate(settings, batch.id)
    validated = tenant.sdk.batches.retrieve(batch.id)
    assert validated.status == "in_progress"
    estimate = (validated.model_extra or {})["estimate"]
    assert estimate["requests"] == 0 and estimate["invalid_requests"] == 1
