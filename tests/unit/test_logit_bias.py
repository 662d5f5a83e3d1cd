"""``logit_bias`` on chat and completions lines: OpenAI's bounds (token ids as strings of digits,
biases in -100..100, ids in the model's vocabulary), the ``SamplingSpec`` pairs it becomes, and
the remote engine's request body carrying it."""

from __future__ import annotations

from typing import Any

import pytest

from offpeak.endpoints.base import SamplingSpec
from workers.engine.base import EngineRequest
from workers.engine.instant import InstantEngine
from workers.engine.remote_wire import completion_body
from workers.engine_io import LineError, prepare

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
#: Its tokens are bytes: ids 0..255.
ENGINE = InstantEngine("m", max_model_len=512)


def chat(**changes: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "Hi"}], **changes}


def completion(**changes: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "Hi", **changes}


@pytest.mark.parametrize("url,body", [(CHAT, chat), (COMPLETIONS, completion)])
def test_logit_bias_becomes_sorted_pairs_in_the_sampling_spec(url: str, body: Any) -> None:
    prepared = prepare("1", url, body(logit_bias={"65": 100, "0": -100, "255": 0.5}), ENGINE)
    assert prepared.request.sampling.logit_bias == ((0, -100.0), (65, 100.0), (255, 0.5))


def test_an_unset_or_empty_logit_bias_is_no_bias() -> None:
    for body in (chat(), chat(logit_bias=None), chat(logit_bias={})):
        assert prepare("1", CHAT, body, ENGINE).request.sampling.logit_bias == ()


def test_lines_asking_the_same_bias_share_one_hashable_spec() -> None:
    first = prepare("1", CHAT, chat(logit_bias={"1": 2, "3": 4}), ENGINE).request.sampling
    second = prepare("2", CHAT, chat(logit_bias={"3": 4, "1": 2}), ENGINE).request.sampling
    assert first is second and hash(first) == hash(second)


@pytest.mark.parametrize(
    "bias",
    [
        {"-1": 1},
        {"1.5": 1},
        {"": 1},
        {" 1": 1},
        {"١": 1},  # a decimal digit, but not an ASCII one
        {"1": 100.5},
        {"1": -101},
        {"1": "5"},
        {"1": True},
        {"1": None},
        {"1": float("nan")},
        {"1": float("inf")},
        {"256": 1},
        {str(10**30): 1},
        {str(i): 1 for i in range(1025)},
        "x",
        [1],
        5,
    ],
)
@pytest.mark.parametrize("url,body", [(CHAT, chat), (COMPLETIONS, completion)])
def test_a_bad_logit_bias_fails_its_line_naming_logit_bias(url: str, body: Any, bias: Any) -> None:
    with pytest.raises(LineError) as info:
        prepare("1", url, body(logit_bias=bias), ENGINE)
    assert info.value.status_code == 400
    assert info.value.param == "logit_bias" and "'logit_bias'" in info.value.message


def test_an_engine_that_does_not_know_its_vocabulary_leaves_the_ids_to_its_server() -> None:
    engine = InstantEngine("m")
    engine.vocab_size = None  # type: ignore[assignment]  # a remote server's own tokenizer
    prepared = prepare("1", CHAT, chat(logit_bias={"99999": 1}), engine)
    assert prepared.request.sampling.logit_bias == ((99999, 1.0),)


def test_the_remote_engine_sends_the_bias_with_string_keys() -> None:
    spec = SamplingSpec(4, logit_bias=((7, -100.0), (12, 3.0)))
    body = completion_body("m", EngineRequest("1", [1, 2], spec), 0)
    assert body["logit_bias"] == {"7": -100.0, "12": 3.0}
    assert "logit_bias" not in completion_body("m", EngineRequest("1", [1], SamplingSpec(4)), 0)
