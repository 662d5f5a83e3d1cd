"""Validation rules, each with the 1-based line it names, run by the worker's validation step on
real PostgreSQL and the blob store."""

from __future__ import annotations

import orjson
import pytest
from sqlalchemy import func, select

from offpeak.settings import ModelConfig, Settings
from storage.blobs import get_blob_store
from storage.db import session_scope
from storage.models import RequestLine
from tests.support.batches import line, validate
from workers.validation import run_validation

#: A model name only these tests use, so no live engine worker ever runs their batches.
MODEL = "validation-model"


@pytest.fixture()
def settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"models": {MODEL: ModelConfig(engine="instant")}})


@pytest.mark.parametrize(
    ("second_line", "code", "param"),
    [
        (b'{"custom_id": "x", "method": ', "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        (line(None), "missing_required_parameter", "custom_id"),
        (line("x", method=None), "missing_required_parameter", "method"),
        (line("x", url=None), "missing_required_parameter", "url"),
        (line("x", body=None), "missing_required_parameter", "body"),
        (line("x", method="GET"), "invalid_request", "method"),
        (line(""), "invalid_request", "custom_id"),
        (line("x", url="/v1/completions"), "invalid_url", "url"),
        (line("x", body_stream=True), "streaming_unsupported", "body.stream"),
        (line("x", body_model=None), "missing_required_parameter", "body.model"),
        (line("x", body_model="gpt-9"), "model_not_found", "body.model"),
        (line("x", body_messages=None), "missing_required_parameter", "body.messages"),
        (line("a"), "duplicate_custom_id", "custom_id"),
        (line("x", body="text"), "invalid_request", "body"),
    ],
)
def test_rule_names_its_line(
    settings: Settings, second_line: bytes, code: str, param: str | None
) -> None:
    batch, rows = validate(settings, line("a") + b"\n" + second_line + b"\n" + line("c") + b"\n")
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e["code"], e["line"], e["param"]) for e in batch.errors] == [(code, 2, param)]
    assert rows == 0  # nothing half-inserted


def test_mismatched_model(settings: Settings) -> None:
    two = settings.model_copy(
        update={"models": {**settings.models, "other": settings.models[MODEL]}}
    )
    batch, _ = validate(two, line("a") + b"\n" + line("b", body_model="other") + b"\n")
    assert [(e["code"], e["line"]) for e in batch.errors] == [("mismatched_model", 2)]


def test_completions_need_prompt(settings: Settings) -> None:
    data = line("a", url="/v1/completions", body={"model": MODEL})
    batch, _ = validate(settings, data, "/v1/completions")
    assert [(e["code"], e["param"]) for e in batch.errors] == [
        ("missing_required_parameter", "body.prompt")
    ]


def test_every_problem_listed_with_lines_counting_blank_ones(settings: Settings) -> None:
    data = b"\n".join([line("a"), b"", b"oops", b"   ", line("a"), line("d", url="/x")])
    batch, _ = validate(settings, data)
    assert [(e["code"], e["line"]) for e in batch.errors] == [
        ("invalid_json_line", 3),
        ("duplicate_custom_id", 5),
        ("invalid_url", 6),
    ]


def test_bom_crlf_blank_lines_are_fine(settings: Settings) -> None:
    data = b"\xef\xbb\xbf" + line("a") + b"\r\n\r\n  \r\n" + line("b") + b"\r\n"
    batch, rows = validate(settings, data)
    assert batch.status == "in_progress" and batch.errors is None
    assert (batch.total, rows, batch.model) == (2, 2, MODEL)


def test_empty_file(settings: Settings) -> None:
    batch, _ = validate(settings, b"\n \r\n")
    assert [e["code"] for e in batch.errors] == ["empty_file"]


def test_too_many_requests(settings: Settings) -> None:
    small = settings.model_copy(update={"max_requests_per_batch": 2})
    batch, rows = validate(small, b"\n".join(line(str(i)) for i in range(3)))
    assert [(e["code"], e["line"]) for e in batch.errors] == [("too_many_requests", 3)]
    assert rows == 0


def test_validation_is_idempotent(settings: Settings) -> None:
    batch, rows = validate(settings, line("a"))
    run_validation(settings, get_blob_store(settings.resolved_blob_url), batch.id)
    with session_scope(settings.resolved_database_url) as session:
        again = session.scalar(select(func.count()).where(RequestLine.batch_id == batch.id))
    assert rows == again == 1


def test_many_lines_go_in_by_copy(settings: Settings) -> None:
    data = b"\n".join(line(f"r{i}") for i in range(12_345))
    batch, rows = validate(settings, data)
    assert batch.status == "in_progress" and rows == batch.total == 12_345
    with session_scope(settings.resolved_database_url) as session:
        last = session.scalar(
            select(RequestLine).where(RequestLine.batch_id == batch.id, RequestLine.line == 12_345)
        )
        assert last is not None and last.custom_id == "r12344"
        assert orjson.loads(last.line_json)["custom_id"] == "r12344"


def test_nul_in_custom_id_is_a_line_error(settings: Settings) -> None:
    batch, rows = validate(settings, line("a") + b"\n" + line("x\x00y") + b"\n")
    assert [(e["code"], e["line"], e["param"]) for e in batch.errors] == [
        ("invalid_request", 2, "custom_id")
    ]
    assert rows == 0


def test_nul_in_a_model_name_fails_the_batch_with_the_nul_shown(settings: Settings) -> None:
    """The error quotes the client's model name; PostgreSQL's jsonb cannot store U+0000, so
    storing the errors must not fail and leave the batch ``validating``."""
    batch, rows = validate(settings, line("a") + b"\n" + line("b", body_model="Smol\x00") + b"\n")
    assert batch.status == "failed" and batch.failed_at is not None
    ((code, number, param, message),) = [
        (e["code"], e["line"], e["param"], e["message"]) for e in batch.errors
    ]
    assert (code, number, param) == ("model_not_found", 2, "body.model")
    assert "'Smol\\u0000'" in message and "\x00" not in message
    assert rows == 0


def test_required_body_fields_are_the_endpoints(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation asks the registry what a line's body must carry: a new endpoint's fields."""
    from offpeak import endpoints
    from offpeak.endpoints.completions import Completions

    class Needy(Completions):
        url = "/v1/needy"
        required_fields = ("prompt", "suffix_text")

    monkeypatch.setitem(endpoints.ENDPOINTS, Needy.url, Needy())
    good = line("a", url=Needy.url, body={"model": MODEL, "prompt": "x", "suffix_text": "y"})
    bad = line("b", url=Needy.url, body={"model": MODEL, "prompt": "x"})
    batch, _ = validate(settings, good + b"\n" + bad, Needy.url)
    assert [(e["code"], e["line"], e["param"]) for e in batch.errors] == [
        ("missing_required_parameter", 2, "body.suffix_text")
    ]
