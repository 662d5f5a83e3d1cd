"""Profiling of worker tasks for the benchmarks (``offpeak bench control --profile``).

With ``OFFPEAK_PROFILE_DIR`` set, each Celery task runs under ``cProfile`` in the thread that
executes it, and after every task the process's profile so far is written to
``<dir>/<task>-<pid>-<thread>.prof`` (``pstats`` format: ``python -m pstats`` or
``snakeviz``). Off (no hook at all) when the variable is unset; never on in production: the
profiler roughly doubles the cost of Python function calls.
"""

from __future__ import annotations

import cProfile
import os
import threading
from pathlib import Path
from typing import Any

from celery.signals import task_postrun, task_prerun

ENV = "OFFPEAK_PROFILE_DIR"
_profiles: dict[tuple[str, int], cProfile.Profile] = {}


def _key(task: Any) -> tuple[str, int]:
    return (str(getattr(task, "name", "task")).rsplit(".", 1)[-1], threading.get_ident())


def _start(task: Any = None, **_kwargs: Any) -> None:
    profile = _profiles.setdefault(_key(task), cProfile.Profile())
    profile.enable()


def _stop(task: Any = None, **_kwargs: Any) -> None:
    key = _key(task)
    profile = _profiles.get(key)
    if profile is None:
        return
    profile.disable()
    folder = Path(os.environ[ENV])
    folder.mkdir(parents=True, exist_ok=True)
    profile.dump_stats(folder / f"{key[0]}-{os.getpid()}-{key[1]}.prof")


def install() -> bool:
    """Hook the task signals if ``OFFPEAK_PROFILE_DIR`` is set; returns whether it did."""
    if not os.environ.get(ENV):
        return False
    task_prerun.connect(_start, weak=False)
    task_postrun.connect(_stop, weak=False)
    return True
