"""Validation of a batch's input file, streamed line by line into request rows.

The file is read in 1 MiB pieces and rows go to the database in chunks, so a 200 MB file is
never held in memory. Rules and error codes follow ``shared/docs/batch-api.md``; line numbers are
1-based and count every line of the file, blank ones included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
from sqlalchemy.exc import DataError
from sqlalchemy.orm import Session

from offpeak import endpoints, enqueued, tenant_limits, wire
from offpeak.ids import now
from offpeak.settings import Settings
from offpeak.statuses import BatchStatus
from storage.blobs import BlobStore
from storage.db import session_scope
from storage.models import Batch
from storage.repositories import adapters as adapters_repo
from storage.repositories import batches as batches_repo
from storage.repositories import files as files_repo
from storage.repositories import intake as intake_repo
from storage.repositories import quotas as quotas_repo
from workers import webhook_delivery
from workers.custom_ids import CustomIdHashes, duplicates
from workers.scheduler.prefix_groups import NO_GROUP, prefix_group

log = logging.getLogger(__name__)

_BOM = b"\xef\xbb\xbf"
#: Lines beyond a batch's request limit that a file may hold (blank ones, say a trailing few).
BLANK_LINE_ALLOWANCE = 1000


@dataclass
class Outcome:
    """What validation found: the batch's model and request count, or the problems. (The
    batch's cost estimate is counted after it starts: ``workers.estimate.estimate_batch``.)"""

    model: str | None = None
    total: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    #: Prompt + requested output tokens of the valid lines (``offpeak.enqueued``).
    enqueued_tokens: int = 0


def iter_lines(
    chunks: Iterator[bytes], max_line_bytes: int | None = None
) -> Iterator[tuple[int, bytes | None]]:
    """``(line_number, line)`` for every line of a byte stream, 1-based, without the line end
    (LF or CRLF) and without a leading UTF-8 byte-order mark. A last line needs no newline.

    A line longer than ``max_line_bytes`` is ``None``: its bytes are dropped as they arrive,
    never joined, so an oversized line costs no more memory than a chunk."""
    number = 0
    pending: list[bytes] = []  # pieces of a line not yet ended, joined once at its end
    pending_bytes, oversized = 0, False
    for chunk in chunks:
        if b"\n" not in chunk:
            if not oversized:
                pending.append(chunk)
                pending_bytes += len(chunk)
                if max_line_bytes is not None and pending_bytes > max_line_bytes + 2:
                    pending, oversized = [], True
            continue
        *lines, tail = chunk.split(b"\n")
        for index, line in enumerate(lines):
            number += 1
            if index == 0:
                if oversized:
                    pending, pending_bytes, oversized = [], 0, False
                    yield number, None
                    continue
                line = b"".join([*pending, line])
                pending, pending_bytes = [], 0
            line = _clean(line, number)
            yield (
                number,
                (None if max_line_bytes is not None and len(line) > max_line_bytes else line),
            )
        pending, pending_bytes = [tail], len(tail)
        if max_line_bytes is not None and pending_bytes > max_line_bytes + 2:
            pending, oversized = [], True
    if oversized:
        yield number + 1, None
        return
    rest = b"".join(pending)
    if rest:
        line = _clean(rest, number + 1)
        yield (
            number + 1,
            (None if max_line_bytes is not None and len(line) > max_line_bytes else line),
        )


def _clean(line: bytes, number: int) -> bytes:
    # The BOM is stripped from the first line, not the first chunk: a chunk may split it.
    line = line.removesuffix(b"\r")
    return line.removeprefix(_BOM) if number == 1 else line


class _Checker:
    def __init__(
        self,
        endpoint: str,
        served_models: set[str],
        settings: Settings,
        model: str | None = None,
        adapters: dict[str, str] | None = None,
    ) -> None:
        self.endpoint = endpoint
        # The endpoint's own rules run when a line runs (each fails that line alone); the file
        # is checked only for what makes a line unrunnable. An unknown endpoint requires
        # nothing here: the runner fails its lines with ``invalid_url``.
        served = endpoints.ENDPOINTS.get(endpoint)
        self.required_fields = served.required_fields if served else ()
        #: ``False``: a line's stream/model problems fail it alone when it runs, on ``model``
        #: (``Endpoint.refuses_file_for_body``).
        self.refuses_file = served.refuses_file_for_body if served else True
        self.refuses_stream = served.refuses_file_for_stream if served else True
        self.max_requests = (
            served.max_requests_per_batch if served and served.max_requests_per_batch else None
        ) or settings.max_requests_per_batch
        self.served = served_models
        #: LoRA adapters' base models by adapter name: a line naming one runs on its base.
        self.adapters = adapters or {}
        #: The last checked line's adapter (``None``: it names the base model).
        self.adapter: str | None = None
        self.settings = settings
        #: The batch's model: the first line's, or the one set when the batch was created.
        self.model: str | None = model
        self.custom_ids = CustomIdHashes()
        #: The number of the last line checked.
        self.last_number = 0
        #: Enqueued tokens of the lines found valid so far (``offpeak.enqueued``).
        self.enqueued_tokens = 0
        #: The last valid line's prefix group (``workers.scheduler.prefix_groups``).
        self.prefix_group = NO_GROUP

    def identify(
        self, number: int, raw: bytes
    ) -> tuple[dict[str, Any] | None, str, dict[str, Any] | None]:
        """The line's problem before its custom_id is known (``None`` when it has none), its
        custom_id (``""`` with a problem) and the line parsed."""
        try:
            line = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            return (
                wire.batch_error(
                    wire.INVALID_JSON_LINE, f"Line {number} is not valid JSON: {exc}.", number
                ),
                "",
                None,
            )
        if not isinstance(line, dict):
            return (
                wire.batch_error(
                    wire.INVALID_JSON_LINE, f"Line {number} must be a JSON object.", number
                ),
                "",
                None,
            )
        missing = self._missing(line, number)
        if missing:
            return missing, "", None
        custom_id = line["custom_id"]
        if not isinstance(custom_id, str) or not custom_id:
            return (
                wire.batch_error(
                    wire.INVALID_REQUEST,
                    "custom_id must be a non-empty string.",
                    number,
                    "custom_id",
                ),
                "",
                None,
            )
        if "\x00" in custom_id:
            # Neither PostgreSQL text nor most clients' join keys survive a NUL character.
            return (
                wire.batch_error(
                    wire.INVALID_REQUEST,
                    "custom_id must not contain NUL characters.",
                    number,
                    "custom_id",
                ),
                "",
                None,
            )
        return None, custom_id, line

    def check(self, number: int, raw: bytes) -> tuple[dict[str, Any] | None, str]:
        """The line's problem (a ``batch.errors.data`` entry) or ``None``, and its custom_id.
        A valid line's prefix group is left in ``prefix_group``. A repeated custom_id is not
        a problem here: ``duplicate_errors`` finds it once the file has been read."""
        self.last_number = number
        problem, custom_id, line = self.identify(number, raw)
        if problem is not None or line is None:
            return problem, ""
        self.custom_ids.add(custom_id)
        if line["method"] != "POST":
            return wire.batch_error(
                wire.INVALID_REQUEST, "method must be 'POST'.", number, "method"
            ), custom_id
        if line["url"] != self.endpoint:
            return wire.batch_error(
                wire.INVALID_URL,
                f"The url {line['url']!r} does not match the batch's endpoint {self.endpoint!r}.",
                number,
                "url",
            ), custom_id
        self.adapter = None
        problem = self._check_body(line["body"], number)
        if problem is None:
            self._count(line["body"], len(raw))
            self.prefix_group = prefix_group(line["body"])
        return problem, custom_id

    def _count(self, body: dict[str, Any], line_bytes: int) -> None:
        config = self.settings.models.get(self.model or "")
        max_model_len = config.max_model_len if config is not None else 0
        self.enqueued_tokens += enqueued.line_tokens(self.endpoint, body, line_bytes, max_model_len)

    @staticmethod
    def _missing(line: dict[str, Any], number: int) -> dict[str, Any] | None:
        for name in ("custom_id", "method", "url", "body"):
            if line.get(name) is None:
                return wire.batch_error(
                    wire.MISSING_REQUIRED_PARAMETER,
                    f"Line {number} is missing '{name}'.",
                    number,
                    name,
                )
        return None

    def _check_body(self, body: Any, number: int) -> dict[str, Any] | None:
        if not isinstance(body, dict):
            return wire.batch_error(
                wire.INVALID_REQUEST, "body must be a JSON object.", number, "body"
            )
        if not self.refuses_file:
            if self.model is None:
                return wire.batch_error(
                    wire.INVALID_REQUEST, "The batch names no model to run on.", number
                )
            return None
        if body.get("stream") and self.refuses_stream:
            return wire.batch_error(
                wire.STREAMING_UNSUPPORTED,
                "Streaming is not supported in a batch.",
                number,
                "body.stream",
            )
        model = body.get("model")
        if model is None:
            return wire.batch_error(
                wire.MISSING_REQUIRED_PARAMETER, "body.model is required.", number, "body.model"
            )
        if not isinstance(model, str) or (model not in self.served and model not in self.adapters):
            return wire.batch_error(
                wire.MODEL_NOT_FOUND,
                # OpenAI's recorded wording, which clients and peer test suites match on.
                f"The provided model '{model}' is not supported by the Batch API. "
                f"Served models: {', '.join(sorted(self.served))}.",
                number,
                "body.model",
            )
        # An adapter runs on its base model: lines of one base and its adapters mix freely.
        base = self.adapters.get(model, model)
        if self.model is None:
            self.model = base
        elif base != self.model:
            of = f" (an adapter of {base!r})" if base != model else ""
            return wire.batch_error(
                wire.MISMATCHED_MODEL,
                f"A batch runs one model and its LoRA adapters: this line asks for {model!r}"
                f"{of}, earlier lines for {self.model!r}.",
                number,
                "body.model",
            )
        self.adapter = model if model != base else None
        for needed in self.required_fields:
            if body.get(needed) is None:
                return wire.batch_error(
                    wire.MISSING_REQUIRED_PARAMETER,
                    f"body.{needed} is required for {self.endpoint}.",
                    number,
                    f"body.{needed}",
                )
        return None


def validate_into_rows(
    session: Session, blobs: BlobStore, settings: Settings, batch: Batch, blob_key: str
) -> Outcome:
    """Check every line of the input file and insert one request row per valid line.

    Rows stream into one bulk insert (a ``COPY`` on PostgreSQL) while later lines are still being
    checked, so the database stores rows while this process parses. After the first problem no
    more rows are sent; when the outcome has errors the caller must roll back the rows already
    inserted.
    """
    outcome = Outcome()
    adapters = {a.name: a.base_model for a in adapters_repo.served(session, settings).values()}
    checker = _Checker(batch.endpoint, set(settings.models), settings, batch.model, adapters)
    intake_repo.bulk_insert(
        session, _valid_rows(blobs, settings, batch, blob_key, checker, outcome)
    )
    repeated = checker.custom_ids.repeated()
    if repeated:
        _add_duplicate_errors(blobs, settings, blob_key, checker, outcome, repeated)
    if outcome.total == 0 and not outcome.errors:
        outcome.errors.append(
            wire.batch_error(wire.EMPTY_FILE, "The input file holds no request lines.")
        )
    outcome.model = checker.model
    outcome.enqueued_tokens = checker.enqueued_tokens
    return outcome


def _add_duplicate_errors(
    blobs: BlobStore,
    settings: Settings,
    blob_key: str,
    checker: _Checker,
    outcome: Outcome,
    repeated: set[int],
) -> None:
    """Read the file again up to the last line checked for the lines whose custom_id hashes to
    one of ``repeated``; each that repeats an earlier line's becomes that line's error (in place
    of another it had: a repeated id is what the line is told first), and ``outcome.errors``
    stays the file's first ``max_validation_errors`` in line order, as one pass would find them.
    """
    lines = (
        (number, raw)
        for number, raw in iter_lines(blobs.iter_chunks(blob_key), settings.max_line_bytes)
        if number <= checker.last_number and raw is not None and raw.strip()
    )
    found = duplicates(lines, lambda n, raw: checker.identify(n, raw)[1], repeated)
    if not found:
        return
    by_line = {e.get("line"): e for e in outcome.errors}
    for number, custom_id in found:
        by_line[number] = wire.batch_error(
            wire.DUPLICATE_CUSTOM_ID,
            f"custom_id {custom_id!r} appears more than once in the file; "
            "each request line needs its own.",
            number,
            "custom_id",
        )
    ordered = sorted(by_line.values(), key=lambda e: e.get("line") or 0)
    outcome.errors = ordered[: settings.max_validation_errors]


def _valid_rows(
    blobs: BlobStore,
    settings: Settings,
    batch: Batch,
    blob_key: str,
    checker: _Checker,
    outcome: Outcome,
) -> Iterator[intake_repo.IntakeRow]:
    """The request rows of the file's lines (``intake_repo.INTAKE_COLUMNS`` order), recording
    problems and the request count in ``outcome``; yields nothing once a problem is found."""
    batch_id, deadline = batch.id, batch.expires_at
    max_errors, max_requests = settings.max_validation_errors, checker.max_requests
    max_lines = max_requests + BLANK_LINE_ALLOWANCE
    for number, raw in iter_lines(blobs.iter_chunks(blob_key), settings.max_line_bytes):
        if number > max_lines:
            # Blank lines are read and skipped too: they count, so a file of them costs no more
            # than a file of requests.
            outcome.errors.append(
                wire.batch_error(
                    wire.TOO_MANY_REQUESTS,
                    f"The file holds more than {max_lines} lines ({max_requests} requests, "
                    "the limit for one batch, and blank lines count); split it into several "
                    "batches.",
                    number,
                )
            )
            return
        if raw is None:
            outcome.errors.append(
                wire.batch_error(
                    wire.LINE_TOO_LONG,
                    f"The line is longer than {settings.max_line_bytes} bytes, the limit for "
                    "one request line (OFFPEAK_MAX_LINE_BYTES).",
                    number,
                )
            )
            if len(outcome.errors) >= max_errors:
                return
            continue
        if not raw.strip():
            continue  # blank and whitespace-only lines are allowed and skipped
        problem, custom_id = checker.check(number, raw)
        if problem is not None:
            outcome.errors.append(problem)
            if len(outcome.errors) >= max_errors:
                return
            continue
        outcome.total += 1
        if outcome.total > max_requests:
            outcome.errors.append(
                wire.batch_error(
                    wire.TOO_MANY_REQUESTS,
                    f"The file holds more than {max_requests} requests, the limit "
                    "for one batch; split it into several batches.",
                    number,
                )
            )
            return
        if not outcome.errors:
            assert checker.model is not None
            row = (batch_id, number, custom_id, checker.model, deadline, raw.decode())
            yield (*row, checker.prefix_group, checker.adapter)


def run_validation(settings: Settings, blobs: BlobStore, batch_id: str) -> str | None:
    """Validate a ``validating`` batch: on success its rows exist and it is ``in_progress``;
    otherwise it is ``failed`` with ``errors``. Returns the batch's model when it is ready to
    run, else ``None``. Idempotent: a batch no longer ``validating`` is left alone, and a batch
    cancelled while its file was being read stays ``cancelling``, without rows."""
    url = settings.resolved_database_url
    with session_scope(url) as session:
        # Skip a batch another validation holds (the sweep re-sends validations; waiting would
        # tie up a control worker thread). The lock is not the batch row's: a cancel must be
        # able to change the status while the rows are copied in (``batches_repo``).
        if not batches_repo.try_lock_validation(session, batch_id):
            return None
        batch = batches_repo.get_any(session, batch_id)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return None
        file = files_repo.get_any_of_tenant(session, batch.tenant_id, batch.input_file_id)
        if file is None:
            outcome = Outcome(errors=[_no_such_file(batch)])
        elif file.deleted or not blobs.exists(file.blob_key):
            outcome = Outcome(
                errors=[
                    wire.batch_error(
                        wire.INVALID_REQUEST,
                        "The input file was deleted before validation.",
                        param="input_file_id",
                    )
                ]
            )
        else:
            try:
                outcome = validate_into_rows(session, blobs, settings, batch, file.blob_key)
            except (DataError, psycopg.DataError) as exc:
                # The database refused a value the checks above let through: that is the
                # file's problem, so the batch fails with a message rather than retrying forever.
                log.warning("batch %s: the database refused a value: %s", batch_id, exc)
                outcome = Outcome(
                    errors=[
                        wire.batch_error(
                            wire.INVALID_REQUEST,
                            "A request line holds a value that cannot be stored: "
                            f"{getattr(exc, 'orig', exc)}",
                        )
                    ]
                )
        # Lock the row only now, and read it again: a cancel may have come in meanwhile.
        batch = batches_repo.get_for_update(session, batch_id, refresh=True)
        assert batch is not None
        if not outcome.errors and batch.status == BatchStatus.VALIDATING:
            outcome.errors = _over_token_quota(session, settings, batch, outcome)
        if not outcome.errors and batch.status == BatchStatus.VALIDATING:
            batch.enqueued_tokens = outcome.enqueued_tokens
            batch.status, batch.in_progress_at = BatchStatus.IN_PROGRESS, now()
            batch.model, batch.total = outcome.model, outcome.total
            return outcome.model
        session.rollback()  # drop the rows (all of them if cancelled, else those before a problem)
        batch = batches_repo.get_for_update(session, batch_id)
        if batch is None or batch.status != BatchStatus.VALIDATING:
            return None  # cancelled meanwhile: finalize ends it as ``cancelled``
        batch.status, batch.failed_at = BatchStatus.FAILED, now()
        batch.errors = outcome.errors
        batch.model = batch.model or outcome.model  # the lines' model, shown with the reason
        # The outbox commits with the status.
        webhook_delivery.record_final(session, settings, batch)
        log.info("batch %s failed validation: %d problems", batch_id, len(outcome.errors))
        return None


def _no_such_file(batch: Batch) -> dict[str, Any]:
    """The ``errors.data`` entry of a batch created with an input file its tenant does not
    have: OpenAI's (recorded by llama-stack's compatibility tests, ``tests/integration/
    batches/test_batches_errors.py``: ``invalid_request``, no line, param ``file_id``)."""
    return wire.batch_error(
        wire.INVALID_REQUEST,
        f"Cannot find file {batch.input_file_id}, or organization {batch.tenant_id} does not "
        "have access to it.",
        param="file_id",
    )


def _over_token_quota(
    session: Session, settings: Settings, batch: Batch, outcome: Outcome
) -> list[dict[str, Any]]:
    """``[token_limit_exceeded entry]`` when the batch's enqueued tokens and those its tenant's
    running batches of the model still hold pass the tenant's ``max_enqueued_tokens`` (derived:
    a day of one engine's measured output of the model, ``offpeak.tenant_limits``), else
    ``[]``. Locks the tenant's row until the transaction ends, so two validations of one
    tenant take turns here and the second counts the first's batch (``quotas_repo``)."""
    tenant = quotas_repo.lock_tenant(session, batch.tenant_id)
    if outcome.model is None:
        return []
    rate = None
    if tenant_limits.enqueued_is_derived(tenant, settings.limits):
        since = time.time() - settings.scheduler.throughput_window_seconds
        rate = quotas_repo.engine_tokens_per_second(session, outcome.model, since)
    limit = tenant_limits.resolve(tenant, settings.limits, rate).max_enqueued_tokens
    if limit is None:
        return []
    held = quotas_repo.enqueued_tokens(session, batch.tenant_id, outcome.model)
    if held + outcome.enqueued_tokens <= limit:
        return []
    log.info(
        "batch %s refused: %d enqueued tokens held + %d asked > %d",
        batch.id, held, outcome.enqueued_tokens, limit,
    )  # fmt: skip
    # OpenAI's wording, which clients match on; the organization by the name its users know.
    organization = tenant.name if tenant is not None else batch.tenant_id
    return [
        wire.batch_error(
            wire.TOKEN_LIMIT_EXCEEDED,
            f"Enqueued token limit reached for {outcome.model} in organization "
            f"{organization}. Limit: {limit:,} enqueued tokens. Please try again once some "
            "in_progress batches have been completed.",
        )
    ]
