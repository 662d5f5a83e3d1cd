"""LoRA adapters registered on a running service: add, list, remove. Every API replica and
engine worker reads the same table (``storage.repositories.adapters``), so a registered adapter
is served without a restart; the configuration's ``lora_modules`` are listed beside them."""

from __future__ import annotations

from sqlalchemy.orm import Session

from api.errors import BadRequest, Conflict, NotFound
from api.schemas.adapters import AdapterView
from offpeak.settings import Settings
from storage.repositories import adapters as adapters_repo
from storage.repositories.adapters import Adapter


def _view(adapter: Adapter) -> AdapterView:
    return AdapterView(
        name=adapter.name,
        base_model=adapter.base_model,
        path=adapter.path,
        source=adapter.source,  # type: ignore[arg-type]
        created_at=adapter.created_at,
    )


def list_adapters(session: Session, settings: Settings) -> list[AdapterView]:
    """Every adapter served, the configuration's and the registered ones, by name."""
    served = adapters_repo.served(session, settings)
    return [_view(served[name]) for name in sorted(served)]


def add(session: Session, settings: Settings, name: str, base_model: str, path: str) -> AdapterView:
    """Register ``name`` on ``base_model`` (again: re-pointed at ``path``).

    Raises ``BadRequest`` for a base model not configured, one served without LoRA (its
    ``max_loras`` is 0 and it has no ``lora_modules``), or an engine that cannot run adapters (an
    embedding model), and ``Conflict`` for a name that is a served model's or a configured
    adapter's."""
    config = settings.models.get(base_model)
    if config is None:
        raise BadRequest(
            f"The base model '{base_model}' is not served. Served models: "
            f"{', '.join(sorted(settings.models))}.",
            param="base_model",
            code="model_not_found",
        )
    if config.runner != "generate":
        raise BadRequest(
            f"The model '{base_model}' is an embedding model; LoRA adapters run on text models.",
            param="base_model",
        )
    if config.engine == "vllm" and not config.lora_slots:
        raise BadRequest(
            f"The model '{base_model}' is served without LoRA: set its max_loras above 0 "
            "(OFFPEAK_MODELS) and restart its engine workers, then register adapters.",
            param="base_model",
            code="lora_disabled",
        )
    if name in settings.models:
        raise Conflict(f"'{name}' is a served model's name.", param="name")
    if name in adapters_repo.configured(settings):
        raise Conflict(
            f"The adapter '{name}' is in the configuration (lora_modules); change it there.",
            param="name",
        )
    row = adapters_repo.add(session, name, base_model, path)
    return _view(Adapter(row.name, row.base_model, row.path, "registered", row.created_at))


def remove(session: Session, settings: Settings, name: str) -> None:
    """Forget the registered adapter ``name``: lines of it not yet run fail with
    ``model_not_found``. Raises ``Conflict`` for a configured adapter, ``NotFound`` for none."""
    if name in adapters_repo.configured(settings):
        raise Conflict(
            f"The adapter '{name}' is in the configuration (lora_modules); remove it there.",
            param="name",
        )
    if not adapters_repo.remove(session, name):
        raise NotFound(f"No registered adapter named '{name}'.", param="name")
