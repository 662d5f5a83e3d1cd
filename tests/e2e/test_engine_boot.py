"""An engine worker whose second model fails vLLM's memory check at boot says why (the model
and its ``gpu_memory_utilization`` in ``OFFPEAK_MODELS``), frees what its first model holds and
exits at once with ``EXIT_ENGINE_NOT_STARTED``, rather than hanging with that engine loaded.

Runs real vLLM engines (run it under ``flock /tmp/offpeak-engine.lock``)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from offpeak.settings import default_models
from tests.support.processes import alive, tree, wait_gone
from tests.support.smollm2 import DEFAULT_MODEL
from workers.engine.load_failure import EXIT_ENGINE_NOT_STARTED

EMBEDDING = "all-MiniLM-L6-v2"
#: Seconds from the memory check's refusal to the worker's exit (its first engine's close
#: included): a hang is well past it.
EXIT_WITHIN_S = 45.0


def test_a_model_failing_the_memory_check_at_boot_is_named_and_the_worker_exits(
    tmp_path: Path,
) -> None:
    models = {name: config.model_dump() for name, config in default_models().items()}
    # The chat model starts in a small fixed KV cache; the embedding model asks for nearly all
    # of the node's memory, which vLLM's start-up check refuses.
    models[DEFAULT_MODEL]["engine_args"] = {"kv_cache_memory_bytes": 2**28}
    models[EMBEDDING]["gpu_memory_utilization"] = 0.99
    assert list(models) == [DEFAULT_MODEL, EMBEDDING]  # the failing one loads second
    env = {
        **os.environ,
        "OFFPEAK_DATA_DIR": str(tmp_path / "data"),
        "OFFPEAK_MODELS": json.dumps(models),
        "OFFPEAK_QUEUE_PREFIX": f"boot-{os.getpid()}",
    }
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "offpeak", "worker", "--role", "engine"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    seen: dict[int, psutil.Process] = {}  # the worker's tree, as it grows
    try:
        refused_at = None
        deadline = time.monotonic() + 600
        while worker.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.update((p.pid, p) for p in tree(worker.pid))
            if refused_at is None and "less than desired" in log_path.read_text(errors="replace"):
                refused_at = time.monotonic()
                deadline = refused_at + EXIT_WITHIN_S
            time.sleep(0.5)
        log = log_path.read_text(errors="replace")
        assert refused_at is not None, log[-4000:]
        assert worker.poll() is not None, f"still running {EXIT_WITHIN_S} s after the refusal"
        assert worker.returncode == EXIT_ENGINE_NOT_STARTED, log[-4000:]
        said = [line for line in log.splitlines() if line.startswith("offpeak worker: ")]
        assert len(said) == 1, log[-4000:]
        assert f"the engine for {EMBEDDING} did not start" in said[0]
        assert (
            f"gpu_memory_utilization 0.99 of NUMA node 0's memory, after {DEFAULT_MODEL}"
            in (said[0])
        )
        assert f"lower gpu_memory_utilization of {EMBEDDING} in OFFPEAK_MODELS" in said[0]
        # The chat model's engine-core and model runner went with it: their memory is free.
        assert wait_gone(list(seen.values()), timeout=10) == []
    finally:
        left = alive(list(seen.values()))
        for proc in left:
            proc.kill()
        psutil.wait_procs(left, timeout=10)
        if worker.poll() is None:
            worker.kill()
        worker.wait()
