"""``/v1/responses`` lines and structured output, without an engine: bodies to engine input (every
malformed body a 400 line naming its parameter), records to ``response`` objects the ``openai``
SDK's ``Response`` type parses, chat's ``response_format`` and the Responses API's
``text.format`` to ``StructuredOutput`` (a schema its meta-schema refuses is a 400 line; one the
engine's grammar backend refuses at ``add`` is a 400 line too, and the other lines join), and
the prefix ordering and slot sizing of lines that carry schemas.

The same on the real model, through the SDK: ``tests/e2e/live/test_responses.py``.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.responses import Response

from offpeak import endpoints
from offpeak.endpoints import SamplingSpec, records
from offpeak.endpoints.base import StructuredOutput
from storage.repositories.requests import ClaimedRequest
from workers.engine.base import EngineRequest, EngineResult, RequestRefused
from workers.engine.instant import InstantEngine
from workers.engine_io import LineError, Prepared, answer, prepare
from workers.runner.admission import prepare_chunk
from workers.runner.held import HeldLine, HeldLines

RESPONSES, CHAT = "/v1/responses", "/v1/chat/completions"
ENGINE = InstantEngine("m", max_model_len=512)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def resp(**changes: Any) -> dict[str, Any]:
    return {"model": "m", "input": "Hi", **changes}


def chat(**changes: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **changes}


def schema_format(schema: Any, name: str = "person") -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": name, "schema": schema, "strict": True}}


def refused(url: str, body: dict[str, Any]) -> tuple[str | None, str | None, str]:
    with pytest.raises(LineError) as info:
        prepare("1", url, body, ENGINE)
    error = info.value
    assert error.status_code == 400 and set(error.body()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    return error.param, error.code, error.message


# --- Responses bodies -------------------------------------------------------------------------

UNSUPPORTED = [
    ("previous_response_id", "resp_123"),
    ("conversation", "conv_123"),
    ("background", True),
    ("stream", True),
    ("prompt", {"id": "pmpt_1"}),
    ("reasoning", {"effort": "high"}),
    ("include", ["message.output_text.logprobs"]),
    ("top_logprobs", 3),
    ("context_management", [{"type": "compaction"}]),
]


@pytest.mark.parametrize(("name", "value"), UNSUPPORTED)
def test_what_a_batch_cannot_do_is_a_400_line_naming_the_parameter(name: str, value: Any) -> None:
    assert refused(RESPONSES, resp(**{name: value})) == (
        name,
        "unsupported_parameter",
        f"'{name}' is not supported by this server.",
    )


BAD = [
    (resp(input=None), ("input", "missing_required_parameter")),
    (resp(input=5), ("input", "invalid_type")),
    (resp(input=[]), ("input", "invalid_value")),
    (
        resp(input=[{"type": "function_call_output", "output": "x"}]),
        ("input[0].call_id", "missing_required_parameter"),
    ),
    (resp(input=[{"type": "reasoning", "summary": []}]), ("input[0].type", None)),
    (resp(input=[{"type": "item_reference", "id": "msg_1"}]), ("input[0].type", None)),
    (resp(input=[{"role": "tool", "content": "x"}]), ("input[0].role", "invalid_value")),
    (resp(input=[{"role": "user"}]), ("input[0].content", "missing_required_parameter")),
    (
        resp(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
        ("input[0].content", "unsupported_content"),
    ),
    (
        resp(input=[{"role": "user", "content": [{"type": "input_text", "text": 5}]}]),
        ("input[0].content", "invalid_type"),
    ),
    (resp(instructions=["a"]), ("instructions", "invalid_type")),
    (resp(max_output_tokens=0), ("max_output_tokens", "invalid_value")),
    (resp(max_output_tokens="8"), ("max_output_tokens", "invalid_type")),
    (resp(max_output_tokens=600), ("input", "context_length_exceeded")),
    (resp(input="word " * 600), ("input", "context_length_exceeded")),
    (resp(temperature=3), ("temperature", "invalid_value")),
    (resp(top_p=0), ("top_p", "invalid_value")),
    (resp(tool_choice="required"), ("tool_choice", "invalid_value")),
    (resp(tool_choice={"type": "function", "name": "f"}), ("tool_choice", "invalid_value")),
    (resp(tool_choice={"type": "web_search_preview"}), ("tool_choice", "unsupported_value")),
    (resp(tools=[{"type": "web_search"}]), ("tools[0].type", "unsupported_value")),
    (resp(tools=[{"type": "file_search", "vector_store_ids": []}]), ("tools[0].type", None)),
    (
        resp(tools=[{"type": "function", "name": "f", "parameters": {"type": 5}}]),
        ("tools[0].parameters", "invalid_json_schema"),
    ),
    (resp(truncation="auto"), ("truncation", "unsupported_value")),
    (resp(metadata={"k": 1}), ("metadata", "invalid_value")),
    (resp(metadata={f"k{i}": "v" for i in range(17)}), ("metadata", "invalid_value")),
    (resp(text={"format": {"type": "xml"}}), ("text.format.type", "invalid_value")),
    (resp(text={"format": {"type": "json_schema", "schema": PERSON}}), ("text.format.name", None)),
    (
        resp(text={"format": {"type": "json_schema", "name": "p"}}),
        ("text.format.schema", "missing_required_parameter"),
    ),
    (resp(text=schema_format(PERSON, name="a b")), ("text.format.name", "invalid_value")),
    (resp(text=schema_format({"type": "nonsense"})), ("text.format.schema", "invalid_json_schema")),
    (resp(text=schema_format([1])), ("text.format.schema", "invalid_json_schema")),
]


@pytest.mark.parametrize(("body", "expected"), BAD)
def test_bad_responses_bodies_are_400_lines(
    body: dict[str, Any], expected: tuple[str, str | None]
) -> None:
    param, code, message = refused(RESPONSES, body)
    assert param == expected[0] and message
    if expected[1] is not None:
        assert code == expected[1]


def test_a_responses_body_becomes_a_chat_prompt_with_instructions_first() -> None:
    prepared = prepare(
        "1",
        RESPONSES,
        resp(
            instructions="Be brief.",
            input=[
                {"role": "developer", "content": "Answer in English."},
                {"type": "message", "role": "user", "content": "Hi"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "Bye"}]},
            ],
            max_output_tokens=20,
            temperature=0,
            top_p=0.5,
            metadata={"k": "v"},
            store=True,
            user="u",
            service_tier="auto",
            parallel_tool_calls=False,
            tool_choice="none",
            max_tool_calls=3,
            text={"verbosity": "low"},
        ),
        ENGINE,
    )
    assert bytes(prepared.request.prompt_token_ids) == (
        b"<system>Be brief.\n<system>Answer in English.\n<user>Hi\n<assistant>Hello\n<user>Bye\n"
        b"<assistant>"
    )
    assert prepared.request.sampling == SamplingSpec(max_tokens=20, temperature=0.0, top_p=0.5)
    assert prepared.needs == ((len(prepared.request.prompt_token_ids), 20),)
    assert prepared.echo is not None and prepared.echo["metadata"] == {"k": "v"}
    # A string input is one user message; with no max_output_tokens the window is the budget.
    plain = prepare("2", RESPONSES, resp(), ENGINE)
    assert bytes(plain.request.prompt_token_ids) == b"<user>Hi\n<assistant>"
    assert plain.request.sampling.max_tokens == 512 - len(b"<user>Hi\n<assistant>")


# --- Response objects -------------------------------------------------------------------------


def responses_answer(body: dict[str, Any], text: str, reason: str) -> dict[str, Any]:
    prepared = prepare("1", RESPONSES, body, ENGINE)
    tokens = list(text.encode())
    result = EngineResult(
        "1", len(prepared.request.prompt_token_ids), 4, [_completion(text, tokens, reason)]
    )
    record = answer(prepared, result, created=1_700_000_000)
    return endpoints.get(RESPONSES).render(record)


def _completion(text: str, tokens: list[int], reason: str) -> Any:
    from workers.engine.base import Completion

    return Completion(text, tokens, reason)


def test_an_answer_renders_as_a_response_the_sdk_parses() -> None:
    body = resp(
        instructions="Be brief.",
        metadata={"k": "v"},
        temperature=0.2,
        max_output_tokens=64,
        text=schema_format(PERSON),
    )
    rendered = responses_answer(body, '{"name": "Ada", "age": 36}', "stop")
    response = Response.model_validate(rendered)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == '{"name": "Ada", "age": 36}'
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id == "msg_" + response.id[5:]
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert (response.instructions, response.metadata) == ("Be brief.", {"k": "v"})
    assert (response.temperature, response.top_p, response.max_output_tokens) == (0.2, 1.0, 64)
    assert response.text is not None and response.text.format is not None
    assert response.text.format.type == "json_schema"
    assert response.text.format.schema_ == PERSON  # type: ignore[union-attr]
    assert response.tools == [] and response.tool_choice == "auto"
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.input_tokens_details.cached_tokens) == (
        len(b"<system>Be brief.\n<user>Hi\n<assistant>"),
        4,
    )
    assert usage.output_tokens == len(b'{"name": "Ada", "age": 36}')
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_a_spent_token_budget_is_an_incomplete_response() -> None:
    response = Response.model_validate(responses_answer(resp(max_output_tokens=2), "He", "length"))
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert response.output_text == "He" and response.text is not None
    assert response.text.format is not None and response.text.format.type == "text"


def test_responses_lines_are_served_and_named_in_the_registry() -> None:
    assert RESPONSES in endpoints.BATCH_ENDPOINTS
    assert RESPONSES not in endpoints.UNSERVED_BATCH_ENDPOINTS
    assert endpoints.get(RESPONSES).response_id_prefix == "resp_"


# --- Structured output ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "body", "expected"),
    [
        (CHAT, chat(), None),
        (CHAT, chat(response_format={"type": "text"}), None),
        (CHAT, chat(response_format={"type": "json_object"}), StructuredOutput()),
        (
            CHAT,
            chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
                }
            ),
            StructuredOutput(orjson.dumps(PERSON).decode(), "response_format.json_schema.schema"),
        ),
        # No schema in chat's json_schema: any JSON object (OpenAI's reference: schema optional).
        (
            CHAT,
            chat(response_format={"type": "json_schema", "json_schema": {"name": "any"}}),
            StructuredOutput(param="response_format.json_schema"),
        ),
        (RESPONSES, resp(text={"format": {"type": "text"}}), None),
        (
            RESPONSES,
            resp(text={"format": {"type": "json_object"}}),
            StructuredOutput(param="text.format"),
        ),
        (
            RESPONSES,
            resp(text=schema_format(PERSON)),
            StructuredOutput(orjson.dumps(PERSON).decode(), "text.format.schema"),
        ),
    ],
)
def test_formats_become_structured_output(
    url: str, body: dict[str, Any], expected: StructuredOutput | None
) -> None:
    assert prepare("1", url, body, ENGINE).request.sampling.structured_output == expected


BAD_SCHEMAS = [
    {"type": "nonsense"},
    {"type": "object", "properties": {"a": {"type": "object", "required": "a"}}},
    {"type": "string", "pattern": "(unclosed"},
    {"type": "array", "minItems": -1},
    {"enum": "not-a-list"},
]


@pytest.mark.parametrize("schema", BAD_SCHEMAS)
def test_a_schema_its_meta_schema_refuses_is_a_400_line(schema: Any) -> None:
    body = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    )
    param, code, message = refused(CHAT, body)
    assert (param, code) == ("response_format.json_schema.schema", "invalid_json_schema")
    assert message.startswith("Invalid schema for response_format 's': at ")
    assert refused(RESPONSES, resp(text=schema_format(schema, "s")))[:2] == (
        "text.format.schema",
        "invalid_json_schema",
    )


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "xml"}, "response_format.type"),
        ("json", "response_format.type"),
        ({"type": "json_schema"}, "response_format.json_schema"),
        ({"type": "json_schema", "json_schema": "x"}, "response_format.json_schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": PERSON}},
            "response_format.json_schema.name",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"},
            },
            "response_format.json_schema.strict",
        ),
    ],
)
def test_a_malformed_response_format_names_its_field(response_format: Any, param: str) -> None:
    assert refused(CHAT, chat(response_format=response_format))[0] == param


class RefusingEngine(InstantEngine):
    """Refuses, as vLLM's grammar backends do at ``add``, every schema with a ``$ref``."""

    def add(self, request: EngineRequest) -> None:
        spec = request.sampling.structured_output
        if spec is not None and spec.json_schema and "$ref" in spec.json_schema:
            raise RequestRefused("Grammar error: bad $ref", spec.param, "invalid_json_schema")
        super().add(request)


def test_a_schema_the_engine_refuses_fails_its_line_alone() -> None:
    engine = RefusingEngine("m", max_model_len=512)
    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    bodies = [
        resp(text=schema_format(PERSON)),
        resp(text=schema_format(bad, "bad")),
        resp(text={"format": {"type": "json_object"}}),
    ]
    held = HeldLines()
    held.queue(
        HeldLine(
            ClaimedRequest(i, "batch_1", f"c{i}", "{}", 1), prepare(str(i), RESPONSES, b, engine)
        )
        for i, b in enumerate(bodies)
    )
    errors: list[tuple[int, LineError]] = []
    held.admit(engine, 10, lambda _: True, lambda h, e: errors.append((h.row.id, e)))
    assert [(i, e.param, e.code, e.status_code) for i, e in errors] == [
        (1, "text.format.schema", "invalid_json_schema", 400)
    ]
    assert sorted(held.running) == ["0", "2"]
    assert sorted(r.request_id for r in engine.step()) == ["0", "2"]


def test_lines_with_schemas_keep_prefix_order_and_slot_sizes() -> None:
    """Schemas change neither the prompt nor the token budget, so a chunk of lines with and
    without them is grouped by shared prefix and sized as plain lines are."""
    system = "You extract records from text. " * 4
    formats = [schema_format(PERSON), None, {"format": {"type": "json_object"}}]
    rows = []
    for i in range(9):
        body = resp(
            instructions=system if i % 2 else "Other.",
            input=f"item {i}",
            max_output_tokens=30 + i,
        )
        if formats[i % 3] is not None:
            body["text"] = formats[i % 3]
        line = {"custom_id": f"c{i}", "method": "POST", "url": RESPONSES, "body": body}
        rows.append(ClaimedRequest(i, "batch_1", f"c{i}", orjson.dumps(line).decode(), 1))
    chunk = prepare_chunk(rows, ENGINE, held=(), urgent=(), max_attempts=3, at=0.0)
    assert not chunk.failed
    order = [h.row.id for h in chunk.ready]
    # The odd lines share the long system prompt: they sit next to each other.
    odd = [order.index(i) for i in (1, 3, 5, 7)]
    assert max(odd) - min(odd) == 3
    for h in chunk.ready:
        ids = h.prepared.request.prompt_token_ids
        assert h.prepared.needs == ((len(ids), 30 + h.row.id),)
    with_schema = [h for h in chunk.ready if h.prepared.request.sampling.structured_output]
    assert len(with_schema) == 6


def test_prepared_lines_carry_the_echo_into_the_record() -> None:
    prepared: Prepared = prepare("1", RESPONSES, resp(metadata={"a": "b"}), ENGINE)
    result = EngineResult("1", 3, 0, [_completion("x", [1], "stop")])
    record = answer(prepared, result, created=1)
    assert record.echo == {"metadata": {"a": "b"}}
    # Rendered again from the stored record: the same bytes (the message id is derived).
    stored = records.load(records.dump(record))
    assert isinstance(stored, records.Answer)
    responses = endpoints.get(RESPONSES)
    assert orjson.dumps(responses.render(stored)) == orjson.dumps(responses.render(record))
    chat_record = answer(prepare("1", CHAT, chat(), ENGINE), result, created=1)
    assert chat_record.echo is None


# --- Batch create and validation --------------------------------------------------------------
