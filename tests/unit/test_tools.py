"""Function calling in the core (``offpeak.endpoints.tools``) and on chat lines: tool lists and
choices checked, the JSON Schema forcing a call (vLLM's shape), the Hermes prompt for templates
that ignore tools, and calls read back from a record's text into OpenAI's ``tool_calls``."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from jsonschema import Draft202012Validator
from openai.types.chat import ChatCompletion

from offpeak import endpoints
from offpeak.endpoints import records, tools
from offpeak.endpoints.errors import LineError
from offpeak.endpoints.records import Answer, CompletionRecord
from workers.engine.chat_template import TemplateTokenizer
from workers.engine.instant import InstantEngine

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}


def chat_tool(name: str = "get_weather", parameters: Any = WEATHER) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def prepare(**body: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    return endpoints.get(CHAT).prepare(body, InstantEngine("m"))


def refused(**body: Any) -> LineError:
    with pytest.raises(LineError) as caught:
        prepare(**body)
    return caught.value


# --- Checks --------------------------------------------------------------------------------


def test_a_tool_whose_parameters_are_no_json_schema_fails_naming_the_tool() -> None:
    error = refused(tools=[chat_tool(), chat_tool("bad", {"type": "nonsense"})])
    assert (error.param, error.code) == ("tools[1].function.parameters", "invalid_json_schema")
    assert "'bad'" in error.message and error.status_code == 400
    error = refused(tools=[chat_tool("list", {"type": "array"})])
    assert error.param == "tools[0].function.parameters"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [chat_tool()], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [chat_tool()], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [chat_tool("has space")]}, "tools[0].function.name"),
        ({"tools": [chat_tool(), chat_tool()]}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []},
                       {"role": "user", "tool_calls": [
                           {"id": "c", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[1]"),
        ({"messages": [{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "not json"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"tools": [chat_tool()], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "response_format"),
    ],
)  # fmt: skip
def test_a_bad_tool_field_fails_its_line_naming_it(body: dict[str, Any], param: str) -> None:
    error = refused(**body)
    assert error.param == param and error.status_code == 400


# --- The schema forcing a call --------------------------------------------------------------


def forced(**body: Any) -> dict[str, Any] | None:
    spec = prepare(**body).sampling.structured_output
    return None if spec is None else orjson.loads(spec.json_schema or "")


def test_a_named_choice_is_decoded_to_its_tools_parameters() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert forced(tools=[chat_tool("t", None), chat_tool()], tool_choice=named) == WEATHER
    empty = {"type": "function", "function": {"name": "t"}}
    assert forced(tools=[chat_tool("t", None)], tool_choice=empty) == tools.EMPTY_OBJECT


def test_required_is_an_array_of_calls_as_vllm_builds_it() -> None:
    defs = {"$defs": {"c": {"type": "string"}}}
    weather = {**WEATHER, **defs}
    schema = forced(
        tools=[chat_tool(parameters=weather), chat_tool("t", None)], tool_choice="required"
    )
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": WEATHER,
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "properties": {
                        "name": {"type": "string", "enum": ["t"]},
                        "parameters": tools.EMPTY_OBJECT,
                    },
                    "required": ["name", "parameters"],
                },
            ],
        },
        **defs,
    }
    Draft202012Validator.check_schema(schema)
    one = forced(tools=[chat_tool()], tool_choice="required", parallel_tool_calls=False)
    assert one is not None and one["maxItems"] == 1


def test_auto_and_none_decode_freely_and_none_leaves_the_tools_out() -> None:
    auto = prepare(tools=[chat_tool()])
    assert auto.sampling.structured_output is None
    assert auto.echo == {
        "tool_calls": {"mode": "auto", "name": None, "names": ["get_weather"], "parser": "hermes"}
    }
    assert b"<tool>get_weather" in bytes(auto.prompt_token_ids)  # the instant engine's render
    none = prepare(tools=[chat_tool()], tool_choice="none")
    assert none.sampling.structured_output is None and none.echo is None
    assert b"<tool>" not in bytes(none.prompt_token_ids)


# --- The prompt ------------------------------------------------------------------------------


class FakeTemplate:
    """A Hugging Face tokenizer's two calls the template tokenizer makes, with a template that
    writes each message's role and content, and the tools only when ``uses_tools``."""

    bos_token_id = None

    def __init__(self, uses_tools: bool) -> None:
        self.uses_tools = uses_tools
        self.rendered: list[str] = []

    def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: Any = None, **_: Any
    ) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if self.uses_tools and tools:
            text = orjson.dumps(tools).decode() + text
        self.rendered.append(text)
        return text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def __len__(self) -> int:  # the vocabulary: one id per byte
        return 256


HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "cold"},
]  # fmt: skip


def test_a_template_that_ignores_tools_gets_them_the_hermes_way() -> None:
    offered = [tools.Tool("get_weather", "Weather", WEATHER).template_dict()]
    fake = FakeTemplate(uses_tools=False)
    text = bytes(TemplateTokenizer(fake).encode_chat(HISTORY, offered)).decode()
    assert text.startswith("<system># Tools\n") and '"name":"get_weather"' in text
    assert (
        '<assistant><tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
        in text
    )
    assert text.endswith("<tool><tool_response>\ncold\n</tool_response>")
    # The client's own system text comes first, the block after it.
    system = [{"role": "system", "content": "Be brief."}, HISTORY[0]]
    text = bytes(TemplateTokenizer(fake).encode_chat(system, offered)).decode()
    assert text.startswith("<system>Be brief.\n\n# Tools\n")


def test_a_tool_named_in_the_conversation_still_reaches_a_template_that_ignores_tools() -> None:
    """The user's text saying the tool's name does not make the template's text carry the
    tool: SmolLM2's template still gets the Hermes block."""
    offered = [tools.Tool("describe", "Describe an image", WEATHER).template_dict()]
    asked = [{"role": "user", "content": "Please describe the weather."}]
    text = bytes(TemplateTokenizer(FakeTemplate(uses_tools=False)).encode_chat(asked, offered))
    assert text.decode().startswith("<system># Tools\n") and "Describe an image" in text.decode()


def test_a_template_that_writes_tools_renders_them_itself() -> None:
    offered = [tools.Tool("get_weather").template_dict()]
    fake = FakeTemplate(uses_tools=True)
    text = bytes(TemplateTokenizer(fake).encode_chat(HISTORY[:1], offered)).decode()
    # Rendered with the tools and once without them, to see that the template wrote them.
    assert text == orjson.dumps(offered).decode() + "<user>Weather?" and len(fake.rendered) == 2
    # No tools and no calls: one render, nothing added.
    assert bytes(TemplateTokenizer(fake).encode_chat(HISTORY[:1])).decode() == "<user>Weather?"


# --- Calls read back ---------------------------------------------------------------------------


def chat_answer(text: str, kept: dict[str, Any] | None, finish: str = "stop") -> dict[str, Any]:
    record = Answer(
        endpoint=CHAT,
        model="m",
        created=1,
        line_id="batch_req_1",
        request_id="req_1",
        response_id="chatcmpl-1",
        prompt_tokens=5,
        cached_tokens=0,
        completions=[CompletionRecord(text=text, finish_reason=finish, tokens=3)],
        echo={"tool_calls": kept} if kept else None,
    )
    stored = records.dump(record)
    line = orjson.loads(endpoints.openai_line("c", stored))
    body: dict[str, Any] = line["response"]["body"]
    ChatCompletion.model_validate(body)
    assert endpoints.openai_line("c", stored) == endpoints.openai_line("c", stored)
    return body["choices"][0]


def kept(mode: tools.Mode, name: str | None = None) -> dict[str, Any]:
    return tools.echo(
        tools.ToolChoice(mode, name), (tools.Tool("get_weather"), tools.Tool("t")), "hermes"
    )


def test_a_named_call_is_its_arguments() -> None:
    choice = chat_answer('{"city": "Oslo"}', kept("named", "get_weather"))
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}


def test_required_calls_are_the_array_in_order_each_with_its_own_id() -> None:
    text = '[{"name": "t", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "A"}}]'
    choice = chat_answer(text, kept("required"))
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["t", "get_weather"]
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"city":"A"}']
    assert calls[0]["id"] != calls[1]["id"]


def test_a_forced_call_cut_short_stays_text() -> None:
    choice = chat_answer('{"city": "Os', kept("named", "get_weather"), finish="length")
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == '{"city": "Os'


def test_required_calls_cut_short_keep_the_complete_ones() -> None:
    call = '{"name": "get_weather", "parameters": {"city": "A"}}'
    choice = chat_answer(f'[\r\n {call},\n {call},\n {{"name": "get_w', kept("required"), "length")
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == [
        '{"city":"A"}'
    ] * 2
    # Not one complete call: the text as it is.
    cut = '[{"name": "get_weather", "param'
    assert chat_answer(cut, kept("required"), "length")["message"]["content"] == cut


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ("Sure.", "Sure.", []),
        ('<tool_call>\n{"name": "t", "arguments": {}}\n</tool_call>', None, ["t"]),
        ('Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}'
         '</tool_call>\n<tool_call>{"name": "t", "arguments": {}}', "Let me look.\n",
         ["get_weather", "t"]),
        ('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', None, []),
        ("<tool_call>{not json</tool_call>", None, []),
    ],
)  # fmt: skip
def test_auto_reads_hermes_calls_and_leaves_anything_else_as_text(
    text: str, content: str | None, names: list[str]
) -> None:
    choice = chat_answer(text, kept("auto"))
    calls = choice["message"].get("tool_calls") or []
    assert [c["function"]["name"] for c in calls] == names
    assert choice["message"]["content"] == (content if names else text)
    assert choice["finish_reason"] == ("tool_calls" if names else "stop")


def test_a_line_without_tools_renders_as_before() -> None:
    choice = chat_answer('<tool_call>{"name": "t", "arguments": {}}</tool_call>', None)
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"


# --- Responses ---------------------------------------------------------------------------------

RESPONSES = "/v1/responses"


class Recording(InstantEngine):
    """The instant engine, keeping the messages and tools it was asked to render."""

    def encode_chat(self, messages: Any, tools: Any = None) -> list[int]:
        self.seen = (messages, tools)
        return super().encode_chat(messages, tools)


def test_responses_history_items_become_tool_calls_and_tool_messages() -> None:
    engine = Recording("m")
    body = {
        "model": "m",
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "input": [
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "c2", "name": "get_weather",
             "arguments": '{"city": "Rome"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "cold"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "warm"}]},
        ],
    }  # fmt: skip
    prepared = endpoints.get(RESPONSES).prepare(body, engine)
    messages, offered = engine.seen
    assert offered == [tools.Tool("get_weather", None, WEATHER).template_dict()]
    assert messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ],
    }  # fmt: skip
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
        {"role": "tool", "tool_call_id": "c2", "content": "warm"},
    ]
    spec = prepared.sampling.structured_output
    assert spec is not None and orjson.loads(spec.json_schema or "") == WEATHER


def test_a_responses_call_is_a_function_call_output_item() -> None:
    from openai.types.responses import Response

    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    body = {"model": "m", "input": "Weather?", "tools": [tool], "tool_choice": "required"}
    prepared = endpoints.get(RESPONSES).prepare(body, InstantEngine("m"))
    record = Answer(
        endpoint=RESPONSES,
        model="m",
        created=1,
        line_id="batch_req_1",
        request_id="req_1",
        response_id="resp_1",
        prompt_tokens=5,
        cached_tokens=0,
        completions=[
            CompletionRecord(
                text='[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
                finish_reason="stop",
                tokens=9,
            )
        ],
        echo=prepared.echo,
    )
    line = orjson.loads(endpoints.openai_line("c", records.dump(record)))
    response = Response.model_validate(line["response"]["body"])
    (item,) = response.output
    assert item.type == "function_call" and item.status == "completed"
    assert (item.name, item.arguments) == ("get_weather", '{"city":"Oslo"}')
    assert item.call_id.startswith("call_") and item.id is not None and item.id.startswith("fc_")
    assert response.tool_choice == "required" and response.status == "completed"
    assert [t.name for t in response.tools] == ["get_weather"]  # type: ignore[union-attr]


# --- Anthropic Messages -----------------------------------------------------------------------

MESSAGES = "/v1/messages"


def test_anthropic_tool_blocks_become_tool_calls_and_tool_messages() -> None:
    engine = Recording("m")
    body = {
        "model": "m",
        "max_tokens": 16,
        "tools": [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Oslo"}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "cold"}]},
                {"type": "text", "text": "And tomorrow?"},
            ]},
        ],
    }  # fmt: skip
    prepared = endpoints.get(MESSAGES).prepare(body, engine)
    messages, offered = engine.seen
    assert offered == [tools.Tool("get_weather", "Weather", WEATHER).template_dict()]
    assert messages[1:] == [
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "cold"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    spec = prepared.sampling.structured_output
    assert spec is not None and orjson.loads(spec.json_schema or "")["maxItems"] == 1


def test_an_anthropic_call_is_a_tool_use_block() -> None:
    from anthropic.types import Message

    body = {
        "model": "m",
        "max_tokens": 16,
        "tools": [{"name": "get_weather", "input_schema": WEATHER}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "Weather?"}],
    }
    prepared = endpoints.get(MESSAGES).prepare(body, InstantEngine("m"))
    spec = prepared.sampling.structured_output
    assert spec is not None and orjson.loads(spec.json_schema or "") == WEATHER
    record = Answer(
        endpoint=MESSAGES,
        model="m",
        created=1,
        line_id="batch_req_1",
        request_id="req_1",
        response_id="msg_1",
        prompt_tokens=5,
        cached_tokens=0,
        completions=[CompletionRecord(text='{"city": "Oslo"}', finish_reason="stop", tokens=6)],
        echo=prepared.echo,
    )
    message = Message.model_validate(endpoints.get(MESSAGES).render(record))
    (block,) = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert (block.name, block.input) == ("get_weather", {"city": "Oslo"})
    assert message.stop_reason == "tool_use"


def test_a_replayed_call_missing_a_field_names_it() -> None:
    call = {"id": "c", "type": "function", "function": {"arguments": "{}"}}
    error = refused(messages=[{"role": "assistant", "tool_calls": [call]}])
    assert error.param == "messages[0].tool_calls[0].function.name"
    assert error.message == "'messages[0].tool_calls[0].function.name' is required."
