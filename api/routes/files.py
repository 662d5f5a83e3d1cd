"""``/v1/files``.

Retrieve and content (the output a poll ends with) are ``async def`` routes that read through
the app's reader (``PollDep``): retrieve's one statement on the event loop (``api.deps.Reader``),
its answer written from a plain dict (``WireJSON``); content's row and a file of up to 1 MiB in
one call to the reader's threads (the blob store's reads are not the database's). The rest use
the request's transaction (``SessionDep``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Annotated

from fastapi import APIRouter, Form, Query, Response, UploadFile
from fastapi.responses import StreamingResponse
from starlette.concurrency import iterate_in_threadpool

from api.deps import BlobsDep, CurrentTenant, PollDep, SessionDep, SettingsDep
from api.errors import BadRequest, error_responses
from api.responses import WireJSON
from api.schemas.files import FileDeleted, FileList, FileObject
from api.services import files as files_service
from api.services.idempotency import IdempotencyDep

router = APIRouter(prefix="/v1/files", tags=["files"])


@router.post("", response_model=FileObject, responses=error_responses(400, 401, 409, 413, 422))
def upload_file(
    session: SessionDep,
    blobs: BlobsDep,
    settings: SettingsDep,
    tenant: CurrentTenant,
    idempotency: IdempotencyDep,
    file: UploadFile,
    purpose: Annotated[str, Form(json_schema_extra={"enum": list(files_service.UPLOAD_PURPOSES)})],
    expires_after_anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    expires_after_seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None,
) -> Response:
    if expires_after_anchor not in (None, "created_at"):
        raise BadRequest(
            "expires_after[anchor] must be 'created_at'.", param="expires_after.anchor"
        )
    filename = file.filename or "upload.jsonl"

    def produce() -> FileObject:
        stored = files_service.upload(
            session,
            blobs,
            settings,
            tenant_id=tenant.id,
            stream=file.file,
            filename=filename,
            purpose=purpose,
            expires_after_seconds=expires_after_seconds,
        )
        return FileObject.of(stored)

    material: dict[str, object] = {}
    if idempotency.key is not None:  # hashing the bytes costs a read of the spooled upload
        material = files_service.upload_fingerprint(
            file.file, filename, purpose, expires_after_anchor, expires_after_seconds
        )
    return idempotency.run(session, material, produce)


@router.get("", response_model=FileList, responses=error_responses(400, 401))
def list_files(
    session: SessionDep,
    tenant: CurrentTenant,
    purpose: str | None = None,
    # Bounds documented, not enforced here: the service refuses values outside them with its
    # own messages (json_schema_extra only changes the OpenAPI document).
    limit: Annotated[int, Query(json_schema_extra={"minimum": 1, "maximum": 10_000})] = 10_000,
    order: Annotated[str, Query(json_schema_extra={"enum": ["asc", "desc"]})] = "desc",
    after: str | None = None,
) -> FileList:
    rows, has_more = files_service.page(
        session, tenant.id, purpose=purpose, after=after, limit=limit, order=order
    )
    data = [FileObject.of(f) for f in rows]
    return FileList(
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=has_more,
    )


@router.get("/{file_id}", response_model=FileObject, responses=error_responses(400, 401, 404))
async def retrieve_file(poll: PollDep, file_id: str) -> WireJSON:
    return WireJSON(await poll.read(files_service.retrieve, poll.tenant.id, file_id))


@router.get(
    "/{file_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The file's bytes (JSONL for batch input, output and error files).",
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        },
        **error_responses(400, 401, 404),
    },
)
async def file_content(poll: PollDep, blobs: BlobsDep, file_id: str) -> Response:
    head, rest = await poll.read.in_thread(files_service.content, blobs, poll.tenant.id, file_id)
    if rest is None:
        # All of it was read with the row (up to 1 MiB: most downloads that end a poll): one
        # answer with its length, without a streaming response's task group per request.
        return Response(b"".join(head), media_type="application/octet-stream")
    return StreamingResponse(_stream(head, rest), media_type="application/octet-stream")


async def _stream(head: list[bytes], rest: Iterator[bytes] | None) -> AsyncIterator[bytes]:
    """The pieces read with the file's row, then the rest, each read on the threadpool as it
    is sent (after the row's read has returned its connection to the pool)."""
    for chunk in head:
        yield chunk
    if rest is not None:
        async for chunk in iterate_in_threadpool(rest):
            yield chunk


@router.delete("/{file_id}", response_model=FileDeleted, responses=error_responses(400, 401, 404))
def delete_file(
    session: SessionDep, blobs: BlobsDep, tenant: CurrentTenant, file_id: str
) -> FileDeleted:
    files_service.delete(session, blobs, tenant.id, file_id)
    return FileDeleted(id=file_id)
