"""``/v1/models`` and health."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.schemas import ModelList, ModelObject

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList)
def list_models(settings: SettingsDep, _tenant: CurrentTenant) -> ModelList:
    """The served models: every model configured for the worker fleet."""
    return ModelList(data=[ModelObject(id=name, created=0) for name in settings.models])


@router.get("/healthz")
def health(session: SessionDep) -> dict[str, str]:
    session.execute(text("SELECT 1"))
    return {"status": "ok"}
