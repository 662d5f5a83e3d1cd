"""``/v1/admin/scheduler``: pause and resume batch work, and the scheduler's view.

Guarded by the admin key (``OFFPEAK_ADMIN_API_KEY``), not a tenant's: pausing affects everyone.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Header

from api.deps import SessionDep, SettingsDep
from api.errors import Unauthorized
from api.schemas import PauseRequest, PauseSwitch, ResumeRequest, SchedulerView
from api.services import admin as admin_service

router = APIRouter(prefix="/v1/admin/scheduler", tags=["admin"])


def require_admin(
    settings: SettingsDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """401 unless ``Authorization: Bearer <OFFPEAK_ADMIN_API_KEY>``; always 401 when unset."""
    expected = settings.admin_api_key
    if not expected:
        raise Unauthorized(
            "The admin API is off: set OFFPEAK_ADMIN_API_KEY (or use `offpeak pause`)."
        )
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        given = ""
    if not hmac.compare_digest(given.strip().encode(), expected.encode()):
        raise Unauthorized("Incorrect admin API key provided.")


AdminDep = Depends(require_admin)


@router.post("/pause", response_model=PauseSwitch, dependencies=[AdminDep])
def pause(body: PauseRequest, session: SessionDep) -> PauseSwitch:
    return admin_service.pause(session, body.pool, hard=body.hard, reason=body.reason)


@router.post("/resume", response_model=PauseSwitch, dependencies=[AdminDep])
def resume(body: ResumeRequest, session: SessionDep) -> PauseSwitch:
    return admin_service.resume(session, body.pool)


@router.get("", response_model=SchedulerView, dependencies=[AdminDep])
def scheduler_view(session: SessionDep) -> SchedulerView:
    return admin_service.view(session)
