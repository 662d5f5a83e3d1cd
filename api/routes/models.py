"""``/v1/models`` (health: ``api.routes.health``)."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import CurrentTenant, SessionDep, SettingsDep
from api.errors import error_responses
from api.schemas.models import ModelList, ModelObject
from api.services import adapters as adapters_service

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList, responses=error_responses(401))
def list_models(settings: SettingsDep, session: SessionDep, _tenant: CurrentTenant) -> ModelList:
    """The served models: every model configured for the worker fleet, then every LoRA adapter
    with its base model as ``parent`` (as vLLM's server lists them); ``root`` is the model's own
    name (vLLM gives an adapter's path there, which is the operator's business, not a tenant's)."""
    models = [ModelObject(id=name, created=0, root=name) for name in settings.models]
    adapters = [
        ModelObject(id=a.name, created=a.created_at, parent=a.base_model, root=a.name)
        for a in adapters_service.list_adapters(session, settings)
    ]
    return ModelList(data=models + adapters)
