"""``/v1/models`` (health: ``api.routes.health``)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentTenant, SettingsDep
from api.errors import error_responses
from api.schemas.models import ModelList, ModelObject

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
def list_models(settings: SettingsDep, _tenant: CurrentTenant) -> ModelList:
    """The served models: every model configured for the worker fleet."""
    return ModelList(data=[ModelObject(id=name, created=0) for name in settings.models])
