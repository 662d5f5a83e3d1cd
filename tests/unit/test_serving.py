"""A request line's body to an engine request: every malformed body is a LineError (a 400 line
for that request alone), never another exception that would take the chunk down."""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine.instant import InstantEngine
from workers.engine_io import LineError, prepare

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ENGINE = InstantEngine("m", max_model_len=512)


def chat(**changes: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **changes}


BAD_CHAT = [
    chat(messages=[{"role": ["user"], "content": "x"}]),
    chat(messages=[{"role": {"a": 1}, "content": "x"}]),
    chat(messages=[{"content": "x"}]),
    chat(messages=["hello"]),
    chat(messages="hello"),
    chat(messages=[]),
    chat(messages=[{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]),
    chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
    chat(messages=[{"role": "user", "content": 5}]),
    chat(max_tokens=0),
    chat(max_tokens=-1),
    chat(max_tokens="8"),
    chat(max_tokens=1.5),
    chat(max_tokens=10**30),
    chat(max_completion_tokens=True),
    chat(temperature=5),
    chat(temperature="hot"),
    chat(temperature=float("nan")),
    chat(top_p=0),
    chat(top_p=3),
    chat(n=0),
    chat(n=1000),
    chat(n="2"),
    chat(stop=["a"] * 10),
    chat(stop=5),
    chat(stop=[1]),
    chat(logprobs="yes"),
    chat(top_logprobs=3),
    chat(logprobs=True, top_logprobs=50),
    chat(presence_penalty=9),
    chat(frequency_penalty=-9),
    chat(seed="x"),
    chat(seed=2.5),
    chat(tools=[{"type": "function"}]),
    chat(response_format={"type": "xml"}),
    chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": 5}}),
    chat(best_of=3),
    chat(max_tokens=600),
    chat(messages=[{"role": "user", "content": "word " * 600}]),
]

BAD_COMPLETIONS = [
    {"model": "m", "prompt": 5},
    {"model": "m", "prompt": None},
    {"model": "m", "prompt": []},
    {"model": "m", "prompt": ["a", "b"]},
    {"model": "m", "prompt": [1, "a"]},
    {"model": "m", "prompt": "x", "logprobs": 9},
    {"model": "m", "prompt": "x", "echo": True},
    {"model": "m", "prompt": "x", "suffix": "y"},
    {"model": "m", "prompt": "x" * 600},
]


@pytest.mark.parametrize("body", BAD_CHAT)
def test_bad_chat_bodies_are_line_errors(body: dict[str, Any]) -> None:
    with pytest.raises(LineError) as info:
        prepare("1", CHAT, body, ENGINE)
    assert info.value.status_code == 400 and info.value.message
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body", BAD_COMPLETIONS)
def test_bad_completion_bodies_are_line_errors(body: dict[str, Any]) -> None:
    with pytest.raises(LineError):
        prepare("1", COMPLETIONS, body, ENGINE)


def test_good_bodies_map_to_sampling() -> None:
    prepared = prepare(
        "7",
        CHAT,
        chat(
            max_completion_tokens=5,
            temperature=0,
            top_p=0.5,
            n=2,
            stop="x",
            seed=3,
            logprobs=True,
            top_logprobs=2,
            messages=[
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            ],
        ),
        ENGINE,
    )
    s = prepared.request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.n, s.stop, s.seed, s.logprobs) == (
        5,
        0.0,
        0.5,
        2,
        ("x",),
        3,
        2,
    )
    assert b"<system>Be brief." in bytes(prepared.request.prompt_token_ids)
    unbounded = prepare("8", CHAT, chat(), ENGINE)
    assert unbounded.request.sampling.max_tokens == 512 - len(unbounded.request.prompt_token_ids)
    completion = prepare("9", COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]}, ENGINE)
    assert completion.request.prompt_token_ids == [1, 2, 3]
    assert completion.request.sampling.max_tokens == 16  # OpenAI's default for completions


def _msg(role: object = "user", content: object = "Hi") -> dict[str, object]:
    return {"role": role, "content": content}


CONTEXT = (
    "This model's maximum context length is 512 tokens. However, you requested {asked} tokens "
    "({prompt} in the prompt, {new} for the completion). Please reduce the length of the prompt "
    "or the completion."
)
ROLE = (
    "Invalid 'messages[{i}]': each message needs a role (system, developer, user, assistant, tool)."
)
#: (url, body, (message, param, code)): the exact errors lines have always failed with.
EXACT = [
    (
        CHAT,
        chat(messages=[_msg(["user"])]),
        (ROLE.format(i=0), "messages[0].role", "invalid_value"),
    ),
    (CHAT, chat(messages=["hello"]), (ROLE.format(i=0), "messages[0].role", "invalid_value")),
    (
        CHAT,
        chat(messages=[_msg(), {"content": "x"}]),
        (ROLE.format(i=1), "messages[1].role", "invalid_value"),
    ),
    (
        CHAT,
        chat(messages="hello"),
        ("'messages' must be a non-empty list.", "messages", "invalid_value"),
    ),
    (
        CHAT,
        chat(messages=[]),
        ("'messages' must be a non-empty list.", "messages", "invalid_value"),
    ),
    (
        CHAT,
        chat(messages=[_msg(content=[{"type": "text", "text": 1}])]),
        (
            "Invalid 'messages[0].content': a text part needs a string 'text'.",
            "messages[0].content",
            "invalid_type",
        ),
    ),
    (
        CHAT,
        chat(messages=[_msg(content=[{"type": "image_url"}])]),
        (
            "Only text content parts are supported by this model.",
            "messages[0].content",
            "unsupported_content",
        ),
    ),
    (
        CHAT,
        chat(messages=[_msg(), _msg(content=5)]),
        (
            "Invalid 'messages[1].content': expected a string.",
            "messages[1].content",
            "invalid_type",
        ),
    ),
    (
        CHAT,
        chat(max_tokens=0),
        ("Invalid 'max_tokens': 0 must be at least 1.", "max_tokens", "invalid_value"),
    ),
    (
        CHAT,
        chat(max_tokens="8"),
        ("Invalid type for 'max_tokens': expected an integer.", "max_tokens", "invalid_type"),
    ),
    (
        CHAT,
        chat(max_tokens=1.0),
        ("Invalid type for 'max_tokens': expected an integer.", "max_tokens", "invalid_type"),
    ),
    (
        CHAT,
        chat(max_completion_tokens=True),
        (
            "Invalid type for 'max_completion_tokens': expected an integer.",
            "max_completion_tokens",
            "invalid_type",
        ),
    ),
    (
        CHAT,
        chat(max_tokens=600),
        (CONTEXT.format(asked=620, prompt=20, new=600), "messages", "context_length_exceeded"),
    ),
    (
        CHAT,
        chat(temperature=5),
        ("Invalid 'temperature': 5 is not between 0 and 2.", "temperature", "invalid_value"),
    ),
    (
        CHAT,
        chat(temperature=2.5),
        ("Invalid 'temperature': 2.5 is not between 0 and 2.", "temperature", "invalid_value"),
    ),
    (
        CHAT,
        chat(temperature="hot"),
        ("Invalid type for 'temperature': expected a number.", "temperature", "invalid_type"),
    ),
    (
        CHAT,
        chat(temperature=True),
        ("Invalid type for 'temperature': expected a number.", "temperature", "invalid_type"),
    ),
    (
        CHAT,
        chat(temperature=float("nan")),
        ("Invalid type for 'temperature': expected a number.", "temperature", "invalid_type"),
    ),
    (CHAT, chat(top_p=0), ("Invalid 'top_p': must be greater than 0.", "top_p", "invalid_value")),
    (CHAT, chat(top_p=3), ("Invalid 'top_p': 3 is not between 0 and 1.", "top_p", "invalid_value")),
    (CHAT, chat(n=0), ("Invalid 'n': 0 must be between 1 and 128.", "n", "invalid_value")),
    (CHAT, chat(n="2"), ("Invalid type for 'n': expected an integer.", "n", "invalid_type")),
    (CHAT, chat(stop=["a"] * 5), ("Invalid 'stop': at most 4 sequences.", "stop", "invalid_value")),
    (
        CHAT,
        chat(stop=[1]),
        ("Invalid 'stop': expected a string or a list of strings.", "stop", "invalid_type"),
    ),
    (
        CHAT,
        chat(logprobs="yes"),
        ("Invalid type for 'logprobs': expected a boolean.", "logprobs", "invalid_type"),
    ),
    (
        CHAT,
        chat(top_logprobs=3),
        ("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs", "invalid_value"),
    ),
    (
        CHAT,
        chat(logprobs=True, top_logprobs=50),
        ("Invalid 'top_logprobs': 50 must be between 0 and 20.", "top_logprobs", "invalid_value"),
    ),
    (
        CHAT,
        chat(presence_penalty=9),
        (
            "Invalid 'presence_penalty': 9 is not between -2 and 2.",
            "presence_penalty",
            "invalid_value",
        ),
    ),
    (
        CHAT,
        chat(seed=2**63),
        (
            f"Invalid 'seed': {2**63} must be between {-(2**63)} and {2**63 - 1}.",
            "seed",
            "invalid_value",
        ),
    ),
    (
        CHAT,
        chat(seed=2**70),  # past 64 bits the JSON parser reads a float
        (
            f"Invalid 'seed': {2**70} must be between {-(2**63)} and {2**63 - 1}.",
            "seed",
            "invalid_value",
        ),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": "x", "seed": float(-(2**70))},
        (
            f"Invalid 'seed': {-(2**70)} must be between {-(2**63)} and {2**63 - 1}.",
            "seed",
            "invalid_value",
        ),
    ),
    (
        CHAT,
        chat(seed=1.5),
        ("Invalid type for 'seed': expected an integer.", "seed", "invalid_type"),
    ),
    (
        CHAT,
        chat(modalities=["text", "audio"]),
        (
            "Invalid 'modalities': only 'text' output is supported by this server.",
            "modalities",
            "unsupported_value",
        ),
    ),
    (
        CHAT,
        chat(modalities="text"),
        ("Invalid 'modalities': expected a list of strings.", "modalities", "invalid_type"),
    ),
    (
        CHAT,
        chat(tools=[{"type": "function"}]),
        (
            "'tools[0].function' must be an object with a 'name'.",
            "tools[0].function",
            "missing_required_parameter",
        ),
    ),
    (
        CHAT,
        chat(logit_bias={"AI": 2}),
        (
            "Invalid key in 'logit_bias': AI. You should only be submitting non-negative integers.",
            "logit_bias",
            "invalid_value",
        ),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": "x", "logit_bias": {"65": 101}},
        (
            "Invalid value for 'logit_bias' key 65: 101. You should only be submitting numbers "
            "between -100 and 100.",
            "logit_bias",
            "invalid_value",
        ),
    ),
    (
        CHAT,
        chat(logit_bias={"256": 1}),
        (
            "Invalid key in 'logit_bias': 256. The model's token ids are 0 to 255.",
            "logit_bias",
            "invalid_value",
        ),
    ),
    (
        CHAT,
        chat(logit_bias=[1]),
        (
            "Invalid type for 'logit_bias': expected an object, but got an array instead.",
            "logit_bias",
            "invalid_type",
        ),
    ),
    (
        CHAT,
        chat(response_format={"type": "xml"}),
        (
            "Invalid 'response_format': 'type' must be one of text, json_object, json_schema.",
            "response_format.type",
            "invalid_value",
        ),
    ),
    (
        CHAT,
        chat(best_of=3),
        ("'best_of' other than n is not supported.", "best_of", "unsupported_value"),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": 5},
        ("'prompt' must be a string or a list of token ids.", "prompt", "invalid_type"),
    ),
    (
        COMPLETIONS,
        {"model": "m"},
        ("'prompt' must be a string or a list of token ids.", "prompt", "invalid_type"),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": [[]]},
        ("'prompt' must be a string or a list of token ids.", "prompt", "invalid_type"),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": ["a", "b"]},
        (
            "Several prompts in one request line are not supported here; put each prompt on its "
            "own line.",
            "prompt",
            "unsupported_value",
        ),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": "x", "logprobs": 9},
        ("Invalid 'logprobs': 9 must be between 0 and 5.", "logprobs", "invalid_value"),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": "x", "logprobs": True},
        ("Invalid type for 'logprobs': expected an integer.", "logprobs", "invalid_type"),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": "x", "echo": True},
        ("'echo' is not supported by this server.", "echo", "unsupported_parameter"),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": "x" * 600},
        (CONTEXT.format(asked=616, prompt=600, new=16), "prompt", "context_length_exceeded"),
    ),
    (
        COMPLETIONS,
        {"model": "m", "prompt": "x", "n": 2, "best_of": 3},
        ("'best_of' other than n is not supported.", "best_of", "unsupported_value"),
    ),
]


@pytest.mark.parametrize(("url", "body", "expected"), EXACT)
def test_errors_keep_their_exact_wording(
    url: str, body: dict[str, Any], expected: tuple[str, str, str]
) -> None:
    """The messages, params and codes of the hand-written checks, now pydantic's errors."""
    with pytest.raises(LineError) as info:
        prepare("1", url, body, ENGINE)
    assert (info.value.message, info.value.param, info.value.code) == expected


@pytest.mark.parametrize(
    "body",
    [
        chat(tools=[], functions=None, logit_bias={}, response_format={"type": "text"}),
        chat(user="u", metadata={"k": "v"}, store=True, parallel_tool_calls=None, foo=[1]),
        chat(messages=[{"role": "assistant", "content": None, "name": "a", "tool_calls": []}]),
        chat(stop="", logprobs=False, seed=-(2**63), n=128, best_of=128, max_tokens=1),
        chat(modalities=["text"]),
        chat(modalities=None),
    ],
)
def test_unknown_and_unset_parameters_are_accepted(body: dict[str, Any]) -> None:
    """Parameters a batch line may carry and this server ignores, as OpenAI's endpoints do."""
    prepare("1", CHAT, body, ENGINE)


def test_an_unserved_url_is_refused_not_run_as_completions() -> None:
    """An unserved url (an embeddings line once fell into the completions path) is refused."""
    with pytest.raises(LineError) as info:
        prepare("1", "/v1/moderations", {"model": "m", "input": "x", "prompt": "x"}, ENGINE)
    assert (info.value.param, info.value.code) == ("url", "invalid_url")
