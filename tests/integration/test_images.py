"""Image inputs on a text-only model: a chat line with an image part, and a Responses line with
an ``input_image``, fail alone with a 400 naming the content, through validation, the runner
and finalize on real PostgreSQL; the batch's text lines are answered."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.support.batches import files_of, tenant_client, validate

MODEL = "text-only"
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.fixture()
def instant_settings(settings: Any) -> Any:
    from offpeak.settings import ModelConfig

    config = ModelConfig(engine="instant", max_model_len=256)
    return settings.model_copy(update={"models": {MODEL: config}, "flush_seconds": 0.05})


def run(settings: Any, url: str, bodies: dict[str, dict[str, Any]]) -> tuple[Any, Any]:
    from storage.blobs import get_blob_store
    from workers.engine.instant import InstantEngine
    from workers.finalize import finalize
    from workers.runner import Runner

    data = b"\n".join(
        orjson.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})
        for cid, body in bodies.items()
    )
    tenant, sdk = tenant_client(settings)
    batch, _ = validate(settings, data + b"\n", endpoint=url, tenant_name=tenant)
    assert batch.status == "in_progress", batch.errors
    Runner(settings, InstantEngine(MODEL, 256), "w1", lambda _b: None).drain()
    assert finalize(settings, get_blob_store(settings.resolved_blob_url), batch.id).done
    batch = sdk.batches.retrieve(batch.id)
    assert batch.status == "completed"
    return files_of(sdk, batch)


def test_image_parts_fail_their_chat_line_alone(instant_settings: Any) -> None:
    def chat(content: Any) -> dict[str, Any]:
        return {"model": MODEL, "messages": [{"role": "user", "content": content}]}

    output, errors = run(
        instant_settings,
        "/v1/chat/completions",
        {
            "text": chat("Hi"),
            "text-parts": chat([{"type": "text", "text": "Hi"}]),
            "image": chat([{"type": "text", "text": "What is this?"}, IMAGE]),
        },
    )
    assert sorted(o["custom_id"] for o in output) == ["text", "text-parts"]
    [error] = errors
    assert error["custom_id"] == "image" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"] == {
        "message": "Only text content parts are supported by this model.",
        "type": "invalid_request_error",
        "param": "messages[0].content",
        "code": "unsupported_content",
    }


def test_an_input_image_fails_its_responses_line_alone(instant_settings: Any) -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}
    output, errors = run(
        instant_settings,
        "/v1/responses",
        {
            "text": {"model": MODEL, "input": "Hi"},
            "image": {"model": MODEL, "input": [{"role": "user", "content": [image]}]},
        },
    )
    assert [o["custom_id"] for o in output] == ["text"]
    [error] = errors
    assert error["custom_id"] == "image" and error["response"]["status_code"] == 400
    body = error["response"]["body"]["error"]
    assert (body["param"], body["code"]) == ("input[0].content", "unsupported_content")
