"""``/v1/responses`` batches and structured output end to end, through the official ``openai`` SDK
against a live API and workers on the real SmolLM2 model.

- A responses batch: upload, create, poll, download; every output line's body parses as the
  SDK's ``Response`` and ``output_text`` is the answer; a tiny ``max_output_tokens`` is an
  ``incomplete`` response; what a batch cannot do is a 400 line naming the parameter; the batch's
  ``usage`` and bill count responses lines as chat lines.
- A structured-output batch (chat ``response_format`` and responses ``text.format``) with three
  schemas (nested objects, enums, arrays): every answer parses as JSON and validates against its
  schema (``jsonschema``); ``json_object`` answers parse as JSON objects; a schema its
  meta-schema refuses and one the grammar backend refuses at ``add`` are 400 lines while the
  other lines succeed, and the engine is not restarted for them.
"""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator
from openai import OpenAI
from openai.types.responses import Response

from tests.support.batches import check_billed_once, files_of, wait_for_end

pytestmark = pytest.mark.engine
MODEL = "SmolLM2-135M-Instruct"
RESPONSES, CHAT = "/v1/responses", "/v1/chat/completions"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "country": {"type": "string", "maxLength": 40},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
REVIEW = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
    },
    "required": ["sentiment", "stars"],
    "additionalProperties": False,
}
COLOURS = {
    "type": "object",
    "properties": {
        "colours": {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 1,
            "maxItems": 3,
        }
    },
    "required": ["colours"],
    "additionalProperties": False,
}
SCHEMAS = {
    "person": (PERSON, "Describe a fictional person as JSON: name, age and address."),
    "review": (
        REVIEW,
        "Classify this review as JSON: 'The food was great but the service was slow.'",
    ),
    "colours": (COLOURS, "List up to three colours of the French flag as JSON."),
}


def request_line(custom_id: str, url: str, body: dict[str, Any]) -> bytes:
    return orjson.dumps(
        {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}
    )


def start_batch(client: OpenAI, url: str, lines: list[bytes]) -> str:
    """Upload ``lines`` and create a batch of them; its id."""
    file = client.files.create(file=("in.jsonl", b"\n".join(lines) + b"\n"), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint=url,  # type: ignore[arg-type]
        completion_window="24h",
    )
    return batch.id


def end_batch(client: OpenAI, live: Any, batch_id: str, lines: list[bytes]):  # type: ignore[no-untyped-def]
    """Wait for the batch of ``lines`` to complete; the batch, its output lines and its error
    lines' errors, by ``custom_id`` (each ``custom_id`` of ``lines`` in one of the two)."""
    batch = wait_for_end(client, batch_id, live)
    assert batch.status == "completed", batch
    output, errors = files_of(client, batch)
    seen = sorted(line["custom_id"] for line in output + errors)
    assert seen == sorted(orjson.loads(raw)["custom_id"] for raw in lines)
    return (
        batch,
        {line["custom_id"]: line for line in output},
        {line["custom_id"]: line["response"]["body"]["error"] for line in errors},
    )


def run_batch(client: OpenAI, live: Any, url: str, lines: list[bytes]):  # type: ignore[no-untyped-def]
    return end_batch(client, live, start_batch(client, url, lines), lines)


def engine_loads(live: Any) -> int:
    return (
        (live.log_dir / "engine.log").read_text(errors="replace").count(f"engine for {MODEL} ready")
    )


def test_a_responses_batch_end_to_end(live_sdk: OpenAI, live: Any, live_settings: Any) -> None:
    lines = [
        request_line(
            "paris",
            RESPONSES,
            {
                "instructions": "Answer in one short sentence.",
                "input": "What is the capital of France?",
                "max_output_tokens": 24,
                "temperature": 0,
                "metadata": {"topic": "geography"},
            },
        ),
        request_line(
            "items",
            RESPONSES,
            {
                "input": [
                    {"type": "message", "role": "user", "content": "Hi, I am Ada."},
                    {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                    {"role": "user", "content": [{"type": "input_text", "text": "Who am I?"}]},
                ],
                "max_output_tokens": 24,
                "temperature": 0,
            },
        ),
        request_line(
            "tiny",
            RESPONSES,
            {"input": "Write a long story about a dragon.", "max_output_tokens": 4},
        ),
        request_line("tools", RESPONSES, {"input": "Hi", "tools": [{"type": "web_search"}]}),
        request_line("previous", RESPONSES, {"input": "Hi", "previous_response_id": "resp_1"}),
    ]
    batch, output, errors = run_batch(live_sdk, live, RESPONSES, lines)
    assert sorted(errors) == ["previous", "tools"]
    assert (errors["tools"]["param"], errors["tools"]["code"]) == (
        "tools[0].type",
        "unsupported_value",
    )
    assert errors["previous"]["param"] == "previous_response_id"
    responses = {
        cid: Response.model_validate(line["response"]["body"]) for cid, line in output.items()
    }
    for response in responses.values():
        assert response.id.startswith("resp_") and response.model == MODEL
        assert response.output_text and response.output[0].type == "message"
        usage = response.usage
        assert usage is not None and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert "Paris" in responses["paris"].output_text
    assert responses["paris"].status == "completed"
    assert responses["paris"].metadata == {"topic": "geography"}
    assert responses["paris"].instructions == "Answer in one short sentence."
    tiny = responses["tiny"]
    assert tiny.status == "incomplete" and tiny.incomplete_details is not None
    assert tiny.incomplete_details.reason == "max_output_tokens"
    assert tiny.usage is not None and tiny.usage.output_tokens == 4
    # The batch's usage and bill count responses lines as chat lines.
    usage, counts = batch.usage, batch.request_counts
    assert usage is not None and counts is not None
    assert (counts.total, counts.completed, counts.failed) == (5, 3, 2)
    bodies = [r.usage for r in responses.values() if r.usage is not None]
    assert usage.input_tokens == sum(u.input_tokens for u in bodies)
    assert usage.output_tokens == sum(u.output_tokens for u in bodies)
    check_billed_once(live_settings.resolved_database_url, batch)


def _schema_lines() -> tuple[list[bytes], list[bytes]]:
    chat, responses = [], []
    for name, (schema, prompt) in SCHEMAS.items():
        chat.append(
            request_line(
                f"chat-{name}",
                CHAT,
                {
                    "messages": [{"role": "user", "content": prompt}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": name, "schema": schema, "strict": True},
                    },
                    "max_tokens": 200,
                    "temperature": 0,
                },
            )
        )
        responses.append(
            request_line(
                f"resp-{name}",
                RESPONSES,
                {
                    "input": prompt,
                    "text": {"format": {"type": "json_schema", "name": name, "schema": schema}},
                    "max_output_tokens": 200,
                    "temperature": 0,
                },
            )
        )
    return chat, responses


def test_structured_output_batches(live_sdk: OpenAI, live: Any) -> None:
    loads_before = engine_loads(live)
    chat, responses = _schema_lines()
    unresolvable: dict[str, Any] = copy.deepcopy(PERSON)
    unresolvable["properties"]["address"] = {"$ref": "#/$defs/missing"}
    chat += [
        request_line(
            "chat-json-object",
            CHAT,
            {
                "messages": [{"role": "user", "content": SCHEMAS["person"][1]}],
                "response_format": {"type": "json_object"},
                "max_tokens": 200,
                "temperature": 0,
            },
        ),
        request_line(
            "chat-bad-schema",
            CHAT,
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "nonsense"}},
                },
            },
        ),
        request_line(
            "chat-backend-refuses",
            CHAT,
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "refs", "schema": unresolvable},
                },
            },
        ),
        request_line(
            "chat-plain",
            CHAT,
            {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        ),
    ]
    responses.append(
        request_line(
            "resp-json-object",
            RESPONSES,
            {
                "input": SCHEMAS["person"][1],
                "text": {"format": {"type": "json_object"}},
                "max_output_tokens": 200,
                "temperature": 0,
            },
        )
    )
    # Both batches at once: the engine decodes their lines side by side instead of one batch
    # after the other; each batch's checks stay its own.
    chat_id = start_batch(live_sdk, CHAT, chat)
    resp_id = start_batch(live_sdk, RESPONSES, responses)
    _, chat_out, chat_errors = end_batch(live_sdk, live, chat_id, chat)
    _, resp_out, resp_errors = end_batch(live_sdk, live, resp_id, responses)
    assert not resp_errors
    assert sorted(chat_errors) == ["chat-backend-refuses", "chat-bad-schema"]
    bad = chat_errors["chat-bad-schema"]
    assert (bad["param"], bad["code"]) == (
        "response_format.json_schema.schema",
        "invalid_json_schema",
    )
    refused = chat_errors["chat-backend-refuses"]
    assert (refused["param"], refused["code"]) == (
        "response_format.json_schema.schema",
        "invalid_json_schema",
    )
    texts = {
        cid: line["response"]["body"]["choices"][0]["message"]["content"]
        for cid, line in chat_out.items()
    }
    texts |= {
        cid: Response.model_validate(line["response"]["body"]).output_text
        for cid, line in resp_out.items()
    }
    for name, (schema, _) in SCHEMAS.items():
        for custom_id in (f"chat-{name}", f"resp-{name}"):
            Draft202012Validator(schema).validate(orjson.loads(texts[custom_id]))
    for custom_id in ("chat-json-object", "resp-json-object"):
        assert isinstance(orjson.loads(texts[custom_id]), dict)
    assert texts["chat-plain"]
    # The refused schema was a verdict on its line, not an engine failure: no reload (the
    # engine may have loaded for these batches, if no test ran before them).
    assert engine_loads(live) == max(loads_before, 1)
