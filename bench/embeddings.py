"""Benchmark 5, embeddings: Offpeak end to end on all-MiniLM-L6-v2 (vLLM's pooling runner)
against ``sentence-transformers``' ``encode`` on the same inputs, in one run; then the engine
worker's peak RSS over a small and a ten times larger embeddings batch.

- **Throughput**: ``inputs`` texts (one per request line, the usual shape of an embedding
  corpus) through the whole service (upload not timed; create → completed → output file
  downloaded), and the same texts through ``SentenceTransformer.encode`` (batch size 32, its
  default) in this process. The ratio is Offpeak's inputs/s over sentence-transformers'; the
  two share the machine's two cores, one after the other. Vectors of a sample are compared
  (cosine).
- **Memory** (streaming all the way): the engine worker's peak and end RSS, its
  children (vLLM's EngineCore and model-runner processes) included and each process apart, at
  ``small`` and ``large`` inputs, each on a fresh service after the same warm-up, as
  ``bench.memory`` does for text. Flat: the large batch's peak growth no more than
  ``FLAT_SLACK_MB`` above the small one's. ``inputs`` 0 skips the side by side (a memory-only
  run writes ``embeddings-memory.json`` and leaves ``embeddings.json`` as it was).
"""

from __future__ import annotations

import base64
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson

from bench import harness
from bench.generator import _sentence
from bench.harness import MB, MIB, RssSampler, Service
from offpeak.settings import DEFAULT_EMBEDDING_MODEL

MODEL = DEFAULT_EMBEDDING_MODEL
URL: Literal["/v1/embeddings"] = "/v1/embeddings"
FLAT_SLACK_MB = 30.0
#: Inputs whose vectors are compared with sentence-transformers'.
SAMPLE = 256
#: ``RssSampler`` parts as the results name them.
PART_NAMES = {"root": "worker"}


def texts(n: int, seed: int = 0) -> list[str]:
    """``n`` deterministic sentences of 6 to 40 words (9 to ~60 tokens)."""
    rng = random.Random(seed)
    return [_sentence(rng, rng.randint(6, 40)) for _ in range(n)]


def write_file(path: Path, inputs: list[str]) -> int:
    """One request line per input, ``encoding_format`` base64 (what a corpus job asks for:
    a quarter of the bytes of float JSON). Returns the file's bytes."""
    with path.open("wb") as out:
        for i, text in enumerate(inputs):
            body = {"model": MODEL, "input": text, "encoding_format": "base64"}
            line = {"custom_id": f"e{i}", "method": "POST", "url": URL, "body": body}
            out.write(orjson.dumps(line) + b"\n")
    return path.stat().st_size


def embedding_service(**kwargs: Any) -> Any:
    """A scratch service serving the default embedding model alone (its default settings)."""
    from offpeak.settings import Settings

    config = Settings().models[MODEL].model_dump(mode="json")
    return harness.scratch_service({MODEL: config}, **kwargs)


def warm_up(service: Service, folder: Path) -> float:
    path = folder / "warm.jsonl"
    write_file(path, texts(8, seed=99))
    started = time.perf_counter()
    file_id = harness.upload(service.client, path)
    batch = service.client.batches.create(
        input_file_id=file_id, endpoint=URL, completion_window="24h"
    )
    batch = harness.wait_status(service.client, batch.id, stack=service.stack, timeout=600)
    if batch.status != "completed":
        raise RuntimeError(f"warm-up batch ended {batch.status}: {batch.errors}")
    return time.perf_counter() - started


def run_batch(service: Service, folder: Path, inputs: list[str]) -> dict[str, Any]:
    """Time create → completed → output downloaded, sampling the engine worker's RSS; returns
    the figures and the output's vectors by input index."""
    path = folder / f"embeddings-{len(inputs)}.jsonl"
    size = write_file(path, inputs)
    client = service.client
    file_id = harness.upload(client, path)
    load_start = harness.load_average()
    with RssSampler(service.pid("engine")) as engine_rss:
        started = time.perf_counter()
        batch = client.batches.create(input_file_id=file_id, endpoint=URL, completion_window="24h")
        batch = harness.wait_status(client, batch.id, stack=service.stack, poll=0.1, timeout=3600)
        ended = time.perf_counter()
        if batch.status != "completed" or batch.output_file_id is None:
            raise RuntimeError(f"batch ended {batch.status}: {batch.errors}")
        output = folder / f"embeddings-{len(inputs)}.out.jsonl"
        out_bytes = harness.download(client, batch.output_file_id, output)
        downloaded = time.perf_counter()
    counts = batch.request_counts
    if counts is None or counts.completed != len(inputs):
        raise RuntimeError(f"{counts} of {len(inputs)} lines completed")
    sample: dict[int, np.ndarray] = {}
    with output.open("rb") as lines:
        for raw in lines:
            line = orjson.loads(raw)
            index = int(line["custom_id"][1:])
            if index < SAMPLE:
                vector = line["response"]["body"]["data"][0]["embedding"]
                sample[index] = np.frombuffer(base64.b64decode(vector), "<f4")
    path.unlink()
    output.unlink()
    total = downloaded - started
    return {
        "inputs": len(inputs),
        "input_mb": size / MB,
        "output_mb": out_bytes / MB,
        "prompt_tokens": batch.usage.input_tokens if batch.usage else None,
        "run_s": ended - started,
        "total_s": total,
        "inputs_per_s": len(inputs) / total,
        "engine_rss_baseline_mb": engine_rss.baseline / MIB,
        "engine_rss_peak_mb": engine_rss.peak / MIB,
        "engine_rss_end_mb": engine_rss.end / MIB,
        "engine_rss_growth_mb": engine_rss.growth / MIB,
        # The same samples by process: the worker itself ("worker"), vLLM's engine core and
        # its model-runner process ("VLLM::Worker", where the model runs).
        "processes_mb": {
            PART_NAMES.get(name, name): {
                "baseline": engine_rss.parts_baseline.get(name, 0) / MIB,
                "peak": peak / MIB,
                "end": engine_rss.parts_end.get(name, 0) / MIB,
            }
            for name, peak in engine_rss.parts_peak.items()
        },
        "load_average_start": load_start,
        "load_average_end": harness.load_average(),
        "_sample": sample,
    }


def offpeak_run(inputs: list[str]) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="offpeak-emb-") as tmp,
        embedding_service() as service,
    ):
        warm = warm_up(service, Path(tmp))
        result = run_batch(service, Path(tmp), inputs)
        result["warm_up_s"] = warm
        return result


def sentence_transformers_run(inputs: list[str]) -> dict[str, Any]:
    """``SentenceTransformer.encode`` on the same folder, in this process (load not timed)."""
    import psutil
    from sentence_transformers import SentenceTransformer

    from workers.model_store import find_minilm_folder

    model = SentenceTransformer(str(find_minilm_folder()), device="cpu")
    model.encode(inputs[:32])  # warm-up, as Offpeak's run has one
    started = time.perf_counter()
    vectors = model.encode(inputs, batch_size=32)
    seconds = time.perf_counter() - started
    return {
        "inputs": len(inputs),
        "total_s": seconds,
        "inputs_per_s": len(inputs) / seconds,
        "process_rss_mb": psutil.Process().memory_info().rss / MIB,
        "_vectors": vectors[:SAMPLE],
    }


def side_by_side(inputs: int) -> dict[str, Any]:
    """Offpeak and ``SentenceTransformer.encode`` on the same ``inputs`` texts: their figures,
    the ratio and the smallest cosine over the first ``SAMPLE`` vectors."""
    corpus = texts(inputs)
    ours = offpeak_run(corpus)
    theirs = sentence_transformers_run(corpus)
    a, b = np.stack([ours["_sample"][i] for i in range(min(SAMPLE, inputs))]), theirs["_vectors"]
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    del ours["_sample"], theirs["_vectors"]
    ratio = ours["inputs_per_s"] / theirs["inputs_per_s"]
    harness.print_table(
        f"embeddings: {inputs:,} inputs, all-MiniLM-L6-v2 (load {harness.load_average()})",
        ["runner", "seconds", "inputs/s", "peak RSS MB"],
        [["Offpeak (create → output downloaded)", ours["total_s"], ours["inputs_per_s"],
          ours["engine_rss_peak_mb"]],
         ["sentence-transformers encode", theirs["total_s"], theirs["inputs_per_s"],
          theirs["process_rss_mb"]]],
    )  # fmt: skip
    harness.console.print(f"ratio {ratio:.2f}, min cosine {cos.min():.6f}")
    return {
        "offpeak": ours,
        "sentence_transformers": theirs,
        "ratio_offpeak_over_sentence_transformers": ratio,
        "cosine_min": float(cos.min()),
    }


def run(
    inputs: int = 10_000,
    small: int = 5_000,
    large: int = 50_000,
    memory: bool = True,
    out_dir: Path | None = None,
) -> dict[str, Any]:
    """Throughput side by side (skipped for ``inputs`` 0), then (``memory``) the two sizes;
    print, write ``embeddings.json`` (``embeddings-memory.json`` without the side by side, so
    a memory-only run keeps the last side by side's figures)."""
    machine = harness.machine()
    compared = side_by_side(inputs) if inputs else {}
    runs = []
    if memory:
        for n in (small, large):
            r = offpeak_run(texts(n, seed=n))
            del r["_sample"]
            runs.append(r)
    growth = runs[1]["engine_rss_growth_mb"] - runs[0]["engine_rss_growth_mb"] if runs else None
    # The end (the last sample, after the output is downloaded) as well as the peak: glibc's
    # heap in the model-runner process swings by tens of MiB from step to step.
    end_growth = runs[1]["engine_rss_end_mb"] - runs[0]["engine_rss_end_mb"] if runs else None
    met: dict[str, bool] = {}
    if compared:
        met["cosine"] = compared["cosine_min"] >= 0.999
    if growth is not None:
        met["engine_flat"] = growth <= FLAT_SLACK_MB
    result = {
        "benchmark": "embeddings",
        "machine": machine,
        "load_average_end": harness.load_average(),
        "params": {"inputs": inputs, "model": MODEL, "small": small, "large": large},
        **compared,
        "memory_runs": runs,
        "growth_difference_mb": growth,
        "end_difference_mb": end_growth,
        "targets": {"flat_slack_mb": FLAT_SLACK_MB, "cosine_min": 0.999},
        "met": met,
    }
    if runs:
        parts = ["worker", "VLLM::EngineCore", "VLLM::Worker"]
        harness.print_table(
            "embeddings: engine worker RSS MB (children included), then by process: peak / end",
            ["inputs", "base", "peak", "end", "+peak", *parts, "inputs/s", "load"],
            [[r["inputs"], r["engine_rss_baseline_mb"], r["engine_rss_peak_mb"],
              r["engine_rss_end_mb"], r["engine_rss_growth_mb"],
              *[f"{r['processes_mb'].get(p, {}).get('peak', 0):,.0f} / "
                f"{r['processes_mb'].get(p, {}).get('end', 0):,.0f}" for p in parts],
              r["inputs_per_s"], str(r["load_average_end"])] for r in runs],
        )  # fmt: skip
    name = "embeddings" if compared else "embeddings-memory"
    path = harness.write_result(name, result, out_dir)
    harness.console.print(f"wrote {path}")
    return result
