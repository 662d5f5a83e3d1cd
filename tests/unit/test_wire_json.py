"""The reads users poll answer from plain dicts (``api.schemas.batches.batch_json``,
``api.schemas.files.file_json``, written by orjson: ``api.responses.WireJSON``) and from rows
rather than ORM objects: their bytes must be what the pydantic models (``BatchObject``,
``FileObject``, which the routes declare and create and cancel still answer with) serialize to,
field for field, type for type (a float where the model has a float), in the model's order."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from api.schemas.batches import BatchObject, batch_json
from api.schemas.common import column_values
from api.schemas.files import FileObject, file_json
from offpeak.billing import Bill
from storage.models import Batch, File

T0 = 1_764_000_000


def _batch(**changes: Any) -> Batch:
    values: dict[str, Any] = dict(
        id="batch_wire",
        tenant_id="t",
        endpoint="/v1/chat/completions",
        model="m",
        input_file_id="file-in",
        completion_window="24h",
        window_seconds=86_400,
        status="completed",
        output_file_id="file-out",
        error_file_id=None,
        errors=None,
        metadata_=None,
        created_at=T0,
        in_progress_at=T0 + 1,
        expires_at=T0 + 86_400,
        finalizing_at=T0 + 5,
        completed_at=T0 + 6,
        failed_at=None,
        expired_at=None,
        cancelling_at=None,
        cancelled_at=None,
        total=200,
        completed=199,
        failed=1,
        input_tokens=12_345,
        cached_tokens=100,
        output_tokens=6_789,
        estimated_completion_at=None,
        estimate=None,
    )
    values.update(changes)
    return Batch(**values)


#: Odd strings JSON writers may escape differently: controls, quotes, non-ASCII, U+2028 (no
#: NUL: PostgreSQL's JSONB refuses it, so no row can hold one).
ODD = 'a"b\\c/d\x01\x1f\x7f\u00e9\u2028\u2029\U0001f600\t\n'

#: Batches that differ where the wire format has choices: errors, metadata, estimate, schedule.
CHANGES: list[dict[str, Any]] = [
    {},
    dict(
        status="failed",
        output_file_id=None,
        failed_at=T0 + 2,
        errors=[
            {"code": "invalid_json_line", "message": ODD, "line": 3},
            {"code": "empty_file", "message": "m", "param": "input_file_id", "line": None},
            {"code": "x", "message": "extra keys are dropped", "param": None, "extra": 1},
        ],
    ),
    dict(metadata_={"k": ODD, ODD: "v", "": ""}),
    # Running, with the scheduler's estimate; a float eta and a whole-number one.
    dict(status="in_progress", completed_at=None, estimated_completion_at=T0 + 1000.75),
    dict(status="in_progress", completed_at=None, estimated_completion_at=float(T0 + 90_000)),
    # An estimate whose prices are whole numbers in JSON (0, 1) and whose counts are floats.
    dict(
        estimate={
            "prompt_tokens": 12.0,
            "max_completion_tokens": 20_000,
            "price_low": 0,
            "price_high": 1,
            "requests": 200,
            "invalid_requests": 0.0,
            "unknown": "ignored",
        }
    ),
    dict(
        estimate={
            "prompt_tokens": 1,
            "max_completion_tokens": 2,
            "price_low": 4.31e-05,
            "price_high": 1e22,
            "requests": 1,
            "invalid_requests": 0,
        }
    ),
    dict(status="validating", in_progress_at=None, completed_at=None, total=0, completed=0),
]
BATCHES = [_batch(**changes) for changes in CHANGES]

BILLS = [
    None,
    # A live estimate with no engine time yet: whole-number amounts (billing.bill's sums).
    Bill(gpu_seconds=0, cost=0, price=0, realtime_price=0, tokens=0),
    Bill(
        gpu_seconds=3.1234567,
        cost=4.31e-05,
        price=0.0012345,
        realtime_price=0.002469,
        tokens=19_134,
        billed_at=T0 + 7.25,
    ),  # fmt: skip
    Bill(gpu_seconds=1e-7, cost=1e-10, price=123456.5, realtime_price=246913, tokens=5),
]


@pytest.mark.parametrize("bill", BILLS, ids=lambda b: "no bill" if b is None else repr(b.cost))
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"{b.status}-{len(b.errors or ())}")
def test_batch_json_is_the_models_json(batch: Batch, bill: Bill | None) -> None:
    model = BatchObject.of(batch, bill).model_dump_json().encode()
    assert orjson.dumps(batch_json(column_values(batch), bill)) == model


def test_file_json_is_the_models_json() -> None:
    for expires_at in (None, T0 + 3600):
        file = File(
            id="file-x",
            tenant_id="t",
            filename=ODD,
            purpose="batch_output",
            bytes=120_000,
            status="processed",
            blob_key="files/file-x",
            created_at=T0,
            expires_at=expires_at,
            deleted=False,
        )
        assert (
            orjson.dumps(file_json(column_values(file)))
            == FileObject.of(file).model_dump_json().encode()
        )
