"""Every input case from users' bug reports (``tests/cases``, a copy of ``shared/cases``) through
the API and workers as processes, on the instant engine: the cases are about what the service
does with a file, not the model's answers. See ``tests/cases/README.md`` for what
``expect.json`` means."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from openai import OpenAI

from tests.support.batches import CASES, check_ran_batch, wait_for_end

CASE_DIRS = sorted(p for p in CASES.iterdir() if (p / "expect.json").exists())


def input_custom_ids(raw: bytes) -> list[str]:
    ids = []
    for line in raw.removeprefix(b"\xef\xbb\xbf").splitlines():
        try:
            ids.append(orjson.loads(line)["custom_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            continue
    return ids


def run_case(client: OpenAI, stack: Any, case: Path, expect: dict[str, Any]) -> None:
    raw = (case / "input.jsonl").read_bytes()
    endpoint = expect.get("endpoint", "/v1/chat/completions")
    http = httpx.Client(
        base_url=str(client.base_url),
        headers={"Authorization": f"Bearer {client.api_key}"},
        timeout=60,
    )
    upload = http.post("/files", files={"file": ("input.jsonl", raw)}, data={"purpose": "batch"})
    if "upload_status" in expect:
        assert upload.status_code == expect["upload_status"], upload.text
        assert set(upload.json()["error"]) >= {"message", "type", "param", "code"}
        return
    assert upload.status_code == 200, upload.text
    body = {"input_file_id": upload.json()["id"], "endpoint": endpoint, "completion_window": "24h"}
    body.update(expect.get("create", {}))
    created = http.post("/batches", json=body)
    if "create_status" in expect:
        assert created.status_code == expect["create_status"], created.text
        error = created.json()["error"]
        if "create_param" in expect:
            assert error["param"] == expect["create_param"]
        return
    assert created.status_code == 200, created.text
    batch = wait_for_end(client, created.json()["id"], stack)
    assert batch.status == expect["batch_status"], batch
    for wanted in expect.get("errors", []):
        found = batch.errors.data if batch.errors else []
        codes = wanted.get("code_any") or [wanted["code"]]
        matches = [
            e
            for e in found
            if e.code in codes
            and ("line" not in wanted or e.line == wanted["line"])
            and ("param" not in wanted or e.param == wanted["param"])
        ]
        assert matches, f"expected {wanted} in {found}"
    if batch.status == "failed":
        assert batch.output_file_id is None
        return
    output, errors = check_ran_batch(client, batch, input_custom_ids(raw))
    if "request_counts" in expect:
        assert batch.request_counts.model_dump() == expect["request_counts"]
    if "output_custom_ids" in expect:
        assert sorted(line["custom_id"] for line in output) == sorted(expect["output_custom_ids"])
    by_id = {line["custom_id"]: line for line in output + errors}
    for custom_id, wanted in expect.get("error_lines", {}).items():
        line = next(e for e in errors if e["custom_id"] == custom_id)
        assert line["response"]["status_code"] == wanted["status_code"]
        assert line["response"]["body"]["error"]["message"]
    for custom_id, n in expect.get("choices_per_line", {}).items():
        assert len(by_id[custom_id]["response"]["body"]["choices"]) == n
    for custom_id, bound in expect.get("max_completion_tokens", {}).items():
        assert by_id[custom_id]["response"]["body"]["usage"]["completion_tokens"] <= bound
    for custom_id, kind in expect.get("body_object", {}).items():
        assert by_id[custom_id]["response"]["body"]["object"] == kind


@pytest.mark.parametrize("case", CASE_DIRS, ids=[p.name for p in CASE_DIRS])
def test_case(case: Path, instant_sdk: OpenAI, instant_stack: Any) -> None:
    expect = json.loads((case / "expect.json").read_text())
    for _ in range(expect.get("repeat", 1)):
        run_case(instant_sdk, instant_stack, case, expect)


def test_cases_match_the_shared_copy() -> None:
    """The cases are copied into the repository; when the workspace's originals are beside the
    checkout, the copy must not have drifted from them."""
    shared = Path(__file__).resolve().parents[3] / "shared" / "cases"
    if not shared.is_dir():
        pytest.skip("no shared/cases beside this checkout")
    originals = {p.relative_to(shared): p.read_bytes() for p in shared.rglob("*") if p.is_file()}
    copies = {p.relative_to(CASES): p.read_bytes() for p in CASES.rglob("*") if p.is_file()}
    assert copies == originals
