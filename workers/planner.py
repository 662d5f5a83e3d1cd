"""Capacity planning: how many sequences fit in memory and which batch size to run.

Pure functions over the cost models of ``docs/planning.md`` (the step model, and the KV cache
that memory holds per sequence). The only I/O is reading a ``config.json`` or listing a model
folder where a function says so. Memory is in bytes; GB are decimal (``80e9``), KiB binary
(1,024 bytes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Bytes per element of each ``torch_dtype`` a Hugging Face ``config.json`` may name.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}

#: vLLM's default KV-cache block size, in tokens (``--block-size``).
DEFAULT_BLOCK_SIZE = 16

#: Upper bound on ``max_num_seqs`` whatever the memory allows: vLLM's largest default (1,024 on
#: big GPUs); beyond it per-step scheduling overhead dominates.
MAX_NUM_SEQS_CAP = 1024


# --- Memory -----------------------------------------------------------------------------------


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name such as ``"bfloat16"`` or ``"torch.float16"``.

    Raises ``ValueError`` for a name not in ``DTYPE_BYTES``.
    """
    name = dtype.removeprefix("torch.").lower()
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; pass the bytes per element directly")
    return DTYPE_BYTES[name]


def read_config(path: Path) -> dict[str, Any]:
    """The parsed ``config.json`` at ``path``, or at ``path / "config.json"`` for a folder.

    Raises ``FileNotFoundError`` when absent and ``ValueError`` when it is not a JSON object.
    """
    if path.is_dir():
        path = path / "config.json"
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def kv_bytes_per_token(config: dict[str, Any], dtype_size: int | None = None) -> int:
    """KV-cache bytes one token takes across all layers, from a Hugging Face ``config.json``.

    ``2 (key and value) × layers × KV heads × head_dim × bytes per element``:
    ``2 * 32 * 8 * 128 * 2`` = 131,072 bytes (128 KiB) for Llama 3 8B. ``head_dim`` is read when
    present, else ``hidden_size / num_attention_heads``; KV heads default to the attention heads
    (no grouped-query attention). The element size comes from ``torch_dtype`` (``dtype`` in newer
    configs) unless ``dtype_size`` overrides it, e.g. 1 for an fp8 KV cache. Multimodal configs are
    read from their ``text_config``. Assumes every layer caches full keys and values: MLA and
    sliding-window models need fewer bytes (pass the number directly for them).

    Raises ``ValueError`` when a needed field is missing.
    """
    text = config.get("text_config")
    if "num_hidden_layers" not in config and isinstance(text, dict):
        config = {**config, **text}
    try:
        layers = int(config["num_hidden_layers"])
        attention_heads = int(config["num_attention_heads"])
    except KeyError as missing:
        raise ValueError(f"config.json lacks {missing.args[0]!r}") from None
    kv_heads = int(config.get("num_key_value_heads") or attention_heads)
    head_dim = config.get("head_dim")
    if not head_dim:
        if "hidden_size" not in config:
            raise ValueError("config.json has neither 'head_dim' nor 'hidden_size'")
        head_dim = int(config["hidden_size"]) // attention_heads
    if dtype_size is None:
        dtype = config.get("torch_dtype") or config.get("dtype")
        if not dtype:
            raise ValueError("config.json names no torch_dtype; pass the bytes per element")
        dtype_size = dtype_bytes(str(dtype))
    return 2 * layers * kv_heads * int(head_dim) * dtype_size


def weights_bytes(parameters: float, dtype_size: int) -> int:
    """Bytes the weights take: ``parameters × dtype_size`` (Llama 3 8B, 16-bit: 8e9 × 2 = 16 GB)."""
    return int(parameters * dtype_size)


def weights_bytes_in_folder(folder: Path) -> int:
    """Summed size in bytes of the ``*.safetensors`` files in ``folder`` (not recursive).

    Raises ``FileNotFoundError`` when the folder holds none.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return sum(f.stat().st_size for f in files)


def sequences_that_fit(
    device_bytes: int, weights: int, kv_per_token: int, tokens_per_sequence: int
) -> int:
    """Sequences whose KV cache fits beside the weights: ``⌊(device − weights) / (kv × tokens)⌋``.

    ``docs/planning.md`` ("Memory decides the batch"). Integer arithmetic, so the floor is exact.
    Zero when the weights alone fill the device. Raises ``ValueError`` for a non-positive
    ``kv_per_token`` or ``tokens_per_sequence``.
    """
    if kv_per_token <= 0 or tokens_per_sequence <= 0:
        raise ValueError("KV bytes per token and tokens per sequence must be positive")
    return max(0, (device_bytes - weights) // (kv_per_token * tokens_per_sequence))


@dataclass(frozen=True)
class MemoryPlan:
    """Sequences that fit reserved (whole context up front) against paged (as tokens arrive)."""

    device_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    reserved_tokens: int
    reserved_sequences: int
    paged_avg_tokens: int
    paged_sequences: int

    @property
    def kv_budget_bytes(self) -> int:
        """Bytes left for the KV cache once the weights are loaded (never negative)."""
        return max(0, self.device_bytes - self.weights_bytes)


def plan_memory(
    device_bytes: int,
    weights: int,
    kv_per_token: int,
    reserved_tokens: int = 8192,
    paged_avg_tokens: int = 2000,
) -> MemoryPlan:
    """Sequences that fit when each reserves ``reserved_tokens`` against paging that averages
    ``paged_avg_tokens``. Llama 3 8B on an 80 GB GPU (80e9 device, 16e9 weights, 131,072
    B/token) gives 59 and 244. Raises ``ValueError`` as ``sequences_that_fit``."""
    return MemoryPlan(
        device_bytes=device_bytes,
        weights_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        reserved_tokens=reserved_tokens,
        reserved_sequences=sequences_that_fit(device_bytes, weights, kv_per_token, reserved_tokens),
        paged_avg_tokens=paged_avg_tokens,
        paged_sequences=sequences_that_fit(device_bytes, weights, kv_per_token, paged_avg_tokens),
    )


# --- Step time, throughput and batch size -----------------------------------------------------


@dataclass(frozen=True)
class StepModel:
    """One decode step's time as ``base_ms + per_seq_ms × batch``, in milliseconds.

    Defaults are 10 ms + 0.4 ms per sequence, a GPU-like example with the right shape, not a
    measurement (``docs/planning.md``); ``workers.calibration`` fits real ones.
    """

    base_ms: float = 10.0
    per_seq_ms: float = 0.4

    def step_ms(self, batch: int) -> float:
        """Milliseconds of one decode step with ``batch`` sequences running."""
        return self.base_ms + self.per_seq_ms * batch

    def step_seconds(self, batch: int) -> float:
        """Seconds of one decode step with ``batch`` sequences running.

        Written as ``0.010 + 0.0004 * batch`` (not ``step_ms / 1000``) so that
        ``offpeak simulate policies`` gives ``docs/planning.md``'s table to the last digit.
        """
        return self.base_ms / 1000 + self.per_seq_ms / 1000 * batch

    def per_user_tokens_per_s(self, batch: int) -> float:
        """Tokens per second each sequence sees: one token per step."""
        return 1000.0 / self.step_ms(batch)

    def total_tokens_per_s(self, batch: int) -> float:
        """Tokens per second over the whole batch: one token per sequence per step."""
        return batch * 1000.0 / self.step_ms(batch)


@dataclass(frozen=True)
class BatchRow:
    batch: int
    step_ms: float
    per_user_tokens_per_s: float
    total_tokens_per_s: float


def batch_table(model: StepModel, batch_sizes: list[int]) -> list[BatchRow]:
    """One row per batch size: step ms, tokens/s each user sees and total tokens/s.

    ``docs/planning.md``'s worked example: batch 30 → 22 ms, 45 tokens/s each, 1,364 in total.
    """
    return [
        BatchRow(b, model.step_ms(b), model.per_user_tokens_per_s(b), model.total_tokens_per_s(b))
        for b in batch_sizes
    ]


def meets_floor(model: StepModel, batch: int, floor_tokens_per_s: float) -> bool:
    """Whether each of ``batch`` users gets at least ``floor_tokens_per_s``.

    Compared as step time against ``1000 / floor`` ms with a relative slack of 1e-12, so a batch
    that meets the floor exactly on paper is not rejected by rounding.
    """
    return model.step_ms(batch) <= 1000.0 / floor_tokens_per_s * (1 + 1e-12)


def best_candidate(
    model: StepModel, candidates: list[int], floor_tokens_per_s: float
) -> int | None:
    """The largest candidate batch that keeps every user at or above the floor, or ``None``.

    ``docs/planning.md``'s worked example: candidates 10/20/30/40 at 40 tokens/s give 30.
    """
    fitting = [b for b in candidates if meets_floor(model, b, floor_tokens_per_s)]
    return max(fitting) if fitting else None


def largest_batch(
    model: StepModel, floor_tokens_per_s: float | None = None, memory_limit: int | None = None
) -> int:
    """The largest batch keeping every user at or above ``floor_tokens_per_s``, capped by
    ``memory_limit`` (sequences that fit in the KV cache).

    Closed form from ``1000 / (base + per_seq × b) ≥ floor``: ``b ≤ (1000 / floor − base) /
    per_seq``, floored, then checked (and nudged by one) against ``meets_floor`` so rounding in the
    division cannot be off by one. 10 + 0.4 ms at 40 tokens/s gives 37. Offline work has no floor
    (``None``): the answer is ``memory_limit``. Returns 0 when even one sequence misses the floor.

    Raises ``ValueError`` when the batch is unbounded (no floor, or a zero per-sequence cost,
    without a memory limit) or the floor is not positive.
    """
    if floor_tokens_per_s is not None and floor_tokens_per_s <= 0:
        raise ValueError("the per-user floor must be positive tokens/s")
    if floor_tokens_per_s is not None and not meets_floor(model, 1, floor_tokens_per_s):
        return 0
    if floor_tokens_per_s is None or model.per_seq_ms <= 0:
        # Every batch size meets the floor: only memory bounds the batch.
        if memory_limit is None:
            raise ValueError("unbounded batch: give a memory limit (offline work has no floor)")
        return max(0, memory_limit)
    batch = max(0, math.floor((1000.0 / floor_tokens_per_s - model.base_ms) / model.per_seq_ms))
    while batch > 0 and not meets_floor(model, batch, floor_tokens_per_s):
        batch -= 1
    while meets_floor(model, batch + 1, floor_tokens_per_s):
        batch += 1
    return batch if memory_limit is None else max(0, min(batch, memory_limit))


# --- Engine sizing for one chunk --------------------------------------------------------------


def _round_up(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) * block_size


def _format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def choose_engine_limits(
    prompt_lens: list[int],
    max_tokens: list[int],
    kv_bytes_per_token: int,
    kv_budget_bytes: int,
    model_max_len: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_seqs_cap: int = MAX_NUM_SEQS_CAP,
) -> tuple[int, int, str]:
    """vLLM's ``max_num_seqs`` and ``max_model_len`` for one chunk, and a line explaining why.

    ``prompt_lens[i]`` and ``max_tokens[i]`` are request ``i``'s prompt tokens and reply limit.

    - ``max_model_len``: the longest ``prompt + max_tokens`` rounded up to whole KV blocks of
      ``block_size`` tokens, capped at ``model_max_len`` and at the tokens the KV budget holds
      (vLLM refuses to start when one sequence of ``max_model_len`` cannot fit).
    - ``max_num_seqs``: sequences of the chunk's average need (each request's ``prompt +
      max_tokens``, capped at ``max_model_len``, in whole blocks) that fit in ``kv_budget_bytes``
      when memory is paged (handed out as tokens arrive, ``docs/planning.md``). Counting the whole
      ``max_tokens`` means no running sequence is preempted when replies run to their limit.
      At least 1, at most the chunk's request count (more slots would stay empty) and
      ``max_num_seqs_cap``.

    Raises ``ValueError`` for empty or mismatched lists or non-positive sizes.
    """
    if not prompt_lens or len(prompt_lens) != len(max_tokens):
        raise ValueError("need one max_tokens per prompt, and at least one request")
    if min(kv_bytes_per_token, block_size, model_max_len) <= 0 or kv_budget_bytes < 0:
        raise ValueError("sizes must be positive")
    needs = [p + m for p, m in zip(prompt_lens, max_tokens, strict=True)]
    longest = max(needs)
    budget_tokens = kv_budget_bytes // kv_bytes_per_token
    budget_len = budget_tokens // block_size * block_size
    max_model_len = max(block_size, min(_round_up(longest, block_size), model_max_len, budget_len))

    blocks_needed = sum(_round_up(min(n, max_model_len), block_size) for n in needs)
    avg_tokens = blocks_needed / len(needs)
    fit = int(kv_budget_bytes // (kv_bytes_per_token * avg_tokens))
    max_num_seqs = max(1, min(fit, len(needs), max_num_seqs_cap))

    limits = []
    if longest > max_model_len:
        limits.append(
            f"{sum(n > max_model_len for n in needs):,} request(s) exceed it "
            f"(model allows {model_max_len:,}, KV budget {budget_tokens:,} tokens)"
        )
    if fit > max_num_seqs:
        limits.append(
            f"{fit:,} would fit; capped at "
            + ("the chunk's size" if max_num_seqs == len(needs) else f"{max_num_seqs_cap:,}")
        )
    elif fit < 1:
        limits.append("not even one average sequence fits the KV budget")
    explanation = (
        f"chunk of {len(needs):,} requests: longest prompt+max_tokens {longest:,} tokens -> "
        f"max_model_len {max_model_len:,} (blocks of {block_size}, model allows "
        f"{model_max_len:,}); average need {avg_tokens:,.0f} tokens x {kv_bytes_per_token:,} "
        f"B/token = {_format_bytes(avg_tokens * kv_bytes_per_token)} per sequence, KV budget "
        f"{_format_bytes(kv_budget_bytes)} -> max_num_seqs {max_num_seqs:,}"
        + (f" ({'; '.join(limits)})" if limits else "")
    )
    return max_num_seqs, max_model_len, explanation
