"""Anthropic message batch requests without a database: unservable requests and Anthropic's errors,
the prompt made of turns, system blocks and a prefill, the window, and result lines the SDK's
types parse."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from anthropic.types.messages import MessageBatchIndividualResponse

from offpeak.endpoints import anthropic_messages, records
from offpeak.endpoints.errors import LineError
from offpeak.endpoints.records import Answer, CompletionRecord, Failure
from workers.engine.instant import InstantEngine

ENDPOINT = anthropic_messages.ENDPOINT


def _error(params: dict[str, Any], engine: InstantEngine | None = None) -> LineError:
    engine = engine or InstantEngine("m")
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(LineError) as caught:
        ENDPOINT.prepare({**body, **params}, engine)
    return caught.value


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        ({"stream": True}, "stream", "stream: not supported"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "tools.0.type",
            "tools.0.type: server tool 'web_search_20250305' is not supported",
        ),
        (
            {"tools": [{"type": "bash_20250124", "name": "bash"}]},
            "tools.0.type",
            "server tool 'bash_20250124'",
        ),
        (
            {"tools": [{"name": "t", "input_schema": {"type": "nonsense"}}]},
            "tools.0.input_schema",
            "tools.0.input_schema: Invalid schema for function 't'",
        ),
        ({"tools": [{"name": "t"}]}, "tools.0.input_schema", "Field required"),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "tool_choice: "),
        (
            {"tools": [{"name": "t", "input_schema": {}}], "tool_choice": {"type": "tool"}},
            "tool_choice.name",
            "tool_choice.name: Field required",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "t", "name": "t", "input": {}}],
                    }
                ]
            },
            "messages.0",
            "tool_use blocks belong in assistant turns",
        ),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking", "thinking:"),
        ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": None}, "max_tokens", "max_tokens: Input should be a valid integer"),
        ({"frequency_penalty": 1}, "frequency_penalty", "Extra inputs are not permitted"),
        ({"stop_sequences": ["ok", " "]}, "stop_sequences.1", "non-whitespace"),
        ({"messages": []}, "messages", "at least 1 item"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role", "'user'"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages.0", "non-empty content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content",
            "'image' content blocks are not supported",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "a "},
                ]
            },
            "messages",
            "trailing whitespace",
        ),
    ],
)
def test_a_request_the_server_cannot_honour_errors_naming_its_param(
    params: dict[str, Any], param: str, words: str
) -> None:
    error = _error(params)
    assert error.param == param and words in error.message and error.status_code == 400
    assert error.message.startswith(param.split(".")[0])  # Anthropic's "<param>: …" wording


def test_a_missing_max_tokens_and_another_model_are_anthropics_errors() -> None:
    engine = InstantEngine("m")
    with pytest.raises(LineError) as caught:
        ENDPOINT.prepare({"model": "m", "messages": [{"role": "user", "content": "x"}]}, engine)
    assert caught.value.message == "max_tokens: Field required"
    other = _error({"model": "claude-opus-9"})
    assert (other.status_code, other.message, other.param) == (404, "model: claude-opus-9", "model")
    assert anthropic_messages.error_type(other.status_code) == "not_found_error"


def test_turns_system_blocks_and_a_prefill_make_the_prompt() -> None:
    """Consecutive turns of one role are one turn; system blocks join; a final assistant turn
    is continued, its text after the generation prompt."""
    engine = InstantEngine("m")
    body = {
        "model": "m",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": "Hello"},
            {"role": "user", "content": [{"type": "text", "text": "there", "cache_control": {}}]},
            {"role": "assistant", "content": "The answer is"},
        ],
        "top_k": 5,
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u-1"},
    }
    prepared = ENDPOINT.prepare(body, engine)
    expected = engine.encode_chat(
        [
            {"role": "system", "content": "Be brief.\n\nBe kind."},
            {"role": "user", "content": "Hello\n\nthere"},
        ]
    ) + engine.encode_text("The answer is")
    assert prepared.prompt_token_ids == expected
    assert (prepared.sampling.top_k, prepared.sampling.stop) == (5, ("END",))
    assert prepared.sampling.max_tokens == 4


def test_a_prompt_over_the_window_errors_in_anthropics_words() -> None:
    engine = InstantEngine("m", max_model_len=64)
    error = _error({"max_tokens": 60}, engine)
    assert error.message.startswith("input length and `max_tokens` exceed context limit")
    error = _error({"messages": [{"role": "user", "content": "x" * 100}]}, engine)
    assert error.message.startswith("prompt is too long")


def _answer(finish: str, stop: str | None = None) -> Answer:
    return Answer(
        endpoint=anthropic_messages.URL,
        model="m",
        created=1,
        line_id="batch_req_1",
        request_id="req_1",
        response_id="msg_1",
        prompt_tokens=10,
        cached_tokens=4,
        completions=[
            CompletionRecord(text="Hi", finish_reason=finish, tokens=2, stop_sequence=stop)
        ],
    )


@pytest.mark.parametrize(
    ("finish", "stop", "reason"),
    [("stop", None, "end_turn"), ("length", None, "max_tokens"), ("stop", "END", "stop_sequence")],
)
def test_result_lines_parse_with_the_sdks_types(finish: str, stop: str | None, reason: str) -> None:
    line = anthropic_messages.result_line("a", _answer(finish, stop), "succeeded")
    parsed = MessageBatchIndividualResponse.model_validate(orjson.loads(line))
    assert parsed.result.type == "succeeded"
    message = parsed.result.message
    assert (message.id, message.type, message.role, message.model) == (
        "msg_1",
        "message",
        "assistant",
        "m",
    )
    assert message.content[0].type == "text" and message.content[0].text == "Hi"
    assert (message.stop_reason, message.stop_sequence) == (reason, stop)
    # Anthropic's input_tokens leave out the tokens read from the cache.
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.output_tokens) == (6, 4, 2)


def test_errored_canceled_and_expired_lines_parse_with_the_sdks_types() -> None:
    failure = records.failure(LineError("stream: not supported by this server", "stream"))
    errored = MessageBatchIndividualResponse.model_validate(
        orjson.loads(anthropic_messages.result_line("e", failure, "failed"))
    )
    assert errored.result.type == "errored"
    assert errored.result.error.type == "error"
    assert errored.result.error.error.type == "invalid_request_error"
    assert errored.result.error.error.message == "stream: not supported by this server"
    server = Failure(
        line_id="l", request_id="r", status_code=500, type="server_error", code=None,
        message="engine failure", param=None,
    )  # fmt: skip
    line = MessageBatchIndividualResponse.model_validate_json(
        anthropic_messages.result_line("s", server, "failed")
    )
    assert line.result.type == "errored" and line.result.error.error.type == "api_error"
    for status, kind in (("cancelled", "canceled"), ("expired", "expired")):
        parsed = MessageBatchIndividualResponse.model_validate_json(
            anthropic_messages.result_line("x", None, status)
        )
        assert parsed.result.type == kind
