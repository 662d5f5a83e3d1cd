"""Responses batches on the database: created, validated (input required) and a streaming line
failing alone."""

from __future__ import annotations

from typing import Any

import orjson
from openai import OpenAI

from offpeak.settings import DEFAULT_MODEL, Settings
from tests.support.batches import line, validate
from tests.unit.test_responses import RESPONSES, refused, resp


def responses_line(custom_id: str, **body: Any) -> bytes:
    return orjson.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": RESPONSES,
            "body": {"model": DEFAULT_MODEL, **body},
        }
    )


def test_a_batch_may_target_responses(sdk: OpenAI) -> None:
    data = responses_line("a", input="Hi") + b"\n"
    file = sdk.files.create(file=("in.jsonl", data), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=file.id,
        endpoint=RESPONSES,  # type: ignore[arg-type]
        completion_window="24h",
    )
    assert batch.endpoint == RESPONSES and batch.status == "validating"


def test_validation_stores_responses_lines_and_requires_input(settings: Settings) -> None:
    good = responses_line("a", input="Hi") + b"\n" + responses_line("b", input=[]) + b"\n"
    batch, rows = validate(settings, good, endpoint=RESPONSES)
    # An empty input is the line's own problem (a 400 line when it runs), not the file's.
    assert batch.status != "failed" and rows == 2
    batch, rows = validate(settings, responses_line("a") + b"\n", endpoint=RESPONSES)
    assert batch.status == "failed" and rows == 0
    assert batch.errors[0]["code"] == "missing_required_parameter"


def test_a_responses_line_that_streams_fails_alone(settings: Settings) -> None:
    """``stream`` on a responses line is a 400 line naming it (the body model refuses
    it when the line runs), not a refused file as on chat lines."""
    data = responses_line("a", input="Hi") + b"\n" + responses_line("s", input="Hi", stream=True)
    batch, rows = validate(settings, data + b"\n", endpoint=RESPONSES)
    assert batch.status != "failed" and rows == 2
    assert refused(RESPONSES, resp(stream=True))[0] == "stream"
    chat, chat_rows = validate(settings, line("x", body_stream=True) + b"\n")
    assert chat.status == "failed" and chat_rows == 0
    assert chat.errors[0]["code"] == "streaming_unsupported"
