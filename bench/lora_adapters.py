"""Tiny PEFT LoRA adapters for tests and benchmarks, written on the spot for a model folder
(nothing downloaded): ``adapter_config.json`` and ``adapter_model.safetensors`` in PEFT's layout,
the shapes read from the model's ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

#: The projections the test adapters change (PEFT's names; vLLM packs them into qkv_proj).
TARGET_MODULES = ("q_proj", "v_proj")

Kind = Literal["zero", "random", "corrupt"]


def write_adapter(
    folder: Path, model_folder: Path, kind: Kind, *, rank: int = 8, seed: int = 0
) -> Path:
    """Write a LoRA adapter of the model at ``model_folder`` into ``folder``; returns it.

    ``zero``: every ``lora_B`` is zero (PEFT's own initialisation), so the adapter changes
    nothing; ``random``: both matrices random, large enough to change greedy answers;
    ``corrupt``: a valid config and a weights file that is not safetensors.
    """
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_folder / "config.json").read_text())
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    outputs = {"q_proj": heads * head_dim, "v_proj": kv_heads * head_dim}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(TARGET_MODULES),
                "base_model_name_or_path": str(model_folder),
                "fan_in_fan_out": False,
                "modules_to_save": None,
            }
        )
    )
    weights = folder / "adapter_model.safetensors"
    if kind == "corrupt":
        weights.write_bytes(b"this is not a safetensors file" * 64)
        return folder
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module in TARGET_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, hidden, generator=generator) / hidden**0.5
            b = torch.randn(outputs[module], rank, generator=generator) * 0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.zeros_like(b) if kind == "zero" else b
            ).contiguous()
    save_file(tensors, str(weights))
    return folder
