"""Checks every finished batch must pass, whatever its input."""

from __future__ import annotations

from collections import Counter
from typing import Any

from openai import OpenAI
from openai.types import Batch

from offpeak.client_tools import read_lines


def files_of(client: OpenAI, batch: Batch) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)


def check_ran_batch(client: OpenAI, batch: Batch, input_custom_ids: list[str]) -> tuple[
    list[dict[str, Any]], list[dict[str, Any]]
]:
    """Every custom_id exactly once across the two files; counts and usage match the lines;
    every line has the contract's shape. Returns the output and error lines."""
    output, errors = files_of(client, batch)
    seen = Counter(line["custom_id"] for line in output + errors)
    assert sorted(seen) == sorted(input_custom_ids), "custom_ids differ from the input's"
    assert set(seen.values()) == {1}, f"custom_ids not exactly once: {seen}"
    counts = batch.request_counts
    assert counts is not None
    assert (counts.total, counts.completed, counts.failed) == (
        len(input_custom_ids), len(output), len(errors))
    for line in output:
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] in ("chat.completion", "text_completion")
        assert body["usage"]["total_tokens"] == (
            body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"])
    for line in errors:
        assert line["id"].startswith("batch_req_")
        if line["response"] is not None:
            assert line["response"]["status_code"] >= 400 and line["error"] is None
            assert set(line["response"]["body"]["error"]) >= {"message", "type", "param", "code"}
        else:
            assert set(line["error"]) == {"code", "message"}
    usage = batch.usage
    assert usage is not None
    bodies = [line["response"]["body"] for line in output]
    assert usage.input_tokens == sum(b["usage"]["prompt_tokens"] for b in bodies)
    assert usage.output_tokens == sum(b["usage"]["completion_tokens"] for b in bodies)
    assert usage.input_tokens_details.cached_tokens == sum(
        b["usage"]["prompt_tokens_details"]["cached_tokens"] for b in bodies)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    return output, errors
