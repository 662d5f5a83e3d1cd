"""Wire types of the HTTP API (OpenAI's File and Batch objects), built from storage rows."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from storage.models import Batch, File


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: str
    status_details: str | None = None

    @classmethod
    def of(cls, file: File) -> FileObject:
        return cls(
            id=file.id,
            bytes=file.bytes,
            created_at=file.created_at,
            expires_at=file.expires_at,
            filename=file.filename,
            purpose=file.purpose,
            status=file.status,
        )


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchErrorEntry(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorEntry]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None

    @classmethod
    def of(cls, batch: Batch) -> BatchObject:
        errors = (
            BatchErrors(data=[BatchErrorEntry(**e) for e in batch.errors]) if batch.errors else None
        )
        return cls(
            id=batch.id,
            endpoint=batch.endpoint,
            model=batch.model,
            errors=errors,
            input_file_id=batch.input_file_id,
            completion_window=batch.completion_window,
            status=batch.status,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            created_at=batch.created_at,
            in_progress_at=batch.in_progress_at,
            expires_at=batch.expires_at,
            finalizing_at=batch.finalizing_at,
            completed_at=batch.completed_at,
            failed_at=batch.failed_at,
            expired_at=batch.expired_at,
            cancelling_at=batch.cancelling_at,
            cancelled_at=batch.cancelled_at,
            request_counts=RequestCounts(
                total=batch.total, completed=batch.completed, failed=batch.failed
            ),
            usage=BatchUsage(
                input_tokens=batch.input_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=batch.cached_tokens),
                output_tokens=batch.output_tokens,
                output_tokens_details=OutputTokensDetails(),
                total_tokens=batch.input_tokens + batch.output_tokens,
            ),
            metadata=batch.metadata_,
        )


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class CreateBatch(BaseModel):
    """``POST /v1/batches`` body. Unknown fields are ignored, as OpenAI does."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None
    output_expires_after: dict[str, Any] | None = None


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "offpeak"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject] = Field(default_factory=list)
