"""The relational schema, as SQLAlchemy 2 typed models.

The schema exists only through Alembic migrations (``migrations/``); these classes mirror it.
Times the API shows are unix seconds (integers, as the OpenAI wire format has them); lease times
are float unix seconds. Relationships are ``lazy="raise"`` so a hidden lazy load fails loudly.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ColumnElement,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.hybrid import hybrid_property
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from offpeak.statuses import LineStatus
from storage.sealing import SealedString

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY.
BigIntPK = BigInteger().with_variant(Integer, "sqlite")
JSONType = JSON().with_variant(JSONB, "postgresql")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger)
    #: The tenant's share of the engines against other tenants with work waiting (weighted fair
    #: sharing: a tenant of weight 2 gets twice the engine time of one of weight 1).
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default="1")
    # Per-tenant overrides of the quota and rate-limit defaults in settings; None: the default,
    # -1 (``offpeak.tenant_limits.UNLIMITED``): no limit.
    #: Enqueued tokens (prompt + requested output of lines not yet finished) per model.
    max_enqueued_tokens: Mapped[int | None] = mapped_column(BigInteger)
    #: Batches validating, in progress or finalizing at once.
    max_batches_in_progress: Mapped[int | None] = mapped_column(Integer)
    #: Bytes of stored files (uploads, outputs and errors not deleted).
    max_file_bytes: Mapped[int | None] = mapped_column(BigInteger)
    #: API requests per minute per key.
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    #: Batch creates per minute, all the tenant's keys together.
    batch_creates_per_minute: Mapped[int | None] = mapped_column(Integer)


class ApiKey(Base):
    """An API key; only its SHA-256 is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    #: The first characters of the key, to tell keys apart in listings.
    prefix: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[int] = mapped_column(BigInteger)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger)


class File(Base):
    """A stored file: metadata here, bytes in the blob store under ``blob_key``."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    blob_key: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[int | None] = mapped_column(BigInteger)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)

    __table_args__ = (
        # Ids start with their creation time, so id order is creation order (see offpeak.ids).
        Index("ix_files_tenant_id", "tenant_id", "id"),
        # One live file per stored blob: a re-run finalize reuses its output and error files.
        Index(
            "uq_files_blob_key_live",
            "blob_key",
            unique=True,
            postgresql_where=text("NOT deleted"),
            sqlite_where=text("NOT deleted"),
        ),
    )


class Batch(Base):
    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(200))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    #: The window's length in seconds, parsed from ``completion_window`` once at create: the
    #: deadline guard and billing read it, so a window this server no longer allows still counts.
    window_seconds: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), index=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONType)

    created_at: Mapped[int] = mapped_column(BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger)
    expires_at: Mapped[int] = mapped_column(BigInteger)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger)
    completed_at: Mapped[int | None] = mapped_column(BigInteger)
    failed_at: Mapped[int | None] = mapped_column(BigInteger)
    expired_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger)
    #: Set when a Message Batch (Anthropic's surface) is deleted: its request lines and files
    #: are gone, the row stays for its bill and its share of engine time.
    deleted_at: Mapped[int | None] = mapped_column(BigInteger)
    #: A Message Batch's number of requests as created: its request_counts add up to it even
    #: when no request row was ever made (cancelled or expired before validation).
    requests_submitted: Mapped[int | None] = mapped_column(Integer)

    # request_counts and usage, kept current while the batch runs and recomputed at the end.
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    #: Prompt tokens of the answered lines with each prefix group's shared prefix (as the prefix
    #: cache found it) counted once: the least the engine could have computed. Set at finalize.
    min_prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    #: The scheduler's estimate (unix seconds) of when the batch's last line will finish, refreshed
    #: by the workers and the sweep; the API shows it and the slack ``expires_at`` minus it.
    estimated_completion_at: Mapped[float | None] = mapped_column(Float)
    #: The cost estimate (``workers.estimate.Estimate.as_json``): prompt tokens by the model's
    #: tokenizer, the most completion tokens, the price range; ``None`` until counted, once the
    #: batch is in progress (``workers.estimate.estimate_batch``).
    estimate: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    #: ``output_expires_after[seconds]`` of the create: the output and error files expire this
    #: long after they are written (``None``: ``Settings.output_file_expiry_days``).
    output_expires_after: Mapped[int | None] = mapped_column(Integer)
    #: Prompt + requested output tokens of all the batch's lines, counted at validation
    #: (``offpeak.enqueued``); ``None`` before. Its unfinished lines' share is what the batch
    #: holds of its tenant's enqueued-token quota (``storage.repositories.quotas``).
    enqueued_tokens: Mapped[int | None] = mapped_column(BigInteger)
    #: Unix seconds the batch was paused (``POST /v1/batches/{id}/pause``), ``None`` while it is
    #: not: a paused batch stays ``in_progress`` and its window runs, but no claim takes its lines.
    paused_at: Mapped[int | None] = mapped_column(BigInteger)
    #: How many writes have ended lines of the batch: each takes the next number, under the
    #: batch's row lock, for the lines it ends (``RequestLine.finished_seq``).
    results_seq: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    #: The batch's breaker, ``offpeak.failure_limit.FailureLimit``'s fields (``None``: none),
    #: and when it tripped (unix seconds): the batch is then ``cancelling`` and ends ``failed``.
    failure_limit: Mapped[dict[str, Any] | None] = mapped_column(
        JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")
    )
    failure_limit_reached_at: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (Index("ix_batches_tenant_id", "tenant_id", "id"),)

    @hybrid_property
    def ended_at(self) -> int | None:
        """Unix second the batch reached its final status (the stamp of that status), ``None``
        until then; in a query, the same as SQL ``COALESCE`` of the stamps."""
        for stamp in (self.completed_at, self.expired_at, self.cancelled_at, self.failed_at):
            if stamp is not None:
                return stamp
        return None

    @ended_at.inplace.expression
    @classmethod
    def _ended_at_expression(cls) -> ColumnElement[int | None]:
        return func.coalesce(cls.completed_at, cls.expired_at, cls.cancelled_at, cls.failed_at)


#: The output line ``id`` of a stored record (``offpeak.endpoints.records``: its ``line_id``, in
#: its first 400 characters whatever the model's name), as SQL; ``NULL`` for a row stored already
#: rendered (before records) or with nothing stored.
#: Written as PostgreSQL shows the index's expression back, so the schema compares equal.
STORED_LINE_ID = """"substring"("left"(result, 400), '"line_id":"([^"]+)"'::text)"""


class RequestLine(Base):
    """One request line of a batch's input file, its progress and its result.

    ``line_json`` is the line as uploaded (the worker parses it); ``result`` is the finished
    output or error line, ready to be written to the output or error file as it is.
    """

    __tablename__ = "requests"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    #: 1-based line number in the input file, counting blank lines.
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(200))
    #: The batch's ``expires_at``, copied so the claim query orders by deadline without a join.
    deadline: Mapped[int] = mapped_column(BigInteger)
    line_json: Mapped[str] = mapped_column(Text)
    #: Lines whose prompts start alike share it (``workers.scheduler.prefix_groups``); claims
    #: take lines in (deadline, prefix_group, id) order, a group's lines together.
    prefix_group: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    #: pending → running → succeeded | failed; or cancelled / expired when it never ran.
    status: Mapped[str] = mapped_column(String(16), default=LineStatus.PENDING)
    status_code: Mapped[int | None] = mapped_column(Integer)
    result: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    #: The LoRA adapter the line names as its ``model`` (it runs on ``model``, the adapter's
    #: base); ``None`` for the base model itself.
    adapter: Mapped[str | None] = mapped_column(String(200))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    #: Where the line stands in the order its batch's results become readable
    #: (``storage.repositories.results``): the batch's ``results_seq`` that the write ending it
    #: took; ``None`` until it ends.
    finished_seq: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        UniqueConstraint("batch_id", "line", name="uq_requests_batch_line"),
        Index("ix_requests_batch_status", "batch_id", "status"),
        Index("ix_requests_claim", "model", "status", "deadline", "prefix_group", "id"),
        # A batch's pending lines in claim order, for the fair share's per-batch probe: only
        # pending entries, so the probe never walks past the lines claimed before it.
        Index(
            "ix_requests_pending",
            "batch_id",
            "deadline",
            "prefix_group",
            "id",
            postgresql_where=text("status = 'pending'"),
            sqlite_where=text("status = 'pending'"),
        ),
        # A batch's ended lines in the order its results are read while it runs.
        Index(
            "ix_requests_finished",
            "batch_id",
            "finished_seq",
            "id",
            postgresql_where=text("finished_seq IS NOT NULL"),
            sqlite_where=text("finished_seq IS NOT NULL"),
        ),
        # A results page's cursor (an output line's id) found in the stored records.
        Index(
            "ix_requests_line_id",
            "batch_id",
            text(STORED_LINE_ID),
            postgresql_where=text("finished_seq IS NOT NULL"),
        ).ddl_if(dialect="postgresql"),
    )


class WorkerRecord(Base):
    """A worker process: the models it serves and its last heartbeat."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(256))
    models: Mapped[list[str]] = mapped_column(JSONType)
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    ready: Mapped[bool] = mapped_column(Boolean, default=False)
    #: ``control`` or ``engine`` (``control,engine`` for a worker consuming both kinds of queue).
    role: Mapped[str] = mapped_column(String(32), default="engine", server_default="engine")


class EngineChunk(Base):
    """One accounting period of an engine: the wall-seconds it spent stepping (GPU-seconds on a
    GPU host) and the requests that finished in it. Written in the same transaction as those
    requests' results, so every period is recorded exactly once."""

    __tablename__ = "engine_chunks"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(String(128))
    model: Mapped[str] = mapped_column(String(200), index=True)
    #: ``cpu`` or the GPU's name, so prices per device can apply.
    device: Mapped[str] = mapped_column(String(128))
    started_at: Mapped[float] = mapped_column(Float, index=True)
    ended_at: Mapped[float] = mapped_column(Float)
    #: Seconds the engine spent in ``step()`` in this period, plus busy seconds carried from
    #: earlier periods in which no request finished.
    busy_seconds: Mapped[float] = mapped_column(Float)
    requests: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class EngineChunkBatch(Base):
    """A batch's share of one engine chunk: the tokens of its requests that finished in it."""

    __tablename__ = "engine_chunk_batches"

    chunk_id: Mapped[int] = mapped_column(
        ForeignKey("engine_chunks.id", ondelete="CASCADE"), primary_key=True
    )
    batch_id: Mapped[str] = mapped_column(
        ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True, index=True
    )
    requests: Mapped[int] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class SchedulerState(Base):
    """Small shared scheduler state by key (the admin pause switch, the last load reading)."""

    __tablename__ = "scheduler_state"

    key: Mapped[str] = mapped_column(String(128), primary_key=True)
    value: Mapped[dict[str, Any]] = mapped_column(JSONType)
    updated_at: Mapped[float] = mapped_column(Float)


#: US dollars, to 1e-10 (a short request's share of a CPU-second is a few millionths of a cent).
Money = Numeric(20, 10)


class LedgerEntry(Base):
    """One billing record, written once: ``key`` is unique (``batch:<id>`` for a batch's bill), so
    a retried or repeated billing step inserts nothing the second time.

    Amounts are frozen at billing time with the prices then in force. ``tenant_id`` and
    ``batch_id`` carry no foreign key: a ledger outlives the rows it bills.
    """

    __tablename__ = "ledger_entries"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(200), unique=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    batch_id: Mapped[str] = mapped_column(String(64), index=True)
    model: Mapped[str | None] = mapped_column(String(200))
    #: The batch's final status (completed, expired, cancelled, failed).
    status: Mapped[str] = mapped_column(String(16))
    #: The batch's ``created_at`` and the unix second it ended; usage is reported by ``ended_at``.
    created_at: Mapped[int] = mapped_column(BigInteger)
    ended_at: Mapped[int] = mapped_column(BigInteger)
    window_seconds: Mapped[int] = mapped_column(Integer)
    billed_at: Mapped[float] = mapped_column(Float)
    #: Request lines billed: those that finished with a response (not failed, expired, cancelled).
    requests: Mapped[int] = mapped_column(Integer)
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    #: Engine seconds attributed to the batch (GPU-seconds on a GPU host).
    gpu_seconds: Mapped[float] = mapped_column(Float)
    #: Our cost of those seconds, the price billed (list x (1 - discount)) and the real-time list
    #: price of the same tokens, in US dollars.
    cost: Mapped[Decimal] = mapped_column(Money)
    price: Mapped[Decimal] = mapped_column(Money)
    realtime_price: Mapped[Decimal] = mapped_column(Money)

    __table_args__ = (Index("ix_ledger_entries_tenant_ended", "tenant_id", "ended_at"),)


class LedgerAdapterUsage(Base):
    """A batch's bill split by LoRA adapter, written with its ``LedgerEntry`` (``key``) and
    frozen like it: one row per adapter its succeeded lines named; ``adapter`` ``""`` is the
    base model's lines. Engine seconds and cost are the entry's, shared by weighted tokens."""

    __tablename__ = "ledger_adapter_usage"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(200))
    tenant_id: Mapped[str] = mapped_column(String(64))
    batch_id: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(200))
    adapter: Mapped[str] = mapped_column(String(200))
    ended_at: Mapped[int] = mapped_column(BigInteger)
    requests: Mapped[int] = mapped_column(Integer)
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    gpu_seconds: Mapped[float] = mapped_column(Float)
    cost: Mapped[Decimal] = mapped_column(Money)
    price: Mapped[Decimal] = mapped_column(Money)
    realtime_price: Mapped[Decimal] = mapped_column(Money)

    __table_args__ = (
        UniqueConstraint("key", "adapter", name="uq_ledger_adapter_usage_key_adapter"),
        Index("ix_ledger_adapter_usage_tenant_ended", "tenant_id", "ended_at"),
    )


class LoraAdapter(Base):
    """A LoRA adapter registered at run time (``/v1/admin/adapters``), served on ``base_model``
    under ``name`` beside the adapters of the configuration (``ModelConfig.lora_modules``)."""

    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    base_model: Mapped[str] = mapped_column(String(200))
    #: A local PEFT adapter folder, or ``blob:<prefix>`` in the file store.
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[int] = mapped_column(BigInteger)


class LoadSample(Base):
    """A reading of the real-time load signal (``scheduler_state`` key ``load:<source>``), kept for
    ``load_history_hours`` for the dashboard's chart."""

    __tablename__ = "load_samples"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float, index=True)
    source: Mapped[str] = mapped_column(String(200))
    load: Mapped[float] = mapped_column(Float)
    paused: Mapped[bool] = mapped_column(Boolean, default=False)


class TaskMessage(Base):
    """A task message sent and not yet started, at most one per ``key`` (``finalize:<batch id>``,
    ``drain:<model>``, ``validate:<batch id>``), whatever the broker: a sender skips a message
    that is already queued (``storage.repositories.task_messages``).

    The task deletes the row when it starts, if ``mark`` is still the one its message carries. A
    row whose ``resend_at`` has passed counts as lost (a broker restart, a worker that died before
    starting it) and the next sender sends again, waiting twice as long before the next re-send.
    """

    __tablename__ = "queued_messages"

    key: Mapped[str] = mapped_column(String(300), primary_key=True)
    #: The token the last message sent for ``key`` carries.
    mark: Mapped[str] = mapped_column(String(32))
    sent_at: Mapped[float] = mapped_column(Float)
    #: Unix seconds at which the message becomes runnable (its countdown ends).
    due_at: Mapped[float] = mapped_column(Float)
    #: Seconds after ``due_at`` the message may wait unstarted before it counts as lost.
    wait_seconds: Mapped[float] = mapped_column(Float)
    #: ``due_at + wait_seconds``.
    resend_at: Mapped[float] = mapped_column(Float)


class WebhookEndpoint(Base):
    """A tenant's webhook endpoint (OpenAI's ``webhook_endpoint``): where batch events go.

    ``secret`` signs every delivery (it cannot be hashed: the server computes HMACs with it; it
    is stored encrypted, ``storage.sealing``);
    after a rotation that keeps the old one, ``previous_secret`` signs too until
    ``previous_secret_until`` (unix seconds).
    """

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(Text)
    event_types: Mapped[list[str]] = mapped_column(JSONType)
    secret: Mapped[str] = mapped_column(SealedString(255))
    previous_secret: Mapped[str | None] = mapped_column(SealedString(255))
    previous_secret_until: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (Index("ix_webhook_endpoints_tenant_id", "tenant_id", "id"),)


class WebhookEvent(Base):
    """An event to send (the outbox): written in the transaction that sets a batch's final
    status, with its body as the exact bytes every attempt sends.

    ``dedupe_key`` (``<type>:<batch id>``) is unique, so one final status makes one event however
    often finalize runs; a test event has none.
    """

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(64))
    object_id: Mapped[str] = mapped_column(String(64))
    dedupe_key: Mapped[str | None] = mapped_column(String(200), unique=True)
    body: Mapped[str] = mapped_column(Text)
    created_at: Mapped[int] = mapped_column(BigInteger, index=True)


class WebhookDelivery(Base):
    """One event owed to one endpoint: ``pending`` until a 2xx answer (``delivered``) or until
    retries end after ``give_up_at`` (``failed``). ``next_attempt_at`` is also the lease of the
    worker sending it: pushed ahead before the HTTP call, so a worker that dies mid-call leaves
    the delivery due again (at least once)."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    next_attempt_at: Mapped[float | None] = mapped_column(Float)
    give_up_at: Mapped[float] = mapped_column(Float)
    delivered_at: Mapped[float | None] = mapped_column(Float)
    last_status_code: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        UniqueConstraint("event_id", "endpoint_id", name="uq_webhook_deliveries_event_endpoint"),
        Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "id"),
    )


class WebhookAttempt(Base):
    """The delivery log: one row per HTTP attempt, with the receiver's status code (``None``:
    no answer), the seconds it took and, on failure, why."""

    __tablename__ = "webhook_attempts"

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True, autoincrement=True)
    delivery_id: Mapped[str] = mapped_column(
        ForeignKey("webhook_deliveries.id", ondelete="CASCADE"), index=True
    )
    attempt: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    status_code: Mapped[int | None] = mapped_column(Integer)
    latency_seconds: Mapped[float] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)


class IdempotencyKey(Base):
    """An ``Idempotency-Key`` a tenant sent (IETF httpapi idempotency-key draft): the request's
    fingerprint (SHA-256 of method, path and body), ``in_flight`` while the first request runs
    (until ``locked_until``), then ``done`` with the status code and body it answered, replayed
    to every retry until ``expires_at``."""

    __tablename__ = "idempotency_keys"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    state: Mapped[str] = mapped_column(String(16))
    status_code: Mapped[int | None] = mapped_column(Integer)
    response_body: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    locked_until: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float, index=True)
