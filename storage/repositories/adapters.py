"""LoRA adapters: those registered at run time (``lora_adapters``) and, beside them, those of
the configuration (``ModelConfig.lora_modules``), as one list every API replica and worker
reads alike."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from offpeak.ids import now
from offpeak.settings import Settings
from storage.models import LoraAdapter


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter served on ``base_model`` under ``name``: a PEFT folder at ``path`` (local
    or ``blob:<prefix>``); ``source`` is ``config`` (``lora_modules``) or ``registered``."""

    name: str
    base_model: str
    path: str
    source: str
    created_at: int = 0


def configured(settings: Settings) -> dict[str, Adapter]:
    """The adapters of the configuration, by name."""
    return {
        name: Adapter(name, model, path, "config")
        for model, config in settings.models.items()
        for name, path in config.lora_modules.items()
    }


def served(session: Session, settings: Settings) -> dict[str, Adapter]:
    """Every adapter, by name: the configuration's, then the registered ones of a configured
    model (a configured name wins over a registered one)."""
    found = configured(settings)
    for row in session.scalars(select(LoraAdapter).order_by(LoraAdapter.name)):
        if row.name not in found and row.base_model in settings.models:
            found[row.name] = Adapter(
                row.name, row.base_model, row.path, "registered", row.created_at
            )
    return found


def get(session: Session, name: str) -> LoraAdapter | None:
    return session.get(LoraAdapter, name)


def add(session: Session, name: str, base_model: str, path: str) -> LoraAdapter:
    """Register (or re-point) the adapter ``name``."""
    row = session.get(LoraAdapter, name)
    if row is None:
        row = LoraAdapter(name=name, base_model=base_model, path=path, created_at=now())
        session.add(row)
    else:
        row.base_model, row.path = base_model, path
    session.flush()
    return row


def remove(session: Session, name: str) -> bool:
    """Forget the registered adapter ``name``; whether there was one."""
    result = session.execute(delete(LoraAdapter).where(LoraAdapter.name == name))
    return bool(getattr(result, "rowcount", 0))
