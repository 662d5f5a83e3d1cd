"""``/v1/admin/scheduler``: pause and resume batch work, and the scheduler's view.

Guarded by the admin key (``OFFPEAK_ADMIN_API_KEY``), not a tenant's: pausing affects everyone.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.deps import SessionDep, SettingsDep
from api.errors import Unauthorized, error_responses
from api.schemas.admin import PauseRequest, PauseSwitch, ResumeRequest, SchedulerView
from api.services import admin as admin_service

router = APIRouter(prefix="/v1/admin/scheduler", tags=["admin"])


admin_key_scheme = HTTPBearer(
    auto_error=False, scheme_name="AdminKey", description="OFFPEAK_ADMIN_API_KEY."
)


def require_admin(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(admin_key_scheme)],
) -> None:
    """401 unless ``Authorization: Bearer <OFFPEAK_ADMIN_API_KEY>``; always 401 when unset."""
    expected = settings.admin_api_key
    if not expected:
        raise Unauthorized(
            "The admin API is off: set OFFPEAK_ADMIN_API_KEY (or use `offpeak pause`)."
        )
    given = credentials.credentials.strip() if credentials else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized("Incorrect admin API key provided.")


AdminDep = Depends(require_admin)


#: Bodies are JSON (422 when not), under the JSON body limit (413).
_WITH_BODY = error_responses(400, 401, 413, 422)


@router.post("/pause", response_model=PauseSwitch, dependencies=[AdminDep], responses=_WITH_BODY)
def pause(body: PauseRequest, session: SessionDep) -> PauseSwitch:
    return admin_service.pause(session, body.pool, hard=body.hard, reason=body.reason)


@router.post("/resume", response_model=PauseSwitch, dependencies=[AdminDep], responses=_WITH_BODY)
def resume(body: ResumeRequest, session: SessionDep) -> PauseSwitch:
    return admin_service.resume(session, body.pool)


@router.get(
    "", response_model=SchedulerView, dependencies=[AdminDep], responses=error_responses(401)
)
def scheduler_view(session: SessionDep) -> SchedulerView:
    return admin_service.view(session)
