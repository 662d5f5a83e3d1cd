"""Measure a loaded engine's decode step time and fit the planner's ``StepModel`` to it.

The default step model (``docs/planning.md``: 10 ms + 0.4 ms per sequence) has the right shape but
invented numbers. ``calibrate`` times real decode steps at several batch sizes and fits ``base_ms +
per_seq_ms × batch`` by least squares. Results are stored per model and device in
``<model_cache_dir>/calibration.json`` under the key ``"<model>@<device>"``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from workers.engine.base import Engine, EngineRequest, SamplingSpec
from workers.planner import StepModel

CALIBRATION_FILE = "calibration.json"
DEFAULT_BATCH_SIZES = (1, 8, 32, 64)
#: A prompt a model continues for many tokens, so no sequence stops early at end-of-sequence.
CALIBRATION_PROMPT = "Count from one to one thousand in words: one, two, three, four,"


@dataclass(frozen=True)
class CalibrationPoint:
    """Mean decode step time at one batch size, over ``steps`` steps."""

    batch: int
    step_ms: float
    steps: int


@dataclass(frozen=True)
class Calibration:
    """A fitted step model for ``model`` on ``device``, with the points it was fitted to."""

    model: str
    device: str
    step_model: StepModel
    points: list[CalibrationPoint]
    decode_tokens: int
    measured_at: str


def current_device() -> str:
    """This host's device as calibration keys it: the first CUDA GPU's name, else ``"cpu"``.

    Imports torch (seconds), so callers that know the device should pass it instead.
    """
    try:
        import torch
    except ImportError:
        return "cpu"
    if torch.cuda.is_available():
        return str(torch.cuda.get_device_name(0))
    return "cpu"


def measure_decode_step(
    engine: Engine,
    batch: int,
    decode_tokens: int,
    prompt_ids: list[int],
    prefill_steps: int = 2,
) -> CalibrationPoint:
    """Mean milliseconds of one decode step with ``batch`` identical sequences running.

    Adds ``batch`` greedy requests of ``prompt_ids`` with ``max_tokens=decode_tokens`` and steps
    until all finish. The first ``prefill_steps`` steps (prefill; vLLM's chunked prefill admits a
    few hundred short prompts in one or two) are not timed, nor are steps after a sequence has
    finished (the batch is then smaller). Greedy decoding of one prompt keeps the sequences
    identical, so they finish together.

    Raises ``RuntimeError`` when no step ran with the whole batch in decode (replies stopped
    early: raise ``decode_tokens``) or the engine does not drain.
    """
    run = uuid.uuid4().hex[:8]
    for i in range(batch):
        engine.add(
            EngineRequest(
                request_id=f"calibrate-{run}-{batch}-{i}",
                prompt_token_ids=list(prompt_ids),
                sampling=SamplingSpec(max_tokens=decode_tokens, temperature=0.0),
            )
        )
    timed: list[float] = []
    steps = 0
    while engine.num_unfinished() > 0:
        whole_batch = engine.num_unfinished() == batch
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        steps += 1
        if steps > prefill_steps and whole_batch:
            timed.append(elapsed)
        if steps > decode_tokens + prefill_steps + 1000:
            raise RuntimeError(f"engine did not finish {batch} requests in {steps} steps")
    if not timed:
        raise RuntimeError(
            f"no decode step ran with all {batch} sequences; raise decode_tokens "
            f"(now {decode_tokens}) above prefill_steps ({prefill_steps})"
        )
    return CalibrationPoint(batch=batch, step_ms=1000 * float(np.mean(timed)), steps=len(timed))


def fit_step_model(points: Sequence[CalibrationPoint]) -> StepModel:
    """Least-squares line through ``(batch, step_ms)``: intercept ``base_ms``, slope ``per_seq_ms``,
    the slope held at 0 or above.

    A decode step never gets cheaper with more sequences in it, but on a CPU whose steps are flat
    over the sizes measured timing noise can tilt the free fit downwards, and a negative slope would
    tell the planner that larger batches step faster. The best line with a slope of at least 0 is
    then the flat one through the mean (the constrained least-squares optimum lies on the boundary).

    Raises ``ValueError`` with fewer than two distinct batch sizes.
    """
    if len({p.batch for p in points}) < 2:
        raise ValueError("need at least two distinct batch sizes to fit a line")
    times = [p.step_ms for p in points]
    slope, intercept = np.polyfit([p.batch for p in points], times, 1)
    if slope < 0:
        return StepModel(base_ms=float(np.mean(times)), per_seq_ms=0.0)
    return StepModel(base_ms=float(intercept), per_seq_ms=float(slope))


def calibrate(
    engine: Engine,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    decode_tokens: int = 32,
    *,
    prefill_steps: int = 2,
    warmup: bool = True,
    cache_dir: Path | None = None,
    device: str | None = None,
) -> Calibration:
    """Measure ``engine``'s decode step at each of ``batch_sizes`` and fit a ``StepModel``.

    ``decode_tokens`` tokens are generated per sequence at each size (see
    ``measure_decode_step``); with ``warmup`` one unrecorded run at the smallest size comes first,
    so one-off costs (kernel compilation, allocator growth) do not inflate the first point. The
    engine's ``max_num_seqs`` must be at least the largest batch size, or the engine runs fewer
    sequences than counted. With ``cache_dir`` the result is also stored there (``device``
    defaults to ``current_device()``).

    Raises ``ValueError`` for fewer than two distinct batch sizes, ``RuntimeError`` as
    ``measure_decode_step``.
    """
    sizes = sorted(set(batch_sizes))
    if len(sizes) < 2 or sizes[0] < 1:
        raise ValueError("need at least two distinct batch sizes, all >= 1")
    prompt_ids = engine.encode_text(CALIBRATION_PROMPT)
    if warmup:
        measure_decode_step(engine, sizes[0], prefill_steps + 2, prompt_ids, prefill_steps)
    points = [
        measure_decode_step(engine, b, decode_tokens, prompt_ids, prefill_steps) for b in sizes
    ]
    result = Calibration(
        model=engine.model_name,
        device=device or current_device(),
        step_model=fit_step_model(points),
        points=points,
        decode_tokens=decode_tokens,
        measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    if cache_dir is not None:
        save_calibration(result, cache_dir)
    return result


def calibration_key(model: str, device: str) -> str:
    return f"{model}@{device}"


def _read(path: Path) -> dict[str, Any]:
    """The calibration file's entries; empty when it does not exist.

    Raises ``ValueError`` when the file is not a JSON object (fix or delete it by hand rather than
    silently dropping other models' calibrations).
    """
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def save_calibration(result: Calibration, cache_dir: Path) -> Path:
    """Store ``result`` in ``cache_dir/calibration.json`` under ``"<model>@<device>"``, replacing
    an earlier entry for the same key and keeping the others; returns the file's path.

    Read-modify-write under a file lock, written to a temporary file renamed into place, so
    concurrent calibrations neither lose entries nor leave a half-written file.
    """
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / CALIBRATION_FILE
    with FileLock(str(path) + ".lock"):
        entries = _read(path)
        entries[calibration_key(result.model, result.device)] = {
            "model": result.model,
            "device": result.device,
            "base_ms": result.step_model.base_ms,
            "per_seq_ms": result.step_model.per_seq_ms,
            "decode_tokens": result.decode_tokens,
            "measured_at": result.measured_at,
            "points": [asdict(p) for p in result.points],
        }
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    return path


def load_calibration(model: str, device: str, cache_dir: Path) -> StepModel | None:
    """The stored ``StepModel`` for ``model`` on ``device``, or ``None`` if never calibrated.

    Raises ``ValueError`` when the file is not a JSON object or the entry lacks its numbers.
    """
    entry = _read(Path(cache_dir).expanduser() / CALIBRATION_FILE).get(
        calibration_key(model, device)
    )
    if entry is None:
        return None
    try:
        return StepModel(base_ms=float(entry["base_ms"]), per_seq_ms=float(entry["per_seq_ms"]))
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"bad calibration entry for {model}@{device}: {err}") from None
