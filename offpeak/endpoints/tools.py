"""Function calling, shared by the three text APIs (chat ``tools``, the Responses API's function
tools, Anthropic's ``tools``): a checked tool list, the tool choice, the JSON Schema that forces
a call, the Hermes prompt block for templates that ignore tools, and the calls read back from a
completion's text.

Each API parses its own shape into ``Tool`` and ``ToolChoice``; what follows is the same:

- ``none``: the tools are left out of the prompt (vLLM's ``exclude_tools_when_tool_choice_none``)
  and the answer is text, as OpenAI's ``none`` promises.
- ``auto``: the tools go to the chat template; the text is read with the model's tool parser
  (``PARSERS``; ``parse_auto``) and the answer holds its calls, or text when it made none.
- ``required`` / a named tool: decoding is constrained to the JSON Schema ``forced_schema``
  builds, as vLLM builds it (``vllm/tool_parsers/utils.py``, ``get_json_schema_from_tools``):
  a named tool's ``parameters`` (the text is its arguments); ``required``, an array of at least
  one ``{"name", "parameters"}`` (at most one when parallel calls are off). The arguments
  therefore always parse and fit the tool's schema.

The parse runs here, in the core, rather than in the worker with vLLM's ``ToolParserManager``:
a line's record keeps the completion's text, and every surface renders calls from it the same
way whichever engine (in-process or a ``vllm serve``) wrote it, with no vLLM in the API.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from offpeak.endpoints.base import StructuredOutput
from offpeak.endpoints.errors import fail
from offpeak.endpoints.structured import check_schema

#: A function's ``name``: OpenAI's rule (1-64 of ``a-zA-Z0-9_-``); Anthropic's is the same.
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: Tool parsers implemented here, by vLLM's names (``--tool-call-parser``).
PARSERS = ("hermes",)
DEFAULT_PARSER = "hermes"
#: An empty argument list: a tool without ``parameters`` still takes a JSON object (vLLM's
#: ``_params_or_empty_object``).
EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its ``name``, ``description`` and ``parameters`` (a JSON
    Schema of its arguments object, ``None`` for none)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    def template_dict(self) -> dict[str, Any]:
        """The tool as Hugging Face chat templates take it (OpenAI's chat shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters or EMPTY_OBJECT
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` and, for ``named``, the tool's ``name``; ``parallel``: more than one call may be
    made (chat's ``parallel_tool_calls``; Anthropic's ``disable_parallel_tool_use`` negated)."""

    mode: Mode = "auto"
    name: str | None = None
    parallel: bool = True


def function_tool(
    name: Any, description: Any, parameters: Any, param: str, schema_key: str = "parameters"
) -> Tool:
    """A checked ``Tool``. ``param`` is where the tool sits (``tools[0].function``), for the
    error of a bad ``name`` or a ``parameters`` that is not a usable JSON Schema (an object
    schema valid against its meta-schema). Raises a ``fail`` error naming the tool."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise fail(
            "missing_required_parameter" if name is None else "invalid_value",
            f"Invalid '{param}.name': a function name is 1-64 characters of a-z, A-Z, 0-9, '_' "
            "and '-'.",
            f"{param}.name",
        )
    if description is not None and not isinstance(description, str):
        raise fail(
            "invalid_type",
            f"Invalid type for '{param}.description': expected a string.",
            f"{param}.description",
        )
    where = f"{param}.{schema_key}"
    if parameters is None:
        return Tool(name, description)
    check_schema(parameters, where, name, label=f"Invalid schema for function {name!r}")
    if parameters.get("type", "object") != "object":
        raise fail(
            "invalid_json_schema",
            f"Invalid schema for function {name!r}: the arguments must be a JSON object "
            "(schema type 'object').",
            where,
        )
    return Tool(name, description, parameters)


def unique(tools: list[Tool], param: str) -> tuple[Tool, ...]:
    """``tools`` as a tuple. Raises a ``fail`` error for a name given twice."""
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise fail(
                "invalid_value", f"Invalid '{param}': duplicate function name {tool.name!r}.", param
            )
        seen.add(tool.name)
    return tuple(tools)


def check_choice(choice: ToolChoice, tools: tuple[Tool, ...], param: str) -> ToolChoice:
    """``choice``, checked against ``tools``: a named tool must be among them, and a call can be
    forced only when there is a tool. Raises a ``fail`` error at ``param``."""
    if choice.mode == "named" and choice.name not in {t.name for t in tools}:
        raise fail(
            "invalid_value",
            f"Invalid '{param}': no function named {choice.name!r} in 'tools'.",
            param,
        )
    if choice.mode in ("required", "named") and not tools:
        raise fail(
            "invalid_value", f"Invalid '{param}': a tool call needs 'tools' to be set.", param
        )
    return choice


def forced_schema(
    tools: tuple[Tool, ...], choice: ToolChoice, param: str
) -> StructuredOutput | None:
    """The structured output forcing ``choice``'s call (module docstring), or ``None`` for
    ``auto`` and ``none``. ``$defs`` of several tools are hoisted to the array's root, as vLLM
    does; a name defined twice with different schemas fails at ``param``."""
    if choice.mode == "named":
        tool = next(t for t in tools if t.name == choice.name)
        return _structured(tool.parameters or EMPTY_OBJECT, param)
    if choice.mode != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.parameters or EMPTY_OBJECT)
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if defs.setdefault(key, value) != value:
                raise fail(
                    "invalid_value",
                    f"Invalid '{param}': '$defs' entry {key!r} differs between tools.",
                    param,
                )
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if not choice.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return _structured(schema, param)


def _structured(schema: dict[str, Any], param: str) -> StructuredOutput:
    return StructuredOutput(json_schema=orjson.dumps(schema).decode(), param=param)


# Prompt -------------------------------------------------------------------------------------

#: The Hermes function-calling system block (NousResearch's Hermes 2 Pro format, which Qwen2.5's
#: template writes too and vLLM's ``hermes`` parser reads), for templates that ignore ``tools``.
HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``messages`` (chat-template shape) for a template that ignores ``tools`` and tool calls:
    the Hermes block in the system message (after the client's own system text), an assistant
    turn's ``tool_calls`` written as ``<tool_call>`` blocks in its text and a ``tool`` turn's
    text inside ``<tool_response>`` tags."""
    block = HERMES_SYSTEM.format(tools="\n".join(orjson.dumps(t).decode() for t in tools))
    out = []
    for message in messages:
        content = message.get("content") or ""
        if message.get("tool_calls"):
            calls = [
                "<tool_call>\n"
                + orjson.dumps(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                ).decode()
                + "\n</tool_call>"
                for c in message["tool_calls"]
            ]
            content = "\n".join([content, *calls] if content else calls)
        elif message.get("role") == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": message["role"], "content": content})
    if tools and out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
    elif tools:
        out.insert(0, {"role": "system", "content": block})
    return out


# Answer -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One call read from a completion: the function's ``name`` and its ``arguments`` as JSON
    text of an object."""

    name: str
    arguments: str

    def input(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's ``tool_use.input``)."""
        value = orjson.loads(self.arguments)
        return value if isinstance(value, dict) else {}


def echo(choice: ToolChoice, tools: tuple[Tool, ...], parser: str) -> dict[str, Any]:
    """What a line's record keeps to read calls back (``calls``): the mode, the forced tool's
    name, the tool names and the tool parser."""
    return {
        "mode": choice.mode,
        "name": choice.name,
        "names": [t.name for t in tools],
        "parser": parser,
    }


def calls(text: str, kept: dict[str, Any] | None) -> tuple[str | None, list[Call]]:
    """``(content, calls)`` of a completion's ``text``, by the line's ``kept`` tool echo
    (``echo``; ``None``: no tools). Without calls the content is the text as it is. Text that
    does not parse as the forced JSON (a completion cut at ``max_tokens``) stays text, except
    the calls a ``required`` array completed before the cut (``_complete_calls``)."""
    if not kept:
        return text, []
    mode = kept.get("mode")
    if mode == "auto":
        return parse_auto(text, kept.get("names") or [], kept.get("parser", DEFAULT_PARSER))
    try:
        parsed = orjson.loads(text) if mode in ("named", "required") else None
    except orjson.JSONDecodeError:
        parsed = _complete_calls(text) if mode == "required" else None
    if mode == "named" and isinstance(parsed, dict):
        return None, [Call(kept["name"], orjson.dumps(parsed).decode())]
    if isinstance(parsed, list) and parsed and all(_is_call(c, "parameters") for c in parsed):
        return None, [
            Call(c["name"], orjson.dumps(c.get("parameters", {})).decode()) for c in parsed
        ]
    return text, []


def _complete_calls(text: str) -> list[Any] | None:
    """The items of a JSON array cut short (``[{…}, {…}, {"na``) that were complete, or ``None``
    when there is none. Decoding was constrained to the array's schema, so each complete item
    fits it; a model asked for calls in parallel may repeat them until ``max_tokens``."""
    decoder = json.JSONDecoder()
    at = _skip_space(text, 0)
    if text[at : at + 1] != "[":
        return None
    items = []
    while True:
        at = _skip_space(text, at + 1)
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break
        items.append(item)
        at = _skip_space(text, at)
        if text[at : at + 1] != ",":
            break
    return items or None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def parse_auto(text: str, names: list[str], parser: str) -> tuple[str | None, list[Call]]:
    """vLLM's ``hermes`` parser's reading of ``text`` (``vllm/tool_parsers/
    hermes_tool_parser.py``): each ``<tool_call>{"name", "arguments"}</tool_call>`` (the last
    may be unclosed) is a call and the text before the first is the content. All or nothing:
    a block that is not JSON, or names a function not in ``names``, leaves the whole text as
    content. ``parser``: one of ``PARSERS``."""
    if parser != "hermes" or "<tool_call>" not in text:
        return text, []
    found = []
    for closed, open_ in _HERMES.findall(text):
        try:
            call = orjson.loads(closed or open_)
        except orjson.JSONDecodeError:
            return text, []
        if not _is_call(call, "arguments") or call["name"] not in names:
            return text, []
        found.append(Call(call["name"], orjson.dumps(call.get("arguments", {})).decode()))
    content = text[: text.find("<tool_call>")]
    return (content if content.strip() else None), found


def _is_call(value: Any, key: str) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and isinstance(value.get(key, {}), dict)
    )


def call_id(prefix: str, response_id: str, completion: int, call: int) -> str:
    """A call's id (``call_…``, ``toolu_…``), derived from the answer's id and the call's place
    so writing the result files again writes the same bytes."""
    digest = hashlib.sha256(f"{response_id}:{completion}:{call}".encode()).hexdigest()
    return prefix + digest[:24]
