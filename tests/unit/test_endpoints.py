"""The endpoint registry (``offpeak.endpoints``) and the neutral records stored for finished
lines: what each endpoint declares, that a new endpoint is one class and one registry entry,
that records render to OpenAI's lines exactly, and that writing a batch's files again writes the
same bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ConfigDict

from offpeak import endpoints
from offpeak import ids as offpeak_ids
from offpeak.endpoints import Endpoint, EngineInput, SamplingSpec, Tokenizer, records
from offpeak.endpoints.records import Answer, CompletionRecord, Failure, TokenLogprob
from workers import engine_io
from workers.engine.base import Completion, EngineResult, TopLogprob
from workers.engine.base import TokenLogprob as EngineTokenLogprob
from workers.engine.instant import InstantEngine
from workers.engine_io import LineError
from workers.runner.held import HeldLine, HeldLines

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def test_the_registry_names_each_endpoint_by_its_url() -> None:
    assert endpoints.BATCH_ENDPOINTS[:3] == (CHAT, COMPLETIONS, "/v1/responses")
    assert not set(endpoints.BATCH_ENDPOINTS) & set(endpoints.UNSERVED_BATCH_ENDPOINTS)
    for url, endpoint in endpoints.ENDPOINTS.items():
        assert endpoint.url == url and endpoints.get(url) is endpoint
        assert issubclass(endpoint.body_model, BaseModel)
        assert set(endpoint.required_fields) <= set(endpoint.body_model.model_fields)
    with pytest.raises(LineError) as info:
        endpoints.get("/v1/moderations")
    assert (info.value.code, info.value.param) == ("invalid_url", "url")


def test_the_core_registry_needs_no_workers_nor_engine() -> None:
    """The API asks the registry, and the API must start without ``workers``, vLLM or torch."""
    code = (
        "import sys, offpeak.endpoints, api.services.batches; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'workers', 'vllm', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- A new endpoint: one class, one entry ----------------------------------------------------


class EchoRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    text: str


class Echo(Endpoint[EchoRequest]):
    """A toy endpoint that reads a text and generates nothing, like embeddings would."""

    url = "/v1/echo"
    body_model = EchoRequest
    required_fields = ("text",)
    response_id_prefix = "echo-"

    def engine_input(self, body: EchoRequest, tokenizer: Tokenizer) -> EngineInput:
        return EngineInput(tokenizer.encode_text(body.text), SamplingSpec(max_tokens=1))

    def engine_needs(self, engine_input: EngineInput) -> tuple[tuple[int, int], ...]:
        return ((len(engine_input.prompt_token_ids), 0),)

    def render(self, answer: Answer) -> dict[str, Any]:
        return {"id": answer.response_id, "object": "echo", "tokens": answer.prompt_tokens}


def test_a_new_endpoint_is_one_class_and_one_registry_entry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(endpoints.ENDPOINTS, Echo.url, Echo())
    engine = InstantEngine("m")
    prepared = engine_io.prepare("1", Echo.url, {"model": "m", "text": "hello"}, engine)
    with pytest.raises(LineError) as info:
        engine_io.prepare("2", Echo.url, {"model": "m", "text": 5}, engine)
    assert (info.value.code, info.value.param) == ("invalid_type", "text")
    held = HeldLines()
    held.queue([HeldLine(None, prepared)])  # type: ignore[arg-type]
    assert held.engine_needs() == [(5, 0)]  # sizing asks the endpoint, not max_tokens
    engine.add(prepared.request)
    (result,) = engine.step()
    stored = records.dump(engine_io.answer(prepared, result, created=1))
    line = orjson.loads(endpoints.openai_line("c1", stored))
    assert line["response"]["body"]["object"] == "echo"
    assert line["response"]["body"]["tokens"] == 5


def test_text_endpoints_need_n_sequences_of_max_tokens() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "n": 3, "max_tokens": 7}
    prepared = engine_io.prepare("1", COMPLETIONS, body, InstantEngine("m"))
    assert prepared.needs == ((3, 7),) * 3


# --- Records rendered as OpenAI's lines ------------------------------------------------------

IDS = {"line_id": "batch_req_1", "request_id": "req_1"}
LOGPROBS = [
    TokenLogprob(token="Hé", logprob=-0.5, top=[("Hé", -0.5), ("a", None)]),
    TokenLogprob(token="!", logprob=None),
]


def answer(endpoint: str, logprobs: bool) -> Answer:
    return Answer(
        endpoint=endpoint,
        model="m",
        created=1_700_000_000,
        line_id="batch_req_1",
        request_id="req_1",
        response_id="resp-1",
        prompt_tokens=7,
        cached_tokens=3,
        completions=[
            CompletionRecord(
                text="Hé!", finish_reason="stop", tokens=2, logprobs=LOGPROBS if logprobs else None
            ),
            CompletionRecord(text="x", finish_reason="length", tokens=1),
        ],
    )


USAGE = {
    "prompt_tokens": 7,
    "completion_tokens": 3,
    "total_tokens": 10,
    "prompt_tokens_details": {"cached_tokens": 3},
    "completion_tokens_details": {"reasoning_tokens": 0},
}


def rendered(record: Answer | Failure) -> dict[str, Any]:
    stored = records.dump(record)
    assert records.load(stored) == record
    line: dict[str, Any] = orjson.loads(endpoints.openai_line("c1", stored))
    assert line["id"] == "batch_req_1" and line["custom_id"] == "c1" and line["error"] is None
    assert line["response"]["request_id"] == "req_1"
    return line["response"]


def test_a_chat_record_renders_as_a_chat_completion() -> None:
    response = rendered(answer(CHAT, logprobs=True))
    assert response == {
        "status_code": 200,
        "request_id": "req_1",
        "body": {
            "id": "resp-1",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hé!", "refusal": None},
                    "logprobs": {
                        "content": [
                            {
                                "token": "Hé",
                                "logprob": -0.5,
                                "bytes": [72, 195, 169],
                                "top_logprobs": [
                                    {"token": "Hé", "logprob": -0.5, "bytes": [72, 195, 169]},
                                    {"token": "a", "logprob": None, "bytes": [97]},
                                ],
                            },
                            {"token": "!", "logprob": None, "bytes": [33], "top_logprobs": []},
                        ],
                        "refusal": None,
                    },
                    "finish_reason": "stop",
                },
                {
                    "index": 1,
                    "message": {"role": "assistant", "content": "x", "refusal": None},
                    "logprobs": None,
                    "finish_reason": "length",
                },
            ],
            "usage": USAGE,
            "system_fingerprint": None,
            "service_tier": "default",
        },
    }


def test_a_completions_record_renders_as_a_text_completion() -> None:
    body = rendered(answer(COMPLETIONS, logprobs=True))["body"]
    assert body == {
        "id": "resp-1",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": "m",
        "choices": [
            {
                "text": "Hé!",
                "index": 0,
                "logprobs": {
                    "tokens": ["Hé", "!"],
                    "token_logprobs": [-0.5, None],
                    "top_logprobs": [{"Hé": -0.5, "a": None}, {}],
                    "text_offset": [0, 2],
                },
                "finish_reason": "stop",
            },
            {"text": "x", "index": 1, "logprobs": None, "finish_reason": "length"},
        ],
        "usage": USAGE,
        "system_fingerprint": None,
    }


def test_a_failure_record_renders_as_an_error_line() -> None:
    error = LineError(
        "Invalid 'temperature': 5 is not between 0 and 2.", "temperature", "invalid_value"
    )
    failure = records.failure(error).model_copy(update=IDS)
    assert rendered(failure) == {
        "status_code": 400,
        "request_id": "req_1",
        "body": {
            "error": {
                "message": "Invalid 'temperature': 5 is not between 0 and 2.",
                "type": "invalid_request_error",
                "param": "temperature",
                "code": "invalid_value",
            }
        },
    }
    crash = records.failure(LineError("boom", code="engine_failure", status_code=500))
    assert crash.type == "server_error" and crash.status_code == 500


def test_a_line_stored_before_records_is_written_as_it_is() -> None:
    """Rows finished by an older version hold their OpenAI line already rendered."""
    legacy = orjson.dumps(
        {
            "id": "batch_req_old",
            "custom_id": "c1",
            "response": {"status_code": 200, "request_id": "req_old", "body": {"x": 1}},
            "error": None,
        }
    ).decode()
    assert records.load(legacy) is None
    assert endpoints.openai_line("c1", legacy) == legacy.encode()


def test_a_record_holds_what_another_surface_renders() -> None:
    """What an Anthropic ``message`` needs is in the record, without OpenAI's line."""
    engine = InstantEngine("m")
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    prepared = engine_io.prepare("1", CHAT, body, engine)
    engine.add(prepared.request)
    (result,) = engine.step()
    record = records.load(records.dump(engine_io.answer(prepared, result, created=5)))
    assert isinstance(record, Answer)
    (completion,) = record.completions
    assert (completion.text, completion.finish_reason, completion.tokens) == ("O", "length", 1)
    assert (record.model, record.created, record.endpoint) == ("m", 5, CHAT)
    assert record.prompt_tokens == len(prepared.request.prompt_token_ids)
    assert record.line_id.startswith("batch_req_") and record.request_id.startswith("req_")
    assert record.response_id.startswith("chatcmpl-")


def _engine_result(completions: int, logprobs: bool, text: str) -> EngineResult:
    tops = [TopLogprob("a", -1.5), TopLogprob("b\u2028", 0), TopLogprob("c", -1e-7)]
    lps = [
        EngineTokenLogprob(token, value, tops)
        for token, value in [("Hé", -0.5), ('"\\', -0.0), ("\x01", 0), ("x", -3.14159e-30)]
    ]
    return EngineResult(
        "1",
        prompt_tokens=11,
        cached_tokens=4,
        completions=[
            Completion(
                f"{text}{i}",
                list(range(i + 2)),
                "stop" if i else "length",
                lps if logprobs else None,
                stop_sequence="</s>" if i else None,
            )
            for i in range(completions)
        ],
    )


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("completions", [1, 3])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("text", ["OK", 'Hé "quoted" \\ \n\t\x00 \u2028 🙂 \ud7ff'])
def test_an_answer_record_built_without_the_model_is_the_models_bytes(
    monkeypatch: pytest.MonkeyPatch, endpoint: str, completions: int, logprobs: bool, text: str
) -> None:
    """The runner stores each answered line's record without building ``Answer`` (its cost per
    line): the same bytes ``records.dump`` writes for the model, so files rendered from it are
    the same too."""
    body = {"model": "m", "max_tokens": 5}
    body |= (
        {"messages": [{"role": "user", "content": "hi"}]} if endpoint == CHAT else {"prompt": "hi"}
    )
    prepared = engine_io.prepare("1", endpoint, body, InstantEngine("m"))
    result = _engine_result(completions, logprobs, text)
    # The same fresh ids for both, in the order each takes them.
    ids = iter(["batch_req_1", "req_1", "resp_1"] * 2)
    monkeypatch.setattr(engine_io, "new_ids", lambda *prefixes: [next(ids) for _ in prefixes])
    fast = engine_io.answer_record(prepared, result, created=1_700_000_000)
    assert fast == records.dump(engine_io.answer(prepared, result, created=1_700_000_000))
    assert endpoints.openai_line("c1", fast).startswith(b'{"id":"batch_req_1"')


def test_an_answer_record_with_echoed_fields_takes_the_models_path() -> None:
    fields: dict[str, Any] = {
        "endpoint": "/v1/responses",
        "model": "m",
        "created": 1,
        "line_id": "batch_req_1",
        "request_id": "req_1",
        "response_id": "resp_1",
        "prompt_tokens": 1,
        "cached_tokens": 0,
        "completions": [{"text": "x", "finish_reason": "stop", "tokens": 1, "stop_sequence": None}],
        # What the client sent, repeated: an integer beyond 64 bits orjson cannot write.
        "echo": {"metadata": {"k": "v"}, "big": 2**70, "temperature": 1},
    }
    expected = records.dump(
        Answer(**fields | {"completions": [CompletionRecord(**fields["completions"][0])]})
    )
    assert records.dump_answer(fields) == expected


def test_ids_made_together_have_the_shape_of_one_id_each() -> None:
    one = records.new_line_ids()[0]
    made = offpeak_ids.new_ids("batch_req_", "req_", "chatcmpl-")
    assert [len(i) for i in made] == [len(one), len("req_") + 24, len("chatcmpl-") + 24]
    assert len({i[-11:] for i in made}) == 3  # each its own random part
    assert all(i[-24:-11] == made[0][-24:-11] for i in made)  # one clock reading


def test_made_ids_never_repeat_across_refills_of_the_pool_nor_in_a_forked_child() -> None:
    made = [offpeak_ids.new_ids("a_", "b_", "c_") for _ in range(2000)]  # 66,000 hex digits
    digits = [i[-11:] for three in made for i in three]
    assert len(set(digits)) == len(digits) and all(len(d) == 11 for d in digits)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's next id, from the pool the parent had filled
        os.write(write, offpeak_ids.new_ids("a_")[0][-11:].encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 11).decode()
    assert child != offpeak_ids.new_ids("a_")[0][-11:]


# --- Files written twice are the same files --------------------------------------------------
