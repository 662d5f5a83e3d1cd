"""Tiny PEFT LoRA adapters for tests: the generator the benchmarks use too
(``bench.lora_adapters``)."""

from bench.lora_adapters import TARGET_MODULES, Kind, write_adapter

__all__ = ["TARGET_MODULES", "Kind", "write_adapter"]
