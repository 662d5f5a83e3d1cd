"""``/v1/batches``.

Retrieve and list are what users poll: ``async def`` routes with one dependency (``PollDep``:
the tenant, the settings and the reader), whose reads run on the event loop (``api.deps.Reader``)
and whose answers are written from plain dicts (``WireJSON``; the pydantic models document
them). Create and cancel write, in the request's transaction (``SessionDep``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from api.deps import CurrentTenant, PollDep, SessionDep, SettingsDep, TenantOrOperator
from api.errors import error_responses
from api.responses import WireJSON
from api.schemas.batches import BatchList, BatchObject, BatchResultList, CreateBatch
from api.schemas.common import list_json
from api.services import batch_pause as batch_pause_service
from api.services import batch_results as batch_results_service
from api.services import batches as batches_service
from api.services import billing as billing_service
from api.services.idempotency import IdempotencyDep

router = APIRouter(prefix="/v1/batches", tags=["batches"])


@router.post(
    "", response_model=BatchObject, responses=error_responses(400, 401, 404, 409, 413, 422)
)
def create_batch(
    body: CreateBatch,
    session: SessionDep,
    settings: SettingsDep,
    tenant: CurrentTenant,
    idempotency: IdempotencyDep,
) -> Response:
    def produce() -> BatchObject:
        batch = batches_service.create(session, settings, tenant.id, body)
        return BatchObject.of(batch, billing_service.bill_of(session, settings, batch))

    return idempotency.run(session, body.model_dump(mode="json"), produce)


@router.get("", response_model=BatchList, responses=error_responses(400, 401))
async def list_batches(
    poll: PollDep,
    after: str | None = None,
    # Documented, not enforced here: the service refuses other values with its own message.
    limit: Annotated[int, Query(json_schema_extra={"minimum": 1, "maximum": 100})] = 20,
) -> WireJSON:
    data, has_more = await poll.read(
        batches_service.page, poll.settings, poll.tenant.id, after=after, limit=limit
    )
    return WireJSON(list_json(data, has_more))


@router.get("/{batch_id}", response_model=BatchObject, responses=error_responses(400, 401, 404))
async def retrieve_batch(poll: PollDep, batch_id: str) -> WireJSON:
    return WireJSON(await poll.read(batches_service.poll, poll.settings, poll.tenant.id, batch_id))


@router.get(
    "/{batch_id}/results",
    response_model=BatchResultList,
    responses=error_responses(400, 401, 404),
)
async def batch_results(
    poll: PollDep,
    batch_id: str,
    after: str | None = None,
    limit: Annotated[
        int, Query(json_schema_extra={"minimum": 1, "maximum": batch_results_service.MAX_LIMIT})
    ] = batch_results_service.DEFAULT_LIMIT,
) -> Response:
    """An Offpeak extension: the batch's ended lines so far, each as its output or error file
    will hold it, in a stable order; ``after``: the ``last_id`` of the page before."""
    # On the reader's threads: rendering a page of lines is CPU the event loop should not wait on.
    body = await poll.read.in_thread(
        batch_results_service.page, poll.tenant.id, batch_id, after=after, limit=limit
    )
    return Response(body, media_type="application/json")


@router.post(
    "/{batch_id}/cancel",
    response_model=BatchObject,
    responses=error_responses(400, 401, 404, 409, 413),
)
def cancel_batch(
    session: SessionDep, settings: SettingsDep, tenant: CurrentTenant, batch_id: str
) -> BatchObject:
    batch = batches_service.cancel(session, settings, tenant.id, batch_id)
    return BatchObject.of(batch, billing_service.bill_of(session, settings, batch))


@router.post(
    "/{batch_id}/pause", response_model=BatchObject, responses=error_responses(400, 401, 404, 409)
)
def pause_batch(
    session: SessionDep, settings: SettingsDep, caller: TenantOrOperator, batch_id: str
) -> BatchObject:
    """An Offpeak extension: stop claiming the batch's lines (it stays ``in_progress``, with
    ``paused_at``); its tenant's key or the admin key."""
    tenant_id = None if caller is None else caller.id
    batch = batch_pause_service.pause(session, settings, tenant_id, batch_id)
    return BatchObject.of(batch, billing_service.bill_of(session, settings, batch))


@router.post(
    "/{batch_id}/resume", response_model=BatchObject, responses=error_responses(400, 401, 404, 409)
)
def resume_batch(
    session: SessionDep, settings: SettingsDep, caller: TenantOrOperator, batch_id: str
) -> BatchObject:
    """An Offpeak extension: claim a paused batch's lines again; its tenant's key or the admin
    key."""
    tenant_id = None if caller is None else caller.id
    batch = batch_pause_service.resume(session, settings, tenant_id, batch_id)
    return BatchObject.of(batch, billing_service.bill_of(session, settings, batch))
