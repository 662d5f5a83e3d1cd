"""A runner's LoRA adapters: which adapter of its model a request line names, and the adapter's
folder on this host (one in the file store is fetched once into the model cache).

The list is the configuration's ``lora_modules`` plus the adapters registered at run time
(``storage.repositories.adapters``), read again every ``REFRESH_SECONDS`` and when a line names
one not known yet, so an adapter registered on a running service is served without a restart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from offpeak.endpoints import LineError
from offpeak.settings import Settings
from storage.blobs import BlobStore, StoreUnavailable, get_blob_store
from storage.db import session_scope
from storage.errors import TRANSIENT_DB_ERRORS
from storage.repositories import adapters as adapters_repo
from storage.repositories.adapters import Adapter
from workers.engine.base import EngineFault, LoraSpec

log = logging.getLogger(__name__)

#: Seconds a read of the registered adapters is used before it is read again.
REFRESH_SECONDS = 5.0
#: Seconds between reads forced by a name not known yet (lines of a removed adapter).
MISS_REFRESH_SECONDS = 1.0
#: A ``path`` in the file store: ``blob:<prefix>``, the adapter's files under ``<prefix>/``.
BLOB_PREFIX = "blob:"
#: The files of a PEFT LoRA adapter folder fetched from the file store (the weights in either
#: format, whichever the store has).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


class AdapterBook:
    """Resolves request lines' ``model`` to the adapters of ``model``. Thread-safe (the claim
    thread prepares lines). ``database_url`` ``None``: the configuration's adapters only."""

    def __init__(
        self,
        settings: Settings,
        model: str,
        database_url: str | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings, self.model, self.database_url = settings, model, database_url
        self.clock = clock
        self._lock = threading.Lock()
        self._adapters: dict[str, Adapter] = adapters_repo.configured(settings)
        self._read_at = -float("inf")
        self._fetched: dict[tuple[str, str], Path] = {}

    def resolve(self, name: str) -> LoraSpec:
        """The adapter ``name`` of this model, its folder local.

        Raises ``LineError`` 404 ``model_not_found`` for a name that is no adapter of this model
        (removed since the batch was validated), ``LineError`` 500 ``adapter_load_failed`` for
        an adapter the file store does not have, and ``EngineFault`` (blameless: the lines run
        again later) while the file store does not answer, or the database does not and the
        list last read lacks ``name``."""
        adapter = self._lookup(name)
        if adapter is None or adapter.base_model != self.model:
            raise LineError(
                f"The model '{name}' does not exist: it is neither {self.model!r} nor one of "
                "its LoRA adapters (was the adapter removed?).",
                "model",
                "model_not_found",
                status_code=404,
            )
        if not adapter.path.startswith(BLOB_PREFIX):
            return LoraSpec(adapter.name, adapter.path)
        return LoraSpec(adapter.name, str(self._fetch(adapter)))

    def _lookup(self, name: str) -> Adapter | None:
        with self._lock:
            at = self.clock()
            stale = at - self._read_at >= REFRESH_SECONDS
            missing = name not in self._adapters and at - self._read_at >= MISS_REFRESH_SECONDS
            if self.database_url is not None and (stale or missing):
                try:
                    with session_scope(self.database_url) as session:
                        self._adapters = adapters_repo.served(session, self.settings)
                    self._read_at = at
                except TRANSIENT_DB_ERRORS as exc:
                    # The list last read serves meanwhile; a name it lacks is no line's fault.
                    if name not in self._adapters:
                        raise EngineFault(f"cannot read the LoRA adapters: {exc}",
                                          blameless=True) from exc  # fmt: skip
                    log.warning("cannot read the LoRA adapters, using the last list: %s", exc)
            return self._adapters.get(name)

    def _fetch(self, adapter: Adapter) -> Path:
        """The adapter's files copied from the file store into the model cache, once per
        (name, path); a folder already complete is used as it is."""
        key = (adapter.name, adapter.path)
        with self._lock:
            if key in self._fetched:
                return self._fetched[key]
            prefix = adapter.path.removeprefix(BLOB_PREFIX).strip("/")
            digest = hashlib.sha256(adapter.path.encode()).hexdigest()[:16]
            folder = self.settings.model_cache_dir / "adapters" / f"{adapter.name}-{digest}"
            try:
                _download(get_blob_store(self.settings.resolved_blob_url), prefix, folder)
            except StoreUnavailable as exc:
                raise EngineFault(f"cannot fetch adapter {adapter.name}: {exc}",
                                  blameless=True) from exc  # fmt: skip
            except FileNotFoundError as exc:
                raise LineError(
                    f"The LoRA adapter {adapter.name!r} cannot be loaded: the file store has no "
                    f"adapter_config.json and weights under {prefix!r}.",
                    "model",
                    "adapter_load_failed",
                    status_code=500,
                ) from exc
            self._fetched[key] = folder
            return folder


def _download(blobs: BlobStore, prefix: str, folder: Path) -> None:
    """Copy the adapter files under ``prefix`` into ``folder`` (each written to a temporary name
    renamed into place). Raises ``FileNotFoundError`` when the config or both weights are
    missing."""
    folder.mkdir(parents=True, exist_ok=True)
    present = [name for name in ADAPTER_FILES if blobs.exists(f"{prefix}/{name}")]
    if "adapter_config.json" not in present or len(present) < 2:
        raise FileNotFoundError(prefix)
    for name in present:
        target = folder / name
        if target.exists():
            continue
        # Engine workers on one host may fetch the same adapter at once: each its own name.
        partial = folder / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
        with partial.open("wb") as out:
            for chunk in blobs.iter_chunks(f"{prefix}/{name}"):
                out.write(chunk)
        partial.replace(target)
    log.info("fetched adapter files under %s into %s", prefix, folder)
