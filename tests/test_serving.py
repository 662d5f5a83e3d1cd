"""A request line's body to an engine request: every malformed body is a LineError (a 400 line
for that request alone), never another exception that would take the chunk down."""

from __future__ import annotations

from typing import Any

import pytest

from workers.engine.instant import InstantEngine
from workers.serving import LineError, prepare

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
    chat(response_format={"type": "json_object"}),
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
