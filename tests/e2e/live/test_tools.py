"""Function calling end to end, through the official ``openai`` and ``anthropic`` SDKs against a
live API and workers on the real SmolLM2 model (whose template ignores tools: they reach it as a
Hermes system block).

Each API's batch holds a named (forced) call, a required call, an ``auto`` and a ``none`` line,
a line replaying an earlier call and its result, a tool whose schema is no JSON Schema and a
choice naming an unknown tool. The forced calls always parse and fit their tool's schema
(``jsonschema``); ``auto`` and ``none`` lines answer; the two bad lines fail alone with a 400
naming the parameter.
"""

from __future__ import annotations

from typing import Any

import anthropic
import orjson
import pytest
from jsonschema import Draft202012Validator
from openai import OpenAI
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from offpeak.cli.supervisor import ServiceProcesses
from offpeak.settings import Settings
from tests.e2e.live.test_message_batches import MODEL, _wait
from tests.e2e.live.test_responses import request_line, run_batch
from tests.support.database import new_key

pytestmark = pytest.mark.engine
CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
#: Bounded strings keep a forced call within ``max_tokens`` on a small model.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 20}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = "What is the weather in Paris, in celsius?"
BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "nonsense"}}}


def _chat_tools(weather: dict[str, Any] = WEATHER) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": weather,
            },
        },
        {
            "type": "function",
            "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME},
        },
    ]


def _chat(custom_id: str, **body: Any) -> bytes:
    messages = body.pop("messages", [{"role": "user", "content": QUESTION}])
    return request_line(
        custom_id,
        CHAT,
        {"messages": messages, "tools": _chat_tools(), "max_tokens": 64, "temperature": 0, **body},
    )


def _valid(name: str, arguments: str) -> None:
    Draft202012Validator(SCHEMAS[name]).validate(orjson.loads(arguments))


def test_a_chat_batch_with_tools(live_sdk: OpenAI, live: Any) -> None:
    history = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    lines = [
        _chat("named", tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        _chat("required", tool_choice="required", parallel_tool_calls=False),
        _chat("auto", tool_choice="auto"),
        _chat("none", tool_choice="none"),
        _chat("history", messages=history),
        _chat("bad-schema", tools=_chat_tools(BAD_SCHEMA)),
        _chat("unknown", tool_choice={"type": "function", "function": {"name": "nope"}}),
    ]
    _, output, errors = run_batch(live_sdk, live, CHAT, lines)
    assert sorted(errors) == ["bad-schema", "unknown"]
    bad = errors["bad-schema"]
    assert (bad["param"], bad["code"]) == ("tools[0].function.parameters", "invalid_json_schema")
    assert "get_weather" in bad["message"]
    assert errors["unknown"]["param"] == "tool_choice"
    answers = {
        cid: ChatCompletion.model_validate(line["response"]["body"]) for cid, line in output.items()
    }
    for cid in ("named", "required"):
        choice = answers[cid].choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].id.startswith("call_")
        assert calls[0].type == "function"
        _valid(calls[0].function.name, calls[0].function.arguments)  # type: ignore[union-attr]
    assert answers["named"].choices[0].message.tool_calls[0].function.name == "get_weather"  # type: ignore[index,union-attr]
    for cid in ("auto", "history"):
        message = answers[cid].choices[0].message
        assert message.content or message.tool_calls
        for call in message.tool_calls or []:  # not forced: JSON, not necessarily the schema
            assert isinstance(orjson.loads(call.function.arguments), dict)  # type: ignore[union-attr]
    none = answers["none"].choices[0]
    assert none.message.tool_calls is None and none.message.content


def _response(custom_id: str, **body: Any) -> bytes:
    tools = body.pop("tools", None) or [
        {"type": "function", "name": name, "parameters": schema, "strict": True}
        for name, schema in SCHEMAS.items()
    ]
    return request_line(
        custom_id,
        RESPONSES,
        {"input": QUESTION, "tools": tools, "max_output_tokens": 64, "temperature": 0, **body},
    )


def test_a_responses_batch_with_tools(live_sdk: OpenAI, live: Any) -> None:
    history = [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris", "unit": "celsius"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees, sunny"},
    ]
    bad_tool = {"type": "function", "name": "get_weather", "parameters": BAD_SCHEMA}
    lines = [
        _response("named", tool_choice={"type": "function", "name": "get_weather"}),
        _response("required", tool_choice="required", parallel_tool_calls=False),
        _response("auto"),
        _response("none", tool_choice="none"),
        _response("history", input=history),
        _response("bad-schema", tools=[bad_tool]),
        _response("web-search", tools=[{"type": "web_search"}]),
    ]
    _, output, errors = run_batch(live_sdk, live, RESPONSES, lines)
    assert sorted(errors) == ["bad-schema", "web-search"]
    assert errors["bad-schema"]["param"] == "tools[0].parameters"
    assert "get_weather" in errors["bad-schema"]["message"]
    assert errors["web-search"]["param"] == "tools[0].type"
    responses = {
        cid: Response.model_validate(line["response"]["body"]) for cid, line in output.items()
    }
    for cid in ("named", "required"):
        (call,) = responses[cid].output
        assert call.type == "function_call" and call.status == "completed"
        assert call.call_id.startswith("call_")
        _valid(call.name, call.arguments)
    assert responses["named"].output[0].name == "get_weather"  # type: ignore[union-attr]
    for cid in ("auto", "history"):
        for item in responses[cid].output:
            assert item.type in ("message", "function_call")
            if item.type == "function_call":
                assert isinstance(orjson.loads(item.arguments), dict)
    assert responses["none"].output_text


@pytest.fixture()
def claude(live: ServiceProcesses, live_settings: Settings) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.base_url, api_key=new_key(live_settings))


def _claude(custom_id: str, **params: Any) -> dict[str, Any]:
    tools = params.pop("tools", None) or [
        {"name": name, "description": name.replace("_", " "), "input_schema": schema}
        for name, schema in SCHEMAS.items()
    ]
    messages = params.pop("messages", [{"role": "user", "content": QUESTION}])
    body = {"model": MODEL, "max_tokens": 64, "temperature": 0, "messages": messages}
    return {"custom_id": custom_id, "params": {**body, "tools": tools, **params}}


def test_a_message_batch_with_tools(claude: anthropic.Anthropic, live: Any) -> None:
    history = [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris", "unit": "celsius"},
                }
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees, sunny"}
            ],
        },
    ]
    bad_tool = {"name": "get_weather", "input_schema": BAD_SCHEMA}
    requests = [
        _claude("named", tool_choice={"type": "tool", "name": "get_weather"}),
        _claude("any", tool_choice={"type": "any", "disable_parallel_tool_use": True}),
        _claude("auto", tool_choice={"type": "auto"}),
        _claude("none", tool_choice={"type": "none"}),
        _claude("history", messages=history),
        _claude("bad-schema", tools=[bad_tool]),
        _claude("server-tool", tools=[{"type": "web_search_20250305", "name": "web_search"}]),
    ]
    batch = claude.messages.batches.create(requests=requests)  # type: ignore[arg-type]
    _wait(claude, batch.id, live)
    results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    for custom_id, start in (
        ("bad-schema", "tools.0.input_schema: "),
        ("server-tool", "tools.0.type: "),
    ):
        result = results[custom_id]
        assert result.type == "errored" and result.error.error.type == "invalid_request_error"
        assert result.error.error.message.startswith(start)
    assert "get_weather" in results["bad-schema"].error.error.message  # type: ignore[union-attr]
    messages = {}
    for custom_id in ("named", "any", "auto", "none", "history"):
        result = results[custom_id]
        assert result.type == "succeeded", (custom_id, result)
        messages[custom_id] = result.message
    for custom_id in ("named", "any"):
        (block,) = messages[custom_id].content
        assert block.type == "tool_use" and block.id.startswith("toolu_")
        assert messages[custom_id].stop_reason == "tool_use"
        Draft202012Validator(SCHEMAS[block.name]).validate(block.input)
    assert messages["named"].content[0].name == "get_weather"  # type: ignore[union-attr]
    for custom_id in ("auto", "history"):
        assert messages[custom_id].content
        assert all(b.type in ("text", "tool_use") for b in messages[custom_id].content)
    none = messages["none"]
    assert [b.type for b in none.content] == ["text"] and none.stop_reason != "tool_use"
